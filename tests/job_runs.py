"""Running `python -m jobs.train` as a user does, from tests: fresh processes, each with its own local Ray cluster
(Serve on a free port: the test session's own cluster may hold 8000)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
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


def job_command(*args: str, config: str = "configs/tiny_cpu.yaml") -> list[str]:
    return [sys.executable, "-m", "jobs.train", "--config", config, f"cluster.serve_port={free_port()}", *args]


def run_job(*args: str, config: str = "configs/tiny_cpu.yaml", timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(job_command(*args, config=config), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def history(run_dir: Path) -> list[dict]:
    """Every metrics line, in the order written (a step re-run after a restart appears twice)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def processes_titled(title: str, root: int) -> list[psutil.Process]:
    """Live descendants of process `root` whose title (Ray sets `ray::<actor class>...`) starts with `title`."""
    found = []
    for proc in psutil.Process(root).children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith(title):
                found.append(proc)
        except psutil.Error:  # gone (or going) since it was listed
            pass
    return sorted(found, key=lambda p: p.pid)


def kill_first(title: str, root: int) -> str | None:
    """SIGKILL the first live descendant of `root` titled `title`; "pid title" of it, None if there was none."""
    for victim in processes_titled(title, root):
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
                 after: dict[int, Callable[[], bool]] | None = None, env: dict | None = None, patience: float = 60):
        self.kills, self.after, self.patience = dict(kills or {}), dict(after or {}), patience
        self.killed: dict[int, str] = {}  # step -> "pid title" of what was killed
        self.missed: dict[int, str] = {}  # step -> why nothing was killed
        self.lines: list[str] = []
        self.job = subprocess.Popen(job_command(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

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
                    victim = kill_first(title, self.job.pid)
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
