"""Streamed rewards vs scoring after all rollouts, on the Serve application (local Ray cluster).

    python -m jobs.bench_reward_stream --config configs/tiny_cpu.yaml [--groups 8] [key=value ...]

Both modes request the same groups concurrently from the rollout replicas. "streamed" sends each group to the
reward deployment the moment it is generated (`RolloutClient.stream`), "after_all" waits for every rollout and
then scores. Prints one JSON line with the wall time to score all groups in each mode (median of --repeats).
"""

import argparse
import asyncio
import statistics
import sys
import time

from app.config import load
from jobs.report import emit_json_line

PROMPTS = ['a sign that says "OPEN"', 'a poster that says "RAY"', 'text reading "HELLO"', 'a neon sign "GRPO"']


async def _run(client, requests, streamed: bool) -> float:
    start = time.perf_counter()
    groups = await client.collect(requests, streamed=streamed)
    assert len(groups) == len(requests)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    config = load(args.config, args.overrides)

    import ray
    from ray import serve

    from app.rollout.client import RolloutClient
    from deployments.builders import APP_NAME, build_app
    from deployments.client import handles

    ray.init(address=config.cluster.address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    serve.run(build_app(config.app()), name=APP_NAME, route_prefix=None)
    client = RolloutClient(*handles(APP_NAME))
    ro = config.rollout
    requests = [ro.request(PROMPTS[i % len(PROMPTS)], seed=i) for i in range(args.groups)]

    async def bench() -> dict:
        await _run(client, requests, True)  # warm-up: every replica has served
        times = {"streamed": [], "after_all": []}
        for _ in range(args.repeats):
            for mode in times:
                times[mode].append(await _run(client, requests, mode == "streamed"))
        med = {k: statistics.median(v) for k, v in times.items()}
        return {"bench": "reward_stream", "groups": args.groups, "group_size": ro.group_size,
                "rollout_replicas": ro.num_replicas, "rewards": dict(config.reward.weights),
                "streamed_s": round(med["streamed"], 3), "after_all_s": round(med["after_all"], 3),
                "after_all_over_streamed": round(med["after_all"] / med["streamed"], 2)}

    result = asyncio.run(bench())
    serve.delete(APP_NAME)
    serve.shutdown()
    ray.shutdown()
    emit_json_line(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
