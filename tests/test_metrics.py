"""The trainer's Ray metrics reach the node's Prometheus endpoint, which the Ray dashboard's Metrics tab (and any
Prometheus scraping the cluster) reads."""

import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow  # a Ray cluster


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def sample(text: str, name: str, run: str) -> float | None:
    """The value of metric `name` tagged with this run in Prometheus text format, or None while it is absent."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'run="{run}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


EXPECTED = {"ray_flowgrpo_images_generated_total": 32.0, "ray_flowgrpo_reward_mean": -2.25,
            "ray_flowgrpo_adapter_version": 2.0, "ray_flowgrpo_step_seconds_count": 2.0,
            "ray_flowgrpo_step_seconds_sum": 7.0}


def exported(port: int) -> tuple[dict, str]:
    """This run's samples of the expected metrics, scraped until they match or 90 s pass (the agent exports every
    few seconds: this waits for the second report, it does not time anything)."""
    deadline = time.monotonic() + 90
    while True:
        text = scrape(port)
        seen = {name: sample(text, name, "metrics-test") for name in EXPECTED}
        if seen == EXPECTED or time.monotonic() > deadline:
            return seen, text
        time.sleep(2)


def test_step_metrics_are_exported_to_prometheus(ray_cluster):
    import ray

    from app.metrics import RayMetrics

    @ray.remote(num_cpus=0)
    class Rank0:  # where the trainer records them: a Ray Train worker process
        def __init__(self):
            self.metrics = RayMetrics("metrics-test")

        def record(self, **values):
            self.metrics.record(**values)

    worker = Rank0.remote()
    try:
        ray.get(worker.record.remote(images=16, reward_mean=-2.5, adapter_version=1, step_seconds=3.0))
        ray.get(worker.record.remote(images=16, reward_mean=-2.25, adapter_version=2, step_seconds=4.0))
        seen, text = exported(ray.nodes()[0]["MetricsExportPort"])
    finally:
        ray.kill(worker)  # the session's cluster outlives this test
    assert seen == pytest.approx(EXPECTED), [line for line in text.splitlines()
                                                 if line.startswith("ray_flowgrpo_")]

