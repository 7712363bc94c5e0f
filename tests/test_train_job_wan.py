"""`python -m jobs.train` on the tiny Wan config end to end, in a fresh process as a user runs it: a vllm-omni
replica (our FlowGRPO Wan pipeline) behind Serve generating groups of videos, the reward replica scoring every other
frame's JPEG size and the videos' temporal consistency, two FSDP2 workers training a LoRA of the transformer. The
trainer's first pass is exact (its own old log-probs; vllm-omni's are within 1e-6 of them), every step logs what its
groups weighed (`rollout/trajectory_mb`), the logged steps leave an mp4 and a filmstrip a person can look at,
evaluations run through the same Serve app, and the adapter is saved as diffusers loads Wan LoRAs.

The Serve application the run leaves running (`--keep-serving`) then answers HTTP as under `serve run`: POST
/v1/videos/generations returns the group as mp4s of the frames asked for (by count or by seconds at fps) and its
trajectory (fp32 video latents of every step), and reproduces it from the seed; frame counts the VAE cannot take,
durations over the limit and the images route get a 400 naming the field; the deployment keeps serving."""

import base64
import io
import math

import numpy as np
import pytest
import requests
from job_runs import assert_a_trained_lora_loads, assert_evaluated_before_and_after, history, run_job
from served_api import trajectory_metadata

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
STEPS = 4  # one checkpoint, evaluations before the first step and after the last


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory, job_cluster):
    run_dir = tmp_path_factory.mktemp("wan") / "run"
    done = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "rollout.num_replicas=1",
                   "reward.num_replicas=1", f"eval.every={STEPS}", "logging.image_every=2",
                   "reward.weights={jpeg_compressibility: 1.0, temporal_consistency: 0.5}", "reward.frames.every=2",
                   "serve.max_frames=17", "--keep-serving", config="configs/tiny_wan_cpu.yaml", cluster=job_cluster)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "training of wan" in done.stdout
    return run_dir


def test_tiny_wan_run_trains_on_policy_and_logs_what_its_groups_weigh(wan_run):
    records = history(wan_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # a group: 4 videos x 5 latents [16, 3, 8, 8] fp32, 4 log-probs and 4 timesteps, 5 sigmas, the states [512, 32]
    # and their mask, the videos [9, 64, 64, 3] uint8, the timestep flag
    latents, frames = 4 * 5 * 16 * 3 * 8 * 8 * 4, 4 * 9 * 64 * 64 * 3
    small = 4 * 4 * 4 + 4 * 4 + 5 * 4 + 512 * 32 * 4 + 512 * 8 + 1
    for step, r in enumerate(records, start=1):
        assert r["actor/ratio_dev_first_pass_max"] == 0.0 and r["rollout/logprob_mismatch_max"] <= 1e-6
        assert r["rollout/adapter_version"] == step and math.isfinite(r["actor/loss"]) and r["perf/useful_tflop"] > 0
        assert r["rollout/trajectory_mb_max"] == pytest.approx((latents + frames + small) / 2**20)
        assert 0 < r["reward/temporal_consistency/mean"] <= 1 and r["reward/jpeg_compressibility/mean"] < 0
    assert any(r["actor/grad_norm"] > 0 for r in records)


def test_tiny_wan_run_leaves_videos_a_person_can_watch(wan_run):
    import av
    from PIL import Image

    for step in (2, 4):
        with av.open(str(wan_run / "images" / f"step_{step:06d}.mp4")) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 9 and frames[0].shape[0] > 2 * 64  # the labelled grid of the step's videos, playing
        assert not np.array_equal(frames[0], frames[-1])
        strip = np.asarray(Image.open(wan_run / "images" / f"step_{step:06d}.png"))
        assert strip.shape[1] > 6 * 64  # six frames of each video side by side
    assert (wan_run / "samples.png").is_file()


def test_tiny_wan_run_saves_a_diffusers_lora_and_evaluates(wan_run, tiny_wan_dir):
    assert_a_trained_lora_loads("WanPipeline", tiny_wan_dir, wan_run, STEPS, "configs/tiny_wan_cpu.yaml")
    assert_evaluated_before_and_after(wan_run, STEPS)


def videos(url: str, **body):
    return requests.post(f"{url}/v1/videos/generations", json={"prompt": 'a sign that says "OPEN"', **body},
                         timeout=120)


def frames_of(b64_mp4: str) -> list:
    """(width, height, fps) of each frame of an mp4."""
    import av

    with av.open(io.BytesIO(base64.b64decode(b64_mp4))) as container:
        stream = container.streams.video[0]
        return [(frame.width, frame.height, float(stream.average_rate)) for frame in container.decode(stream)]


def test_the_run_s_application_returns_a_group_of_videos_with_its_trajectory_reproduced_from_its_seed(wan_run,
                                                                                                     job_cluster):
    from safetensors.torch import load

    served = job_cluster.served_url()  # the run's replica, serving its last adapter
    response = videos(served, n=2, seed=5, num_frames=5, num_inference_steps=3, return_trajectory=True, guidance=3.0,
                      negative_prompt=" ")
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
        again = videos(served, n=2, seed=seed, num_frames=5, num_inference_steps=3, return_trajectory=True,
                       guidance=3.0, negative_prompt=" ")
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
def test_a_length_or_size_the_run_s_application_cannot_take_is_a_400_naming_it(wan_run, job_cluster, body, param,
                                                                               message):
    response = videos(job_cluster.served_url(), n=1, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_the_images_route_points_to_the_videos_route_and_the_replica_serves_on(wan_run, job_cluster):
    served = job_cluster.served_url()
    response = requests.post(f"{served}/v1/images/generations", json={"prompt": "a cat"}, timeout=60)
    assert response.status_code == 400 and "/v1/videos/generations" in response.json()["error"]["message"]
    assert videos(served, n=1, seed=6).status_code == 200
