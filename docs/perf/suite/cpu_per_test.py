"""Per-test CPU seconds of every process a pytest worker starts, Ray's included (a pytest plugin; Linux cgroup v1
`cpuacct`, as root): each xdist worker moves itself into a cgroup of its own, which its children inherit (the
in-process Ray clusters, the job cluster, subprocesses), so a test's CPU is its worker's cgroup's usage over the
test, whatever the other worker does beside it. JUnit's seconds are wall seconds, which on a saturated 2-core machine
say how a test was starved as much as what it costs.

    mkdir -p /sys/fs/cgroup/cpuacct/suite
    PYTHONPATH=docs/perf/suite PYTEST_ADDOPTS="-p cpu_per_test" CPU_PER_TEST=/tmp/cpu make test
    python docs/perf/suite/cpu_per_test.py /tmp/cpu/cpu_*.jsonl     # the files by CPU seconds
"""

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup/cpuacct/suite")
OUT = Path(os.environ.get("CPU_PER_TEST", "/tmp/cpu_per_test"))
GROUP = ROOT / os.environ.get("PYTEST_XDIST_WORKER", "main")
RECORDS = OUT / f"cpu_{GROUP.name}.jsonl"  # this worker's, a line as each test ends


def _usage() -> float:
    return int((GROUP / "cpuacct.usage").read_text()) / 1e9


def pytest_configure(config):
    GROUP.mkdir(parents=True, exist_ok=True)
    (GROUP / "cgroup.procs").write_text(str(os.getpid()))
    OUT.mkdir(parents=True, exist_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _usage(), time.time()
    yield
    record = {"id": item.nodeid, "cpu": round(_usage() - cpu, 2), "wall": round(time.time() - wall, 2)}
    with RECORDS.open("a") as f:
        f.write(json.dumps(record) + "\n")


def summary(paths: list[str]) -> None:
    rows = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines()]
    by = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        entry = by[r["id"].split("::")[0]]
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + r["cpu"], entry[2] + r["wall"]
    total, acc = sum(v[1] for v in by.values()), 0.0
    print(f"{len(rows)} tests, {total:.0f} CPU-s")
    print("| CPU-s | share so far | tests | wall s | file |\n| --- | --- | --- | --- | --- |")
    for name, (n, cpu, wall) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        acc += cpu
        print(f"| {cpu:.1f} | {acc / total:.2f} | {n} | {wall:.1f} | {name} |")


if __name__ == "__main__":
    summary(sys.argv[1:])
