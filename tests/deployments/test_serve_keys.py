"""A Serve application with API keys: every route but /v1/health needs `Authorization: Bearer <key>`; a missing or
wrong key is a 401 in the OpenAI error shape (the official `openai` client raises its AuthenticationError), the
right one is served, through the official client too."""

import base64

import pytest
import requests

pytestmark = pytest.mark.slow  # a Ray cluster and Serve

APP, PREFIX = "flowgrpo_keys", "/keyed"
KEY = "team-key-for-tests-0123456789"


@pytest.fixture(scope="module")
def served(serve_url, tiny_model_dir, tmp_path_factory):
    from ray import serve

    from deployments.builders import build_app

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# one a line\n{KEY}\n")
    args = {"model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "rollout": {"engine": "diffusers", "group_size": 1, "height": 64, "width": 64, "num_inference_steps": 2,
                        "num_replicas": 1, "replica_num_cpus": 0.25},
            "reward": {"weights": {"jpeg_compressibility": 1.0}, "replica_num_cpus": 0.1},
            "serve": {"api_num_cpus": 0.1, "api_key_file": str(keys), "api_key_env": "FLOWGRPO_TEST_NO_SUCH_VAR"}}
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
    right = requests.get(f"{served}/v1/lora", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
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
