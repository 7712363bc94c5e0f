"""Crash injection for the fault-tolerance tests: a process that reaches a named point dies on the spot, as a
killed or preempted one would (`os._exit`: no exception, no cleanup, Ray sees the actor die).

    RAY_FLOWGRPO_CRASH="rollout.load_lora=3@/tmp/run/crash-1,rollout.generate=5@/tmp/run/crash-2"

makes the first process that loads adapter version 3 die, and the first that starts generating group 5 (half a
second in: `crash_point_in_request`, so the caller, not Serve's router, sees the death). A
marker file is created atomically by the process that crashes, so exactly one process crashes once per marker,
whichever replica gets there first. Points that exist: `rollout.load_lora` (key: the adapter version being
loaded), `rollout.generate` (key: the group's `group_id`) and `rollout.seed` (key: the request's seed; evaluation
requests belong to no group). The tests kill from outside too (SIGKILL of a replica or worker when a step's line
prints); these points are for moments too short or too uncertain to hit from outside: the LoRA publish takes tens
of milliseconds, and a replica must have groups in flight when it dies. Unset (always, outside tests): nothing
happens. A Serve application built while it is set passes it to its replicas (`deployments/builders.py`).
"""

from __future__ import annotations

import asyncio
import os

ENV = "RAY_FLOWGRPO_CRASH"
# Serve's router sends a request elsewhere itself when its replica dies before acknowledging it (the strict
# max-ongoing-requests handshake), so the caller never sees that death; a replica dying this long after a request
# began has surely acknowledged it, as one dying mid-generation has
ACKNOWLEDGED_S = 0.5


def _markers(point: str, key: int | str) -> list[str]:
    """The marker files of the specs that name this point and key."""
    specs = (spec.partition("@") for spec in filter(None, os.environ.get(ENV, "").split(",")))
    return [marker for target, _, marker in specs if target == f"{point}={key}" and marker]


def _armed(point: str, key: int | str) -> bool:
    """Whether some spec names this point and key and its marker is not there yet."""
    return any(not os.path.exists(marker) for marker in _markers(point, key))


def crash_point(point: str, key: int | str) -> None:
    for marker in _markers(point, key):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another process crashed here already
            continue
        os._exit(1)


async def crash_point_in_request(point: str, key: int | str) -> None:
    """`crash_point` from a request handler, once the request is surely acknowledged (ACKNOWLEDGED_S): the caller
    sees the replica die and retries, as after a real death mid-generation. Not armed: returns at once."""
    if _armed(point, key):
        await asyncio.sleep(ACKNOWLEDGED_S)
        crash_point(point, key)
