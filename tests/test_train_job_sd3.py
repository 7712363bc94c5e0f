"""`python -m jobs.train` on the tiny SD3 config end to end, in a fresh process as a user runs it: vllm-omni's SD3
pipeline (our FlowGRPO subclass) behind Serve, the OCR + JPEG reward, two FSDP2 workers training a LoRA of the
MMDiT. Every step stays on-policy with the rollout's log-probs reproduced (the trainer runs diffusers' transformer,
vllm-omni its own with fused q/k/v projections: equal within 1e-5 in fp32; the diffusers engine's are bit-equal,
tests/rollout/test_sd3_engines.py), evaluations run through the same Serve app, and the adapter is saved as diffusers
loads SD3 LoRAs."""

import math

import pytest
from job_runs import eval_lines, history, run_job

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
STEPS = 8  # two checkpoints (every 4 steps), evaluations before the first step and after the last


@pytest.fixture(scope="module")
def sd3_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sd3") / "run"
    # one replica of each (the Qwen-Image jobs exercise two): half the start-up CPU on 2 cores
    done = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "rollout.num_replicas=1",
                   "reward.num_replicas=1", config="configs/tiny_sd3_cpu.yaml")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "training of sd3" in done.stdout
    return run_dir


def test_tiny_sd3_run_is_on_policy_with_the_rollout_s_log_probs(sd3_run):
    records = history(sd3_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for step, r in enumerate(records, start=1):
        assert r["rollout/adapter_version"] == step and r["rollout/staleness_max"] == 0
        assert r["rollout/logprob_mismatch_max"] <= 1e-5 and r["actor/ratio_dev_first_pass_max"] <= 1e-5
        assert r["rollout/images"] == 16 and math.isfinite(r["actor/loss"]) and r["perf/useful_tflop"] > 0
    assert any(r["actor/grad_norm"] > 0 for r in records)


def test_tiny_sd3_run_saves_a_diffusers_lora_and_evaluates(sd3_run, tiny_sd3_dir):
    import torch
    from diffusers import StableDiffusion3Pipeline

    from app.config import load

    adapter = sd3_run / "checkpoints" / f"checkpoint_step_{STEPS:06d}" / "adapter"
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, dtype=torch.float32)
    before = pipe.transformer.proj_out.weight.clone()
    pipe.load_lora_weights(adapter)  # as a user loads it, into the base model's pipeline
    config = pipe.transformer.peft_config["default_0"]
    assert (config.r, sorted(config.target_modules)) == (load("configs/tiny_sd3_cpu.yaml").model.lora_rank,
                                                         ["proj_out"])
    pipe.fuse_lora()
    assert not torch.equal(pipe.transformer.proj_out.weight, before)  # a trained adapter, not zeros
    evaluations = eval_lines(sd3_run)
    assert sorted(evaluations) == [0, 8]
    assert evaluations[0]["sentinel/distance_to_base"] == 0.0 and evaluations[8]["sentinel/distance_to_base"] > 0
    assert all(e["eval/images"] == 8 and math.isfinite(e["eval/reward/mean"]) for e in evaluations.values())
