"""`python -m jobs.train` on the tiny BAGEL config end to end, in a fresh process as a user runs it: text-to-image
and edit groups from our BAGEL engine behind Serve, two FSDP2 workers training the generation expert's
LoRA. The run stays on-policy with the rollout's log-probs reproduced exactly, and writes a peft adapter.

The run also switches on the loss terms every tiny config leaves off (one run instead of one more: each end-to-end
run pays a Ray cluster, a Serve app and a Train worker group before its first step): β·KL to the adapter-free
reference, a second (off-policy, clipped) pass, old log-probs recomputed by the trainer, half the timesteps."""

import math

import pytest
from job_runs import history, run_job

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
STEPS = 8  # two checkpoints (every 4 steps)
LOSS_TERMS = ("train.kl_beta=0.5", "train.num_inner_epochs=2", "train.timestep_fraction=0.5",
              "train.old_logprob=recompute")


@pytest.fixture(scope="module")
def bagel_run(tmp_path_factory, job_cluster):
    run_dir = tmp_path_factory.mktemp("bagel") / "run"
    # one replica of each (the Qwen-Image jobs exercise two): where a group is sampled changes nothing, and one of
    # each starts in half the CPU time
    done = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "rollout.num_replicas=1",
                   "reward.num_replicas=1", *LOSS_TERMS, config="configs/tiny_bagel_cpu.yaml", cluster=job_cluster)
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
    assert all(r["actor/ratio_dev_max"] > 1e-6 for r in records)  # the second pass scores an updated policy
    assert all(r["actor/kl"] > 0 for r in records)  # after the first optimizer step the adapter leaves the reference
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
