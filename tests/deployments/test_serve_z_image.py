"""Z-Image served by Ray Serve: vllm-omni's Z-Image pipeline (our FlowGRPO subclass) behind the load balancer.
Generation over HTTP returns the group and its trajectory (the captions at their own lengths, fp32 latents) and
reproduces it from the seed; CFG at our scale; a prompt over the text encoder's limit is refused with a 400 naming
it, and the deployment keeps serving."""

import base64

import pytest
from served_api import generate, trajectory_metadata

pytestmark = pytest.mark.slow  # a Ray cluster and Serve

APP, PREFIX = "flowgrpo_z_image", "/z_image"


@pytest.fixture(scope="module")
def served(serve_url, tiny_z_image_dir):
    from ray import serve

    from deployments.builders import build_app

    args = {"model": {"family": "z_image", "path": str(tiny_z_image_dir), "dtype": "float32"},
            "rollout": {"group_size": 2, "height": 64, "width": 64, "num_inference_steps": 3, "num_replicas": 1,
                        "replica_num_cpus": 0.25},
            "reward": {"weights": {"ocr": 1.0}, "replica_num_cpus": 0.25},
            "serve": {"max_n": 4, "max_side": 128, "max_steps": 4, "api_num_cpus": 0.1}}
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


def test_generation_returns_the_group_and_its_trajectory_and_refuses_a_long_prompt(served):
    from safetensors.torch import load

    response = generate(served, n=2, seed=5, return_trajectory=True, guidance=3.0, negative_prompt=" ")
    assert response.status_code == 200, response.text
    body = response.json()
    raw = base64.b64decode(body["trajectory"]["b64"])
    tensors = load(raw)
    assert tensors["latents"].shape == (2, 4, 16, 8, 8) and tensors["log_probs"].shape == (2, 3)
    assert tensors["prompt_embeds"].shape[1] == 32 and tensors["negative_prompt_embeds"].shape[1] == 32
    assert tensors["prompt_mask"].sum() == tensors["prompt_embeds"].shape[0]  # its own tokens, no padding
    meta = trajectory_metadata(raw)
    assert (meta["family"], meta["guidance_scale"]) == ("z_image", "3.0")
    again = generate(served, n=2, seed=5, guidance=3.0, negative_prompt=" ").json()
    assert [d["b64_json"] for d in again["data"]] == [d["b64_json"] for d in body["data"]]
    too_long = generate(served, n=2, prompt="zebra " * 600)
    assert too_long.status_code == 400 and "prompt" in too_long.text and "512" in too_long.text
    assert generate(served, n=1, seed=6).status_code == 200  # the replica serves on
