"""A Serve application served to a team (docs/serving.md "Serving to a team"), on one app:
- API keys: every route but /v1/health needs `Authorization: Bearer <key>`; a missing or wrong key is a 401 in the
  OpenAI error shape (the official `openai` client raises its AuthenticationError), the right one is served, through
  the official client too;
- backpressure: one rollout replica taking one request at a time and a queue bound of 2: a flood of requests gets
  503s with Retry-After and a JSON body at once, no other 5xx, and the replica serves on after it;
- a client that gives up (its timeout) cancels its group in the replica, which serves the next request at once;
- a body over the limit is a 413 in the same shape;
- Serve's request id comes back in a header (the client's own when it sends one)."""

import base64
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

pytestmark = pytest.mark.slow  # a Ray cluster and Serve

APP, PREFIX = "flowgrpo_team", "/team"
KEY = "team-key-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUEUE = 2  # serve.max_queued_requests


@pytest.fixture(scope="module")
def served(serve_url, tiny_model_dir, tmp_path_factory):
    from ray import serve

    from deployments.builders import build_app

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# one a line\n{KEY}\n")
    args = {"model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "rollout": {"engine": "diffusers", "group_size": 1, "height": 64, "width": 64, "num_inference_steps": 2,
                        "num_replicas": 1, "replica_num_cpus": 0.25, "max_ongoing_requests": 1},
            "reward": {"weights": {"jpeg_compressibility": 1.0}, "replica_num_cpus": 0.1},
            "serve": {"api_num_cpus": 0.1, "api_key_file": str(keys), "api_key_env": "FLOWGRPO_TEST_NO_SUCH_VAR",
                      "max_queued_requests": QUEUE, "retry_after_s": 2.0, "max_n": 8, "max_steps": 64,
                      "max_body_bytes": 4096}}
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


def test_a_missing_or_wrong_key_is_a_401_and_health_stays_open(served):
    body = {"prompt": "a cat", "size": "64x64"}
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": KEY}):
        response = requests.post(f"{served}/v1/images/generations", json=body, headers=headers, timeout=60)
        assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and error["message"]
    assert requests.get(f"{served}/v1/lora", timeout=60).status_code == 401
    assert requests.get(f"{served}/v1/health", timeout=60).status_code == 200
    right = requests.get(f"{served}/v1/lora", headers=AUTH, timeout=60)
    assert right.status_code == 200 and right.json()["versions"] == [0]


def test_the_official_openai_client_works_with_api_key(served):
    import openai

    client = openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0)
    result = client.images.generate(prompt='a sign that says "OPEN"', n=1, size="64x64",
                                    response_format="b64_json")
    assert len(result.data) == 1 and base64.b64decode(result.data[0].b64_json)[:4] == b"\x89PNG"
    wrong = openai.OpenAI(base_url=f"{served}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="not valid"):
        wrong.images.generate(prompt="a cat", n=1, size="64x64", response_format="b64_json")


def test_a_flood_gets_503s_with_retry_after_and_service_after(served):
    heavy = {"prompt": 'a sign that says "BUSY"', "n": 8, "size": "128x128", "num_inference_steps": 16}

    def post(i):
        return requests.post(f"{served}/v1/images/generations", json={**heavy, "seed": i}, headers=AUTH, timeout=300)

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(post, range(12)))
    codes = sorted(r.status_code for r in answers)
    assert set(codes) <= {200, 503} and codes.count(200) >= 1, codes
    assert codes.count(503) >= 12 - (1 + QUEUE) - 2, codes  # one running, QUEUE waiting (and the timing's slack)
    busy = next(r for r in answers if r.status_code == 503)
    assert busy.headers["Retry-After"] == "2" and busy.json()["error"]["code"] == "overloaded"
    after = requests.post(f"{served}/v1/images/generations", json={"prompt": "a cat"}, headers=AUTH, timeout=120)
    assert after.status_code == 200


def test_the_request_id_comes_back(served):
    mine = requests.get(f"{served}/v1/lora", headers={**AUTH, "X-Request-Id": "team-request-1"}, timeout=60)
    assert mine.headers["x-request-id"] == "team-request-1"
    assert requests.get(f"{served}/v1/health", timeout=60).headers["x-request-id"]  # Serve's own otherwise


def test_a_client_that_gives_up_cancels_its_group(served):
    def cancelled() -> int:
        return requests.get(f"{served}/v1/health", timeout=60).json()["rollout"]["cancelled"]

    before = cancelled()
    heavy = {"prompt": 'a sign that says "LONG"', "n": 8, "size": "256x256", "num_inference_steps": 64, "seed": 1}
    with pytest.raises(requests.exceptions.ReadTimeout):  # the client gives up while the group denoises
        requests.post(f"{served}/v1/images/generations", json=heavy, headers=AUTH, timeout=(5, 0.3))
    asked = time.perf_counter()
    light = requests.post(f"{served}/v1/images/generations", json={"prompt": "a cat", "seed": 2}, headers=AUTH,
                          timeout=120)
    answered = time.perf_counter() - asked
    assert light.status_code == 200
    deadline = time.time() + 30
    while cancelled() == before and time.time() < deadline:
        time.sleep(0.1)
    assert cancelled() == before + 1  # Serve cancelled the replica's call; the engine stopped the group
    print(f"the next request answered {answered:.2f} s after it was sent, the first group cancelled")


def test_a_body_over_the_limit_is_a_413(served):
    response = requests.post(f"{served}/v1/images/generations", json={"prompt": "x" * 5000}, headers=AUTH, timeout=60)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "body_too_large" and "serve.max_body_bytes" in error["message"]


def test_the_serving_bench_measures_http_beside_the_handle_with_the_key(served):
    """jobs.bench_serving's measurement on this application: both paths at each level, every answer counted with
    its images, latency percentiles in order; a wrong key is counted as 401s, never as served images."""
    from ray import serve

    from app.config import RolloutConfig
    from jobs.bench_serving import bench, handle_sender, http_sender, measure, summary

    sampling = RolloutConfig(engine="diffusers", group_size=2, height=64, width=64, num_inference_steps=2)
    body = {"prompt": "a cat", "n": 2, "size": "64x64", "num_inference_steps": 2, "return_trajectory": True}
    senders = {"http": http_sender(f"{served}/v1/images/generations", body, KEY),
               "handle": handle_sender(serve.get_deployment_handle("Rollout", APP),
                                       lambda i: sampling.request("a cat", seed=i))}
    rows = bench(senders, [1, 2], requests_per_client=2, min_requests=3)
    assert [(r["path"], r["concurrency"], r["requests"]) for r in rows] == [
        ("http", 1, 3), ("handle", 1, 3), ("http", 2, 4), ("handle", 2, 4)]
    for row in rows:
        assert row["statuses"] == {"200": row["requests"]} and row["images"] == 2 * row["requests"], row
        assert 0 < row["latency_p50_s"] <= row["latency_p95_s"] <= row["latency_p99_s"] <= row["wall_s"], row
        assert row["bytes_per_answer"] > 0
    ratios = summary(rows)["http_over_handle_images_per_s"]
    assert set(ratios) == {"1", "2"} and all(r > 0 for r in ratios.values())

    refused = measure(http_sender(f"{served}/v1/images/generations", body, "not-the-key"), 2, 4)
    assert refused["statuses"] == {"401": 4} and refused["images"] == 0 and "latency_p50_s" not in refused
