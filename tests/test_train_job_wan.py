"""`python -m jobs.train` on the tiny Wan config end to end, in a fresh process as a user runs it: a vllm-omni
replica (our FlowGRPO Wan pipeline) behind Serve generating groups of videos, the reward replica scoring every other
frame's JPEG size and the videos' temporal consistency, two FSDP2 workers training a LoRA of the transformer. The
trainer's first pass is exact (its own old log-probs; vllm-omni's are within 1e-6 of them), every step logs what its
groups weighed (`rollout/trajectory_mb`), the logged steps leave an mp4 and a filmstrip a person can look at,
evaluations run through the same Serve app, and the adapter is saved as diffusers loads Wan LoRAs."""

import math

import numpy as np
import pytest
from job_runs import assert_a_trained_lora_loads, assert_evaluated_before_and_after, history, run_job

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
STEPS = 4  # one checkpoint, evaluations before the first step and after the last


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory, job_cluster):
    run_dir = tmp_path_factory.mktemp("wan") / "run"
    done = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "rollout.num_replicas=1",
                   "reward.num_replicas=1", f"eval.every={STEPS}", "logging.image_every=2",
                   "reward.weights={jpeg_compressibility: 1.0, temporal_consistency: 0.5}", "reward.frames.every=2",
                   config="configs/tiny_wan_cpu.yaml", cluster=job_cluster)
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
