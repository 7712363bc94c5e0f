"""`python -m jobs.train` on the tiny Z-Image config end to end, in a fresh process as a user runs it: vllm-omni's
Z-Image pipeline (our FlowGRPO subclass) behind Serve, the OCR + JPEG reward, two FSDP2 workers training a LoRA of
the transformer. The trainer's first pass reproduces its own old log-probs exactly and vllm-omni's within 1e-5
(its transformer fuses q/k/v and the MLP's w1/w3), evaluations run through the same Serve app, and the adapter is
saved as diffusers loads Z-Image LoRAs."""

import math

import pytest
from job_runs import assert_a_trained_lora_loads, assert_evaluated_before_and_after, history, run_job

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
STEPS = 4  # one checkpoint, evaluations before the first step and after the last


@pytest.fixture(scope="module")
def z_image_run(tmp_path_factory, job_cluster):
    run_dir = tmp_path_factory.mktemp("z_image") / "run"
    # one replica of each (the Qwen-Image jobs exercise two): half the start-up CPU on 2 cores
    done = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "rollout.num_replicas=1",
                   "reward.num_replicas=1", f"eval.every={STEPS}", config="configs/tiny_z_image_cpu.yaml",
                   cluster=job_cluster)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "training of z_image" in done.stdout
    return run_dir


def test_tiny_z_image_run_trains_on_policy(z_image_run):
    records = history(z_image_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for step, r in enumerate(records, start=1):
        assert r["actor/ratio_dev_first_pass_max"] == 0.0 and r["rollout/logprob_mismatch_max"] <= 1e-5
        assert r["rollout/adapter_version"] == step and math.isfinite(r["actor/loss"]) and r["perf/useful_tflop"] > 0
        assert r["rollout/staleness_max"] == 0 and r["rollout/images"] == 16
    assert any(r["actor/grad_norm"] > 0 for r in records)


def test_tiny_z_image_run_saves_a_diffusers_lora_and_evaluates(z_image_run, tiny_z_image_dir):
    assert_a_trained_lora_loads("ZImagePipeline", tiny_z_image_dir, z_image_run, STEPS, "configs/tiny_z_image_cpu.yaml")
    assert_evaluated_before_and_after(z_image_run, STEPS)
