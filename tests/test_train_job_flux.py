"""`python -m jobs.train` on the tiny FLUX.1 config end to end, in a fresh process as a user runs it: vllm-omni's
FLUX pipeline (our FlowGRPO subclass) behind Serve, the guidance-distilled model's guidance input carried from the
config to every group, the OCR + JPEG reward, two FSDP2 workers training a LoRA of the transformer. The trainer
reproduces the rollout's log-probs (vllm-omni's transformer fuses q/k/v: equal within 1e-5 in fp32), evaluations
run through the same Serve app, and the adapter is saved as diffusers loads FLUX LoRAs."""

import math

import pytest
from job_runs import assert_a_trained_lora_loads, assert_evaluated_before_and_after, history, run_job

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
STEPS = 4  # one checkpoint, evaluations before the first step and after the last


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory, job_cluster):
    run_dir = tmp_path_factory.mktemp("flux") / "run"
    # one replica of each (the Qwen-Image jobs exercise two): half the start-up CPU on 2 cores
    done = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "rollout.num_replicas=1",
                   "reward.num_replicas=1", f"eval.every={STEPS}", config="configs/tiny_flux_cpu.yaml",
                   cluster=job_cluster)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "training of flux" in done.stdout
    return run_dir


def test_tiny_flux_run_trains_on_policy_with_the_rollout_s_log_probs(flux_run):
    records = history(flux_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for step, r in enumerate(records, start=1):
        assert r["rollout/logprob_mismatch_max"] <= 1e-5 and r["actor/ratio_dev_first_pass_max"] <= 1e-5
        assert r["rollout/adapter_version"] == step and math.isfinite(r["actor/loss"]) and r["perf/useful_tflop"] > 0
        assert r["rollout/staleness_max"] == 0 and r["rollout/images"] == 16
    assert any(r["actor/grad_norm"] > 0 for r in records)


def test_tiny_flux_run_saves_a_diffusers_lora_and_evaluates(flux_run, tiny_flux_dir):
    assert_a_trained_lora_loads("FluxPipeline", tiny_flux_dir, flux_run, STEPS, "configs/tiny_flux_cpu.yaml")
    assert_evaluated_before_and_after(flux_run, STEPS)
