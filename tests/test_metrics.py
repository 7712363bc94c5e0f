"""The trainer's Ray metrics reach the node's Prometheus endpoint, which the Ray dashboard's Metrics tab (and any
Prometheus scraping the cluster) reads."""

import re
import time
import urllib.request

import pytest


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def sample(text: str, name: str, run: str) -> float | None:
    """The value of metric `name` tagged with this run in Prometheus text format, or None while it is absent."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'run="{run}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


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
    ray.get(worker.record.remote(images=16, reward_mean=-2.5, adapter_version=1, step_seconds=3.0))
    ray.get(worker.record.remote(images=16, reward_mean=-2.25, adapter_version=2, step_seconds=4.0))

    port = ray.nodes()[0]["MetricsExportPort"]
    expected = {"ray_flowgrpo_images_generated_total": 32.0, "ray_flowgrpo_reward_mean": -2.25,
                "ray_flowgrpo_adapter_version": 2.0, "ray_flowgrpo_step_seconds_count": 2.0,
                "ray_flowgrpo_step_seconds_sum": 7.0}
    seen = {}
    deadline = time.monotonic() + 90  # the agent exports every few seconds: wait for the second report, not a timing
    while time.monotonic() < deadline:
        text = scrape(port)
        seen = {name: sample(text, name, "metrics-test") for name in expected}
        if seen == expected:
            break
        time.sleep(2)
    assert seen == pytest.approx(expected), [l for l in text.splitlines() if re.match(r"ray_flowgrpo_", l)]
    ray.kill(worker)
