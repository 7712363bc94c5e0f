"""The HTTP path under load: N concurrent clients against the Serve application's rollout, over HTTP (the OpenAI
images API, as a user who brings their own trainer calls it) and through the Serve handle (as the training loop
calls it), at the same concurrency: images per second, latency p50/p95/p99, and what HTTP costs beside the handle.

    python -m jobs.bench_serving --config configs/z_image_turbo_ocr_2gpu.yaml [--concurrency 1 4 16 64]
        [--requests-per-client 2] [--no-trajectory] [--out FILE.jsonl] [key=value ...]

The application runs on a local Ray cluster as `serve run` would run it (the config's model, rollout, reward and serve
sections); each client sends one group request after the other (`rollout.group_size` images, seeds differ), and a
level ends when `max(--min-requests, concurrency x --requests-per-client)` answers came back. Over HTTP the answer
carries the images as PNGs and, unless `--no-trajectory`, the trajectory (`return_trajectory`). The queue bound is
lifted (`serve.max_queued_requests=-1`, unless an override sets it): a bound answers 503 past it, which this counts
but does not measure. Keys: FLOWGRPO_API_KEY (or `--api-key`) is sent as the bearer token. One JSON line per path and
level, then a summary line with HTTP's images/s over the handle's at each level.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from jobs.report import emit_json_line

PROMPTS = ['a sign that says "OPEN"', 'a poster that says "RAY"', 'text reading "HELLO"', 'a neon sign "GRPO"']
APP = "bench_serving"
WARMUP_SEED = 1_000_000  # the measured requests take seeds 0, 1, ...

# a sender sends request number i and returns (status, images, bytes received): HTTP's status code, or 200 / the
# exception's class name through the handle
Sender = Callable[[int], tuple[int | str, int, int]]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of values, linearly interpolated between closest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def measure(send: Sender, concurrency: int, requests: int) -> dict:
    """`concurrency` clients send `requests` requests in all, each waiting for its answer before its next."""
    numbers = itertools.count()
    lock = threading.Lock()
    latencies, statuses, images, received = [], Counter(), [0], [0]

    def client() -> None:
        while (i := next(numbers)) < requests:
            began = time.perf_counter()
            status, count, size = send(i)
            elapsed = time.perf_counter() - began
            with lock:
                statuses[status] += 1
                if status == 200:
                    latencies.append(elapsed)
                    images[0] += count
                    received[0] += size

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    wall = time.perf_counter() - began
    answered = len(latencies)
    row = {"concurrency": concurrency, "requests": requests, "statuses": {str(k): v for k, v in statuses.items()},
           "wall_s": round(wall, 3), "images": images[0], "images_per_s": round(images[0] / wall, 3),
           "requests_per_s": round(answered / wall, 3)}
    if answered:
        row.update({f"latency_{name}_s": round(percentile(latencies, q), 4)
                    for name, q in (("p50", 50), ("p95", 95), ("p99", 99))})
        row.update({"latency_mean_s": round(statistics.fmean(latencies), 4),
                    "bytes_per_answer": round(received[0] / answered)})
    return row


def http_sender(url: str, body: dict, api_key: str | None) -> Sender:
    """POSTs `body` (its seed set to the request's number) to `url`, one connection pool per client thread."""
    import requests

    local = threading.local()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def send(i: int) -> tuple[int, int, int]:
        session = getattr(local, "session", None)
        if session is None:
            session = local.session = requests.Session()
        response = session.post(url, json={**body, "seed": i}, headers=headers, timeout=3600)
        count = len(response.json().get("data", [])) if response.status_code == 200 else 0
        return response.status_code, count, len(response.content)

    return send


def handle_sender(handle, request_for: Callable[[int], object]) -> Sender:
    """Calls the rollout deployment's `generate` through its Serve handle, as the training loop does."""

    def send(i: int) -> tuple[int | str, int, int]:
        try:
            trajectory = handle.generate.remote(request_for(i)).result(timeout_s=3600)
        except Exception as error:  # a backpressure refusal, a replica's failure: counted by its class
            return type(error).__name__, 0, 0
        return 200, trajectory.group_size, trajectory.nbytes  # its tensors, through the object store

    return send


def bench(senders: dict[str, Sender], levels: list[int], requests_per_client: int, min_requests: int,
          progress: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Each path (`senders`: name → sender) warmed up once, then measured at each concurrency level, the paths
    alternating within a level (both see the replica in the same state)."""
    for send in senders.values():
        send(WARMUP_SEED)  # warm-up: the first request of a path pays for connections, compilation, caches
    rows = []
    for concurrency in levels:
        requests = max(min_requests, concurrency * requests_per_client)
        for path, send in senders.items():
            row = {"bench": "serving", "path": path, **measure(send, concurrency, requests)}
            progress(row)
            rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    """HTTP's images/s over the handle's, and the added p50 latency, at each concurrency."""
    by = {(r["path"], r["concurrency"]): r for r in rows}
    levels = sorted({r["concurrency"] for r in rows})
    ratio, added = {}, {}
    for c in levels:
        http, handle = by.get(("http", c)), by.get(("handle", c))
        if http and handle and handle["images_per_s"] and "latency_p50_s" in http and "latency_p50_s" in handle:
            ratio[str(c)] = round(http["images_per_s"] / handle["images_per_s"], 3)
            added[str(c)] = round(http["latency_p50_s"] - handle["latency_p50_s"], 4)
    return {"bench": "serving_summary", "http_over_handle_images_per_s": ratio, "http_added_p50_s": added}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--no-trajectory", action="store_true", help="HTTP answers carry the images only")
    parser.add_argument("--api-key", default=os.environ.get("FLOWGRPO_API_KEY"))
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    if any(c < 1 for c in args.concurrency) or args.requests_per_client < 1:
        parser.error("--concurrency and --requests-per-client take whole numbers of at least 1")

    import socket

    import ray
    from ray import serve

    from app.config import load
    from app.models.family import get_family
    from deployments.builders import build_app

    overrides = list(args.overrides)
    if not any(o.startswith("serve.max_queued_requests=") for o in overrides):
        overrides.insert(0, "serve.max_queued_requests=-1")
    config = load(args.config, overrides)
    ro = config.rollout
    video = get_family(config.model.family).video
    body = {"prompt": PROMPTS[0], "n": ro.group_size, "size": f"{ro.width}x{ro.height}",
            "num_inference_steps": ro.num_inference_steps, "return_trajectory": not args.no_trajectory,
            **({"num_frames": ro.num_frames} if video else {})}

    ray.init(address=config.cluster.address, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    print(f"[bench_serving] starting the application ({config.model.family}, {ro.num_replicas} rollout replicas, "
          f"{ro.engine} engine)...", file=sys.stderr, flush=True)
    serve.run(build_app(config.app()), name=APP, route_prefix=f"/{APP}")
    route = "videos" if video else "images"
    senders = {"http": http_sender(f"http://127.0.0.1:{port}/{APP}/v1/{route}/generations", body, args.api_key),
               "handle": handle_sender(serve.get_deployment_handle("Rollout", APP),
                                       lambda i: ro.request(PROMPTS[0], seed=i))}

    def progress(row: dict) -> None:
        emit_json_line(row)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    try:
        rows = bench(senders, args.concurrency, args.requests_per_client, args.min_requests, progress)
        progress(summary(rows))
    finally:
        serve.delete(APP)
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
