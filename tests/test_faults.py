"""The crash points of the fault-tolerance tests (`app/faults.py`), each in a process of its own."""

import subprocess
import sys
from pathlib import Path

CALL = "import asyncio; from app.faults import crash_point_in_request as c; asyncio.run(c('rollout.seed', {key}))"


def run_point(key: int, spec: str) -> int:
    env = {"RAY_FLOWGRPO_CRASH": spec, "PATH": "/usr/bin:/bin"}
    root = Path(__file__).parents[1]
    return subprocess.run([sys.executable, "-c", CALL.format(key=key)], env=env, cwd=root).returncode


def test_a_request_crash_point_kills_once_per_marker_and_only_for_its_key(tmp_path):
    marker = tmp_path / "crashed"
    spec = f"rollout.seed=7@{marker},rollout.generate=3@{tmp_path / 'other'}"
    assert run_point(8, spec) == 0 and not marker.exists()  # another key: nothing happens
    assert run_point(7, spec) == 1 and marker.exists()  # the process dies, as os._exit(1)
    assert run_point(7, spec) == 0  # the marker is there: disarmed
    assert run_point(7, "") == 0 and not (tmp_path / "other").exists()
