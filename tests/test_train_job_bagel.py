"""`python -m jobs.train` on the tiny BAGEL config end to end, in a fresh process as a user runs it: text-to-image
and edit groups from our BAGEL engine behind Serve, two FSDP2 workers training the generation expert's
LoRA. The run stays on-policy with the rollout's log-probs reproduced exactly, and writes a peft adapter."""

import math

import pytest
from job_runs import history, run_job

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
STEPS = 8  # two checkpoints (every 4 steps)


@pytest.fixture(scope="module")
def bagel_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bagel") / "run"
    # one replica of each (the Qwen-Image jobs exercise two): where a group is sampled changes nothing, and one of
    # each starts in half the CPU time
    done = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "rollout.num_replicas=1",
                   "reward.num_replicas=1", config="configs/tiny_bagel_cpu.yaml")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "training of bagel" in done.stdout and "a peft adapter folder" in done.stdout
    return run_dir


def test_tiny_bagel_run_is_on_policy_with_exact_log_probs(bagel_run):
    records = history(bagel_run)
    for step, r in enumerate(records, start=1):
        assert r["step"] == step and r["rollout/adapter_version"] == step and r["rollout/staleness_max"] == 0
        assert r["rollout/logprob_mismatch_max"] == 0.0  # fp32 CPU: the trainer scores exactly what was sampled
        assert r["actor/ratio_dev_first_pass_max"] == 0.0
        assert r["rollout/images"] == 16 and math.isfinite(r["actor/loss"]) and r["perf/useful_tflop"] > 0
    assert len(records) == STEPS and any(r["actor/grad_norm"] > 0 for r in records)
    final = bagel_run / "checkpoints" / f"checkpoint_step_{STEPS:06d}" / "adapter"
    assert (final / "adapter_model.safetensors").is_file() and (final / "adapter_config.json").is_file()
    assert (bagel_run / "samples.png").stat().st_size > 1000


def test_tiny_bagel_run_evaluates_held_out_edits(bagel_run):
    """The tiny BAGEL config evaluates `ocr_edit_eval_tiny` (2 rendered signs to re-letter, 2 images each) before
    the first step and after the last, its sentinels against the base model's edits."""
    from job_runs import eval_lines

    evaluations = eval_lines(bagel_run)
    assert sorted(evaluations) == [0, STEPS]
    assert evaluations[0]["sentinel/distance_to_base"] == 0.0 and evaluations[STEPS]["sentinel/distance_to_base"] > 0
    assert all(e["eval/images"] == 4 and math.isfinite(e["eval/reward/mean"]) for e in evaluations.values())
    assert (bagel_run / "eval" / f"grid_step_{STEPS:06d}.png").is_file()
