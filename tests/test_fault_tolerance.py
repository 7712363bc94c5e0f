"""Real processes die during the tiny job and the run loses nothing.

Two runs of `python -m jobs.train` on the tiny config (2 vllm-omni rollout replicas, 2 reward replicas, 2 FSDP2
workers, a checkpoint every 2 steps), each losing two processes of its own local Ray cluster while it trains:

- run A: a Rollout replica dies as it starts generating group 5 (step 2, with other groups in flight on it), and
  a Reward replica is SIGKILLed from outside when step 3's progress line prints;
- run B: a Rollout replica dies as it starts loading adapter version 2 (the publish at the end of step 2), and a
  training worker is SIGKILLed from outside when step 3's line prints.

In-process deaths (`os._exit` at a named point, `app/faults.py`) are for moments too short or too uncertain to hit
from outside. Every run must finish all its steps with exactly the per-step rewards of the uninterrupted run with
the same seed (`tiny_run`, shared with tests/test_train_job.py): the loop is deterministic per seed, so equal
rewards prove that no group was lost, duplicated or sampled by another adapter. Each run takes about 3 minutes on
2 cores; the two tests of a run share it.
"""

from dataclasses import dataclass
from pathlib import Path

import pytest

from app.metrics import read_history
from job_runs import KilledRun

STEPS = 5


@dataclass
class Outcome:
    records: list[dict]  # the last record of every step
    lines: list[str]  # every metrics line written, re-run steps included
    run: KilledRun
    crashed: bool  # the in-process crash point was reached


def run_with_deaths(run_dir: Path, crash: str, kill_title: str, kill_after_step: int) -> Outcome:
    marker = run_dir.parent / "crashed"
    run = KilledRun(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "train.checkpoint_every=2",
                    title=kill_title, after_step=kill_after_step, env={"RAY_FLOWGRPO_CRASH": f"{crash}@{marker}"})
    assert run.wait() == 0, run.output[-6000:]
    return Outcome(read_history(run_dir), (run_dir / "metrics.jsonl").read_text().splitlines(), run,
                   marker.exists())


@pytest.fixture(scope="module")
def rollout_and_reward_deaths(tmp_path_factory) -> Outcome:
    return run_with_deaths(tmp_path_factory.mktemp("deaths_a") / "run", "rollout.generate=5",
                           "ray::ServeReplica:flowgrpo:Reward", kill_after_step=3)


@pytest.fixture(scope="module")
def publish_and_worker_deaths(tmp_path_factory) -> Outcome:
    return run_with_deaths(tmp_path_factory.mktemp("deaths_b") / "run", "rollout.load_lora=2",
                           "ray::RayTrainWorker", kill_after_step=3)


def assert_same_as_uninterrupted(outcome: Outcome, tiny_run: Path) -> None:
    records, uninterrupted = outcome.records, read_history(tiny_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["reward/mean"] for r in records] == [u["reward/mean"] for u in uninterrupted[:STEPS]]
    for r in records:
        assert r["rollout/staleness_max"] == 0 and r["rollout/adapter_version"] == r["step"]
        assert r["rollout/logprob_mismatch_max"] <= 1e-5  # every group was sampled by the adapter it claims


def test_a_rollout_replica_dying_while_groups_generate(rollout_and_reward_deaths, tiny_run):
    assert rollout_and_reward_deaths.crashed, "no Rollout replica reached group 5"
    assert_same_as_uninterrupted(rollout_and_reward_deaths, tiny_run)


def test_a_reward_replica_killed(rollout_and_reward_deaths, tiny_run):
    assert rollout_and_reward_deaths.run.killed, "no Reward replica was found to kill"
    assert_same_as_uninterrupted(rollout_and_reward_deaths, tiny_run)


def test_a_rollout_replica_dying_while_the_adapter_is_published(publish_and_worker_deaths, tiny_run):
    outcome = publish_and_worker_deaths
    assert outcome.crashed, "no Rollout replica reached the load of adapter version 2"
    assert_same_as_uninterrupted(outcome, tiny_run)
    # the publish of version 2 met a replica that died and went on with the live one; the replica Serve started
    # in its place loaded version 2 from the adapter store before it served (staleness 0 above)
    assert outcome.records[1]["rollout/publish_lost_replicas_max"] == 1


def test_a_training_worker_killed_restarts_from_the_latest_checkpoint(publish_and_worker_deaths, tiny_run):
    outcome = publish_and_worker_deaths
    assert outcome.run.killed, "no training worker was found to kill"
    assert_same_as_uninterrupted(outcome, tiny_run)
    # the worker group started again from the latest checkpoint and ran the steps after it again
    assert "continuing from the checkpoint of step" in outcome.run.output, outcome.run.output[-4000:]
    assert len(outcome.lines) > STEPS
