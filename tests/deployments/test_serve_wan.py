"""Wan served by Ray Serve: a vllm-omni replica (our FlowGRPO Wan pipeline) behind the load balancer. POST
/v1/videos/generations returns the group as mp4s of the frames asked for (by count or by seconds at fps) and its
trajectory (fp32 video latents of every step), and reproduces it from the seed; frame counts the VAE cannot take,
durations over the limit and the images route get a 400 naming the field; the deployment keeps serving."""

import base64
import io

import pytest
import requests
from served_api import trajectory_metadata

pytestmark = pytest.mark.slow  # a Ray cluster and Serve

APP, PREFIX = "flowgrpo_wan", "/wan"


@pytest.fixture(scope="module")
def served(serve_url, tiny_wan_dir):
    from ray import serve

    from deployments.builders import build_app

    args = {"model": {"family": "wan", "path": str(tiny_wan_dir), "dtype": "float32"},
            "rollout": {"engine": "vllm_omni", "group_size": 2, "height": 64, "width": 64, "num_frames": 9,
                        "num_inference_steps": 3, "num_replicas": 1, "replica_num_cpus": 0.25},
            "reward": {"weights": {"jpeg_compressibility": 1.0}, "replica_num_cpus": 0.25},
            "serve": {"max_n": 4, "max_side": 128, "max_steps": 4, "max_frames": 17, "api_num_cpus": 0.1}}
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


def videos(url: str, **body):
    return requests.post(f"{url}/v1/videos/generations", json={"prompt": 'a sign that says "OPEN"', **body},
                         timeout=120)


def frames_of(b64_mp4: str) -> list:
    """(width, height, fps) of each frame of an mp4."""
    import av

    with av.open(io.BytesIO(base64.b64decode(b64_mp4))) as container:
        stream = container.streams.video[0]
        return [(frame.width, frame.height, float(stream.average_rate)) for frame in container.decode(stream)]


def test_a_group_of_videos_with_its_trajectory_reproduced_from_its_seed(served):
    from safetensors.torch import load

    response = videos(served, n=2, seed=5, num_frames=5, return_trajectory=True, guidance=3.0, negative_prompt=" ")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["num_frames"] == 5 and body["fps"] == 16 and len(body["data"]) == 2
    assert frames_of(body["data"][0]["b64_mp4"]) == [(64, 64, 16.0)] * 5
    raw = base64.b64decode(body["trajectory"]["b64"])
    tensors = load(raw)
    assert tensors["latents"].shape == (2, 4, 16, 2, 8, 8) and tensors["log_probs"].shape == (2, 3)
    meta = trajectory_metadata(raw)
    assert (meta["family"], meta["num_frames"], meta["guidance_scale"]) == ("wan", "5", "3.0")
    def latents(seed):  # the same seed, the same group (its mp4s are lossy: x264 may spend its bits otherwise)
        again = videos(served, n=2, seed=seed, num_frames=5, return_trajectory=True, guidance=3.0, negative_prompt=" ")
        return load(base64.b64decode(again.json()["trajectory"]["b64"]))["latents"]

    assert latents(5).equal(tensors["latents"]) and not latents(6).equal(tensors["latents"])
    default = videos(served, n=1, seed=5, seconds=0.5, fps=16).json()  # 0.5 s at 16 fps: 9 frames
    assert default["num_frames"] == 9 and len(frames_of(default["data"][0]["b64_mp4"])) == 9


@pytest.mark.parametrize("body,param,message", [
    ({"num_frames": 8}, "num_frames", "4k + 1"),
    ({"seconds": 0.3}, "seconds", "0.3 s at 16 fps is 6 frames"),
    ({"num_frames": 21}, "num_frames", "over this deployment's limit of 17"),
    ({"num_frames": 5, "seconds": 1.0}, "seconds", "not both"),
    ({"size": "60x64"}, "size", "multiple of 16"),  # the VAE and the patches
])
def test_a_length_or_size_the_deployment_cannot_take_is_a_400_naming_it(served, body, param, message):
    response = videos(served, n=1, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_the_images_route_points_to_the_videos_route_and_the_replica_serves_on(served):
    response = requests.post(f"{served}/v1/images/generations", json={"prompt": "a cat"}, timeout=60)
    assert response.status_code == 400 and "/v1/videos/generations" in response.json()["error"]["message"]
    assert videos(served, n=1, seed=6).status_code == 200
