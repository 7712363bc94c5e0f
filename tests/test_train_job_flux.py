"""`python -m jobs.train` on the tiny FLUX.1 config end to end, in a fresh process as a user runs it: vllm-omni's
FLUX pipeline (our FlowGRPO subclass) behind Serve, the guidance-distilled model's guidance input carried from the
config to every group, the OCR + JPEG reward, two FSDP2 workers training a LoRA of the transformer. The trainer
reproduces the rollout's log-probs (vllm-omni's transformer fuses q/k/v: equal within 1e-5 in fp32), evaluations
run through the same Serve app, and the adapter is saved as diffusers loads FLUX LoRAs."""

import math

import pytest
from job_runs import eval_lines, history, run_job

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
    import torch
    from diffusers import FluxPipeline

    from app.config import load

    model = load("configs/tiny_flux_cpu.yaml").model
    adapter = flux_run / "checkpoints" / f"checkpoint_step_{STEPS:06d}" / "adapter"
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(adapter)  # as a user loads it, into the base model's pipeline
    config = pipe.transformer.peft_config["default_0"]
    assert (config.r, sorted(config.target_modules)) == (model.lora_rank, sorted(model.lora_targets))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    after = pipe.transformer.state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before)  # a trained adapter, not zeros
    evaluations = eval_lines(flux_run)
    assert sorted(evaluations) == [0, STEPS]
    assert evaluations[0]["sentinel/distance_to_base"] == 0.0 and evaluations[STEPS]["sentinel/distance_to_base"] > 0
    assert all(e["eval/images"] == 8 and math.isfinite(e["eval/reward/mean"]) for e in evaluations.values())
