"""Crash injection for the fault-tolerance tests: a process that reaches a named point dies on the spot, as a
killed or preempted one would (`os._exit`: no exception, no cleanup, Ray sees the actor die).

    RAY_FLOWGRPO_CRASH="rollout.load_lora=3@/tmp/run/crash-1,rollout.generate=5@/tmp/run/crash-2"

makes the first process that loads adapter version 3 die, and the first that starts generating group 5. A
marker file is created atomically by the process that crashes, so exactly one process crashes once per marker,
whichever replica gets there first. Points that exist: `rollout.load_lora` (key: the adapter version being
loaded), `rollout.generate` (key: the group's `group_id`) and `rollout.seed` (key: the request's seed; evaluation
requests belong to no group). The tests kill from outside too (SIGKILL of a replica or worker when a step's line
prints); these points are for moments too short or too uncertain to hit from outside: the LoRA publish takes tens
of milliseconds, and a replica must have groups in flight when it dies. Unset (always, outside tests): nothing
happens. A Serve application built while it is set passes it to its replicas (`deployments/builders.py`).
"""

from __future__ import annotations

import os

ENV = "RAY_FLOWGRPO_CRASH"


def crash_point(point: str, key: int | str) -> None:
    for spec in filter(None, os.environ.get(ENV, "").split(",")):
        target, _, marker = spec.partition("@")
        if target != f"{point}={key}" or not marker:
            continue
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another process crashed here already
            continue
        os._exit(1)
