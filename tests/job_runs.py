"""Running `python -m jobs.train` as a user does, from tests: fresh driver processes, each joining the session's
long-lived job cluster (`JobCluster`, as `ray job submit` joins one) or starting its own local cluster (Serve on a
free port: the test session's own cluster may hold 8000)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
PROGRESS = re.compile(r"\[flowgrpo\] step (\d+)/")  # rank 0's line at the end of each step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# in-process crash points (`app/faults.py`) of the job cluster's processes, by name; each fires once its marker is
# gone (`JobCluster.arm`)
CRASHES = {"generation": "rollout.generate=5", "publish": "rollout.load_lora=5"}


# the job cluster's two nodes, told apart by a custom resource: a run that asks for them
# (`rollout.replica_resources={rollout_node: 1} cluster.worker_resources={trainer_node: 1}`) generates on one
# node and trains on the other
ROLLOUT_NODE, TRAINER_NODE = "rollout_node", "trainer_node"
TWO_NODES = [f"rollout.replica_resources={{{ROLLOUT_NODE}: 1}}", f"cluster.worker_resources={{{TRAINER_NODE}: 1}}"]


class JobCluster:
    """A Ray cluster started as a user starts a long-lived one (`ray start --head --block`, then a second node
    joining it with `ray start --address`) for the job runs of a test session: a job given it (`run_job(...,
    cluster=...)`) joins it as under `ray job submit`, and a job run with `--keep-serving` leaves its Serve
    application to the next job of the same sections, which uses it instead of loading every model again. Its two
    nodes (one machine: the same files, other raylets, object stores and ports) carry the custom resources of
    `TWO_NODES`, so that a run can keep its replicas on one and its ranks on the other. Its processes carry the
    crash points of `CRASHES`, disarmed (their markers exist) until a test arms them."""

    def __init__(self, folder: Path, num_cpus: int = 4, trainer_cpus: int = 1):
        self.port, self.serve_port = free_port(), free_port()
        self.last_job: tuple[str, tuple[str, ...]] | None = None  # (config, args) of the last job run on it
        self.markers = {name: folder / f"crashed-{name}" for name in CRASHES}
        for marker in self.markers.values():
            marker.touch()
        crash = ",".join(f"{CRASHES[name]}@{self.markers[name]}" for name in CRASHES)
        # token authentication off, as for the in-process cluster: a cluster of one test session, on loopback
        env = {**os.environ, "RAY_FLOWGRPO_CRASH": crash, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
               "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}
        self.log = (folder / "ray_start.log").open("w")
        ray_cli = str(Path(sys.executable).with_name("ray"))
        # its own temp folder (short: Ray's socket paths have a length limit): `ray start` writes the cluster's
        # address there, where a `ray.init()` of no address would otherwise find it and join it (the in-process
        # tests' cluster, a job run that must start its own); the second node takes the head's
        self.temp_dir = tempfile.mkdtemp(prefix="rayjobs-", dir="/tmp")
        self.procs = [subprocess.Popen(
            [ray_cli, "start", "--head", "--block", f"--port={self.port}", f"--num-cpus={num_cpus}",
             f"--resources={json.dumps({ROLLOUT_NODE: 100})}", "--include-dashboard=false",
             "--node-ip-address=127.0.0.1", f"--temp-dir={self.temp_dir}"],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)]
        self._wait_for("Ray runtime started", folder / "ray_start.log")
        self.trainer_log = (folder / "ray_start_trainer_node.log").open("w")
        self.procs.append(subprocess.Popen(
            [ray_cli, "start", "--block", f"--address={self.address}", f"--num-cpus={trainer_cpus}",
             f"--resources={json.dumps({TRAINER_NODE: 100})}", "--object-store-memory=500000000",
             # one log monitor per host, as Ray asks: both nodes write to the head's session folder, which the
             # head's monitor reads whole (a second one read the same files again, 3.5 % of a core all along)
             "--include-log-monitor=False", "--node-ip-address=127.0.0.1"],
            cwd=REPO, env=env, stdout=self.trainer_log, stderr=subprocess.STDOUT))
        self._wait_for("Ray runtime started", folder / "ray_start_trainer_node.log")

    def _wait_for(self, text: str, log_path: Path) -> None:
        deadline = time.monotonic() + 120
        while text not in log_path.read_text():
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start failed:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pids(self) -> list[int]:
        """Both nodes' `ray start` processes: every process of the cluster descends from one of them."""
        return [p.pid for p in self.procs]

    def arm(self) -> None:
        """Every crash point fires once more (at the first process that reaches it)."""
        for marker in self.markers.values():
            marker.unlink(missing_ok=True)

    def stop(self) -> None:
        """SIGKILL to every process of the cluster, as `ray stop --force` does (`ray start` cleans up nothing on a
        signal, and a raylet given SIGTERM drains for up to 30 s: nothing here needs draining)."""
        procs = []
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(psutil.Error):
                    procs += [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(procs, timeout=10)
        for log in (self.log, getattr(self, "trainer_log", None)):
            if log is not None and not log.closed:
                log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def served_url(self) -> str:
        """The HTTP address of the Serve application the last job left running (`--keep-serving`): a test asks it
        what a user of `serve run` asks, without deploying the family's models a second time."""
        from deployments.builders import APP_NAME

        return f"http://127.0.0.1:{self.serve_port}/{APP_NAME}"


def job_command(*args: str, config: str = "configs/tiny_cpu.yaml", cluster: JobCluster | None = None) -> list[str]:
    where = ([f"cluster.address={cluster.address}", f"cluster.serve_port={cluster.serve_port}"] if cluster
             else [f"cluster.serve_port={free_port()}"])
    if cluster:
        cluster.last_job = (config, args)  # whose Serve application the cluster may be left with
    return [sys.executable, "-m", "jobs.train", "--config", config, *where, *args]


def run_job(*args: str, config: str = "configs/tiny_cpu.yaml", cluster: JobCluster | None = None,
            timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(job_command(*args, config=config, cluster=cluster), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def history(run_dir: Path) -> list[dict]:
    """Every metrics line, in the order written (a step re-run after a restart appears twice)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def processes_titled(title: str, roots: list[int]) -> list[psutil.Process]:
    """Live descendants of the processes `roots` whose title (Ray sets `ray::<actor class>...`) starts with
    `title`."""
    found = []
    for proc in [child for root in roots for child in psutil.Process(root).children(recursive=True)]:
        try:
            if " ".join(proc.cmdline()).startswith(title):
                found.append(proc)
        except psutil.Error:  # gone (or going) since it was listed
            pass
    return sorted(found, key=lambda p: p.pid)


def kill_first(title: str, roots: list[int]) -> str | None:
    """SIGKILL the first live descendant of `roots` titled `title`; "pid title" of it, None if there was none."""
    for victim in processes_titled(title, roots):
        try:
            described = f"{victim.pid} {' '.join(victim.cmdline())}"
            victim.send_signal(signal.SIGKILL)
            return described
        except psutil.Error:  # exited between listing and killing: the next one
            continue
    return None


class KilledRun:
    """The job in a subprocess; when rank 0 prints the progress line of step k, the first process titled
    `kills[k]` (a Serve replica, a Ray Train worker) is killed with SIGKILL: it vanishes as a crashed or preempted
    process does, with no chance to clean up. (Should none be alive then, at the next progress line; `missed`
    says why a kill waited or never happened.) `after[k]`, if given, must hold first: it is polled for up to
    `patience` seconds (e.g. until Ray Train has registered a checkpoint, which it does at its next poll of the
    workers, not when they report it)."""

    def __init__(self, *args: str, kills: dict[int, str] | None = None,
                 after: dict[int, Callable[[], bool]] | None = None, cluster: JobCluster | None = None,
                 patience: float = 60):
        self.kills, self.after, self.patience = dict(kills or {}), dict(after or {}), patience
        self.killed: dict[int, str] = {}  # step -> "pid title" of what was killed
        self.missed: dict[int, str] = {}  # step -> why nothing was killed
        self.lines: list[str] = []
        self.job = subprocess.Popen(job_command(*args, cluster=cluster), cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.roots = cluster.pids if cluster else [self.job.pid]  # the processes to kill descend from them

    def _watch(self) -> None:
        for line in self.job.stdout:
            self.lines.append(line)
            progress = PROGRESS.search(line)
            for step, title in self.kills.items():
                if step in self.killed or progress is None or int(progress.group(1)) < step:
                    continue
                if not self._holds(self.after.get(step)):
                    self.missed[step] = f"its precondition did not hold within {self.patience:.0f} s"
                    continue
                try:  # at step k's line, or a later one should no such process be alive then
                    victim = kill_first(title, self.roots)
                except Exception as err:  # reported through `missed`: the watcher never dies silently
                    victim, self.missed[step] = None, f"{type(err).__name__}: {err}"
                if victim is None:
                    self.missed.setdefault(step, f"no live process titled {title!r}")
                else:
                    self.killed[step] = victim

    def _holds(self, condition: Callable[[], bool] | None) -> bool:
        deadline = time.monotonic() + self.patience
        while condition is not None and not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def wait(self, timeout: float = 900) -> int:
        watcher = threading.Thread(target=self._watch, daemon=True)
        watcher.start()
        try:
            code = self.job.wait(timeout=timeout)
        finally:
            if self.job.poll() is None:
                self.job.kill()
        watcher.join(timeout=30)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def eval_lines(run_dir: Path) -> dict[int, dict]:
    """A run's evaluations by step (`<run>/eval/metrics.jsonl`)."""
    from app.eval.report import EvalLog

    return {e["step"]: e for e in EvalLog(run_dir / "eval").history()}


def comparable(line: dict) -> dict:
    """An evaluation's figures, without its wall time and retries."""
    return {k: v for k, v in line.items() if k.startswith(("eval/", "sentinel/"))
            and k not in ("eval/seconds", "eval/retries")}


def assert_a_trained_lora_loads(pipeline_class: str, checkpoint: Path, run_dir: Path, step: int, config: str) -> None:
    """The run's adapter of `step` loads into the family's diffusers pipeline as a user loads it, with the config's
    rank and targets, and changes the weights it is fused into (a trained adapter, not zeros)."""
    import diffusers
    import torch

    from app.config import load

    model = load(config).model
    adapter = run_dir / "checkpoints" / f"checkpoint_step_{step:06d}" / "adapter"
    pipe = getattr(diffusers, pipeline_class).from_pretrained(checkpoint, dtype=torch.float32)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(adapter)  # as a user loads it, into the base model's pipeline
    lora = pipe.transformer.peft_config["default_0"]
    assert (lora.r, sorted(lora.target_modules)) == (model.lora_rank, sorted(model.lora_targets))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    after = pipe.transformer.state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before)  # a trained adapter, not zeros


def assert_evaluated_before_and_after(run_dir: Path, steps: int) -> None:
    """Evaluations before the first step and after the last: the base's distance to itself 0, the adapter's not, 8
    images each with a finite reward."""
    import math

    evaluations = eval_lines(run_dir)
    assert sorted(evaluations) == [0, steps]
    assert evaluations[0]["sentinel/distance_to_base"] == 0.0 and evaluations[steps]["sentinel/distance_to_base"] > 0
    assert all(e["eval/images"] == 8 and math.isfinite(e["eval/reward/mean"]) for e in evaluations.values())
