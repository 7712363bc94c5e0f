"""Real processes die during the tiny job and the run loses nothing.

One run of `python -m jobs.train` on the tiny config (2 vllm-omni rollout replicas, 2 reward replicas, 2 FSDP2
workers, a checkpoint every 2 steps, 6 steps) loses four processes of the long-lived job cluster it joins (with
the Serve application the uninterrupted run left there) while it trains:

- a Rollout replica dies just after it starts generating group 5 (step 2, with other groups in flight on it);
- a Reward replica is SIGKILLed from outside when step 2's progress line prints;
- a training worker is SIGKILLed from outside when step 3's line prints: the worker group restarts from the
  checkpoint of step 2 and runs steps 3.. again;
- a Rollout replica dies as it starts loading adapter version 5 (the publish at the end of step 5).

In-process deaths (`os._exit` at a named point, `app/faults.py`) are for moments too short or too uncertain to hit
from outside. The run must finish all its steps with exactly the per-step rewards of the uninterrupted run with
the same seed (`tiny_run`, shared with tests/test_train_job.py): the loop is deterministic per seed, so equal
rewards prove that no group was lost, duplicated or sampled by another adapter. One run serves the four tests
(each checks its own death).

The run then stops, and `--resume` on a copy of its folder continues it as a user would after a stopped or crashed
job (a new driver on the cluster, whose replicas served another run's adapter last): steps 7-8 must equal the
uninterrupted run's, which needs the adapter, the optimizer state, the prompt position and every rank's RNG state of
the checkpoint of step 6.
"""

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from job_runs import KilledRun, comparable, eval_lines, run_job

from app.metrics import read_history

pytestmark = [pytest.mark.slow, pytest.mark.jobs]

STEPS = 6
KILLS = {2: "ray::ServeReplica:flowgrpo:Reward", 3: "ray::RayTrainWorker"}


@dataclass
class Outcome:
    records: list[dict]  # the last record of every step
    lines: list[str]  # every metrics line written, re-run steps included
    run: KilledRun
    run_dir: Path
    crashed: dict[str, bool]  # which in-process crash points were reached


@pytest.fixture(scope="module")
def deaths(tmp_path_factory, job_cluster, tiny_run) -> Outcome:
    run_dir = tmp_path_factory.mktemp("deaths") / "run"
    # on the job cluster, after the uninterrupted run, whose Serve application it uses (the same sections): the
    # loop resets its replicas to the base model first. Its crash points armed for this run only.
    # evaluation off: `tiny_run` evaluates (before step 1, every 8 steps), so equal rewards also show that
    # evaluating changes no training group
    # the uninterrupted run's application serves still unless another job ran on the cluster since (test order:
    # one of other sections replaces it), and then this run deploys its own
    follows_tiny = job_cluster.last_job == ("configs/tiny_cpu.yaml", (f"logging.dir={tiny_run}", "--keep-serving"))
    job_cluster.arm()
    run = KilledRun(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "train.checkpoint_every=2",
                    "eval.every=0", "eval.before_train=false", "--keep-serving",
                    kills=KILLS, after={3: lambda: checkpoint_registered(run_dir, step=2)}, cluster=job_cluster)
    code = run.wait()
    crashed = {name: marker.exists() for name, marker in job_cluster.markers.items()}
    for marker in job_cluster.markers.values():  # disarmed again, whatever happened
        marker.touch()
    assert code == 0, run.output[-6000:]
    if follows_tiny:
        assert "using the running rollout/reward application" in run.output  # nothing reloaded: the same sections
    return Outcome(read_history(run_dir), (run_dir / "metrics.jsonl").read_text().splitlines(), run, run_dir,
                   crashed)


def checkpoint_registered(run_dir: Path, step: int) -> bool:
    """Ray Train's controller has registered the checkpoint of `step` (it polls the workers every 2 s, so a
    worker killed right after reporting one could otherwise take it along, and the run would restart from scratch)."""
    snapshot = run_dir / "checkpoints" / "checkpoint_manager_snapshot.json"
    try:
        return f"checkpoint_step_{step:06d}" in snapshot.read_text()
    except FileNotFoundError:
        return False


def assert_same_as_uninterrupted(outcome: Outcome, tiny_run: Path) -> None:
    records, uninterrupted = outcome.records, read_history(tiny_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["reward/mean"] for r in records] == [u["reward/mean"] for u in uninterrupted[:STEPS]]
    for r in records:
        assert r["rollout/staleness_max"] == 0 and r["rollout/adapter_version"] == r["step"]
        assert r["rollout/logprob_mismatch_max"] <= 1e-5  # every group was sampled by the adapter it claims


def test_a_rollout_replica_dying_while_groups_generate(deaths, tiny_run):
    assert deaths.crashed["generation"], "no Rollout replica reached group 5"
    assert_same_as_uninterrupted(deaths, tiny_run)


def test_a_reward_replica_killed(deaths, tiny_run):
    assert 2 in deaths.run.killed, f"no Reward replica was killed: {deaths.run.missed}"
    assert_same_as_uninterrupted(deaths, tiny_run)


def test_a_training_worker_killed_restarts_from_the_latest_checkpoint(deaths, tiny_run):
    assert 3 in deaths.run.killed, f"no training worker was killed: {deaths.run.missed}\n{deaths.run.output[-3000:]}"
    assert_same_as_uninterrupted(deaths, tiny_run)
    # the worker group started again from the latest checkpoint and ran the steps after it again
    assert "continuing from the checkpoint of step" in deaths.run.output, deaths.run.output[-4000:]
    assert len(deaths.lines) > STEPS


def test_a_rollout_replica_dying_while_the_adapter_is_published(deaths, tiny_run):
    assert deaths.crashed["publish"], "no Rollout replica reached the load of adapter version 5"
    assert_same_as_uninterrupted(deaths, tiny_run)
    # the publish of version 5 met a replica that died and went on with the live one; the replica Serve started
    # in its place loaded version 5 from the adapter store before it served (staleness 0 above)
    assert deaths.records[4]["rollout/publish_lost_replicas_max"] == 1


def test_a_stopped_run_resumed_from_its_folder_continues_as_the_uninterrupted_one(deaths, tiny_run, tmp_path,
                                                                                    job_cluster):
    run_dir = tmp_path / "resumed"
    shutil.copytree(deaths.run_dir, run_dir)  # a copy: the other tests read the original
    # a new driver on the job cluster, with the Serve application the fault run left (its replicas serve the last
    # adapter of that run until the loop resets them to the checkpoint's)
    # evaluation on from here, after every step: the run folder has no base images yet (made before the resumed
    # adapter is served again), and the evaluation of step 8 must equal the uninterrupted run's
    again = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS + 2}", "train.checkpoint_every=2",
                    "eval.every=1", "--resume", cluster=job_cluster)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "using the running rollout/reward application" in again.stdout
    assert f"continuing from the checkpoint of step {STEPS}" in again.stdout + again.stderr
    resumed, uninterrupted = read_history(run_dir), read_history(tiny_run)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 3))
    for r, u in zip(resumed[STEPS:], uninterrupted[STEPS:STEPS + 2], strict=True):
        assert r["reward/mean"] == u["reward/mean"]  # sampled by the restored adapter, prompts and seeds
        assert r["actor/grad_norm"] == pytest.approx(u["actor/grad_norm"], rel=1e-6)
        assert r["rollout/staleness_max"] == 0 and r["rollout/adapter_version"] == r["step"]
    evaluated, uninterrupted_eval = eval_lines(run_dir), eval_lines(tiny_run)
    assert sorted(evaluated) == [7, 8] and sorted(uninterrupted_eval) == [0, 8, 16, 24]
    assert comparable(evaluated[8]) == comparable(uninterrupted_eval[8])
    assert (run_dir / "eval" / "base_images.npz").is_file()

