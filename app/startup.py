"""Where a job's start goes: wall-clock marks (`time.time()`) from the launch of `jobs.train` to the end of its first
step, turned into `timing/startup_*` metrics (logged with the first step) and the summary's "start-up" line.

The marks come from three kinds of process: the driver (launched: the process's creation; Ray ready; the Serve
application registered; the trainer's `fit` called), the rollout replicas (each one's construction began and its
engine served, recorded in every trajectory's `producer`), and the first training worker (entered its loop; policy
built; set up, with the evaluation before training; first step begun and done). On one machine the clocks are one;
across nodes they differ by the clock skew (NTP: milliseconds).

The phases overlap on purpose: the replicas start while the workers do, so the parts do not add up to the total.
"""

from __future__ import annotations

# metric name (under timing/) -> (what it measures, for the summary line)
PHASES = {
    "startup_ray_s": "Ray",  # launch -> ray.init returned (the interpreter's imports included)
    "startup_serve_s": "Serve app registered",  # -> serve.run_many returned (its replicas still starting)
    "startup_replica_s": "slowest replica's start",  # one replica: constructed -> engine serving
    "startup_replicas_ready_s": "replicas ready at",  # launch -> the last replica of the first step serving
    "startup_workers_s": "worker group",  # fit called -> the first worker in its loop
    "startup_policy_s": "policy",  # -> the policy built (model, LoRA, FSDP2, optimizer)
    "startup_setup_s": "base model published + first eval",  # -> the worker set up (eval.before_train included)
    "startup_first_step_s": "first step",  # the first step itself
    "startup_total_s": "total",  # launch -> the first step done
}


def startup_metrics(driver: dict[str, float], worker: dict[str, float],
                    replicas: list[tuple[float, float]]) -> dict[str, float]:
    """`timing/startup_*` seconds from the marks. driver: launched, ray_ready, serve_registered, fit_called;
    worker: entered, policy_built, setup_done, first_step_began, first_step_done; replicas: (constructed, serving)
    of each replica that served the first step (none: their two metrics are left out). A missing mark leaves out
    the metrics that need it (a driver that is not `jobs.train`)."""
    marks = {**driver, **worker}
    spans = {"startup_ray_s": ("launched", "ray_ready"), "startup_serve_s": ("ray_ready", "serve_registered"),
             "startup_workers_s": ("fit_called", "entered"), "startup_policy_s": ("entered", "policy_built"),
             "startup_setup_s": ("policy_built", "setup_done"),
             "startup_first_step_s": ("first_step_began", "first_step_done"),
             "startup_total_s": ("launched", "first_step_done")}
    out = {f"timing/{name}": marks[end] - marks[begin] for name, (begin, end) in spans.items()
           if begin in marks and end in marks}
    if replicas:
        out["timing/startup_replica_s"] = max(ready - made for made, ready in replicas)
        if "launched" in marks:
            out["timing/startup_replicas_ready_s"] = max(ready for _, ready in replicas) - marks["launched"]
    return out


def startup_line(metrics: dict[str, float]) -> str | None:
    """The summary's line: the total, then each phase measured (None without a total)."""
    total = metrics.get("timing/startup_total_s")
    if total is None:
        return None
    parts = [f"{label} {metrics[f'timing/{name}']:.1f} s" for name, label in PHASES.items()
             if name != "startup_total_s" and f"timing/{name}" in metrics]
    return f"start-up:      {total:.1f} s from launch to the first step's end ({', '.join(parts)})"
