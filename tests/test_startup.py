"""The start-up breakdown (app/startup.py): spans between the marks of the driver, the replicas and the first worker,
and the summary's line; hand-worked marks."""

import pytest

from app.startup import startup_line, startup_metrics

DRIVER = {"launched": 100.0, "ray_ready": 104.0, "serve_registered": 105.5, "fit_called": 105.6}
WORKER = {"entered": 112.0, "policy_built": 115.0, "setup_done": 121.0, "first_step_began": 121.0,
          "first_step_done": 129.5}
REPLICAS = [(106.0, 118.0), (106.5, 122.5)]  # constructed, serving


def test_each_phase_is_the_span_between_its_marks():
    m = startup_metrics(DRIVER, WORKER, REPLICAS)
    assert m == pytest.approx({
        "timing/startup_ray_s": 4.0, "timing/startup_serve_s": 1.5, "timing/startup_workers_s": 6.4,
        "timing/startup_policy_s": 3.0, "timing/startup_setup_s": 6.0, "timing/startup_first_step_s": 8.5,
        "timing/startup_total_s": 29.5,
        "timing/startup_replica_s": 16.0,  # the slower replica: 106.5 -> 122.5
        "timing/startup_replicas_ready_s": 22.5})  # the last one serving, from the launch


def test_missing_marks_leave_out_what_needs_them():
    m = startup_metrics({}, WORKER, [])  # a driver other than jobs.train, no replica marks
    assert set(m) == {"timing/startup_policy_s", "timing/startup_setup_s", "timing/startup_first_step_s"}
    assert startup_line(m) is None  # no total: no line


def test_the_line_gives_the_total_then_every_phase_measured():
    line = startup_line(startup_metrics(DRIVER, WORKER, REPLICAS))
    assert line.startswith("start-up:      29.5 s from launch to the first step's end (Ray 4.0 s, ")
    assert "replicas ready at 22.5 s" in line and "first step 8.5 s" in line and line.endswith(")")
    assert "total" not in line
