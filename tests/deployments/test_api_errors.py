"""The HTTP API's errors: a `RequestError` from the rollout replica is a 400 naming its field, anything else a JSON
500. The fast tests call the real routes through FastAPI's TestClient, the ingress's handles being small stand-ins
that raise what Ray raises at the caller; the slow one goes through Serve and a real replica."""

import io
from types import SimpleNamespace

import pytest
import requests
import torch
from fastapi.testclient import TestClient
from PIL import Image
from ray import serve
from ray.exceptions import RayTaskError

from app.config import RolloutConfig
from app.types import RequestError, Trajectory
from deployments.api import ApiIngress, app

SAMPLING = RolloutConfig(group_size=2, height=64, width=64, num_inference_steps=2)
TOO_LONG = "is 412 text tokens; the model reads at most 300: shorten it"


def as_ray_raises(exc: Exception) -> Exception:
    """`exc` as awaiting a replica that raised it raises it: a RayTaskError that is also an instance of exc's
    class, its message the remote traceback."""
    return RayTaskError("Rollout.generate", f"Traceback (most recent call last):\n{type(exc).__name__}: {exc}",
                        exc).as_instanceof_cause()


class StandInRollout:
    """A rollout deployment's handle: `generate.remote(request)` raises `error`, or returns a group of 1 black
    image."""

    def __init__(self, error: Exception | None = None):
        self.error = error
        self.generate = SimpleNamespace(remote=self._generate)

    async def _generate(self, request):
        if self.error is not None:
            raise self.error
        steps, size = request.num_inference_steps, request.height
        return Trajectory.sampled(request, seed=7, lora_version=0, images=torch.zeros(1, size, size, 3,
                                                                                       dtype=torch.uint8),
                                  latents=torch.zeros(1, steps + 1, 4, 8), log_probs=torch.zeros(1, steps),
                                  timesteps=torch.zeros(steps), sigmas=torch.zeros(steps + 1),
                                  prompt_embeds=torch.zeros(3, 8), prompt_mask=torch.ones(3, dtype=torch.int64),
                                  producer={"replica": "stand-in"})


@pytest.fixture(scope="module")
def routes():
    """The routes as builders.py serves them: `serve.ingress` makes each method take its ingress from Serve's
    replica context."""
    serve.ingress(app)(ApiIngress)


@pytest.fixture
def client(routes, monkeypatch):
    """A TestClient on the API whose ingress has `rollout` as its rollout handle. TestClient raises what no
    handler answered: a test passes only if the API answered everything itself."""

    def with_rollout(rollout, family: str = "qwen_image") -> TestClient:
        ingress = ApiIngress(rollout, None, sampling=SAMPLING, family=family)
        monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=ingress))
        return TestClient(app)

    return with_rollout


@pytest.mark.parametrize("wrap", [as_ray_raises, lambda exc: exc], ids=["as-ray-raises", "raised-here"])
@pytest.mark.parametrize("field,value,param", [("prompt", "a sign " * 200, "prompt"), ("height", 64, "size")])
def test_a_request_error_from_the_rollout_replica_is_a_400_naming_its_field(client, wrap, field, value, param):
    refused = RequestError(field, value, TOO_LONG)
    response = client(StandInRollout(wrap(refused))).post("/v1/images/generations", json={"prompt": "a sign"})
    assert response.status_code == 400, response.text
    assert response.json() == {"error": {"message": str(refused), "type": "invalid_request_error", "param": param,
                                                "code": None}}


@pytest.mark.parametrize("wrap", [as_ray_raises, lambda exc: exc], ids=["as-ray-raises", "raised-here"])
def test_an_unexpected_error_is_a_json_500(client, wrap):
    response = client(StandInRollout(wrap(RuntimeError("the engine crashed")))).post(
        "/v1/images/generations", json={"prompt": "a sign"})
    assert response.status_code == 500 and response.headers["content-type"] == "application/json", response.text
    assert response.json() == {"error": {"message": "the server failed: RuntimeError: the engine crashed",
                                         "type": "server_error", "param": None, "code": None}}


def test_requests_refused_here_and_served_pass_the_error_handling_unchanged(client):
    api = client(StandInRollout())
    blank = api.post("/v1/images/generations", json={"prompt": "   "})  # GenerationRequest's rule, at the ingress
    assert blank.status_code == 400 and blank.json()["error"]["param"] == "prompt", blank.text
    assert blank.json()["error"]["message"].startswith("prompt='   ': must be a non-empty string")
    size = api.post("/v1/images/generations", json={"prompt": "a", "size": "100x64"})
    assert size.status_code == 400 and size.json()["error"]["param"] == "size", size.text
    ok = api.post("/v1/images/generations", json={"prompt": "a sign", "seed": 7})
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1 and ok.json()["replica"] == "stand-in", ok.text


def test_an_edit_upload_refused_by_the_replica_names_the_image(client):
    refused = RequestError("image", "tensor[64, 64, 3] uint8", "is smaller than the model's 128x128: upscale it")
    png = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(png, format="PNG")
    response = client(StandInRollout(as_ray_raises(refused)), family="bagel").post(
        "/v1/images/edits", data={"prompt": "make it blue"}, files={"image": ("a.png", png.getvalue(), "image/png")})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {"message": str(refused), "type": "invalid_request_error", "param": "image",
                                        "code": None}


@pytest.mark.slow
def test_through_serve_a_replica_s_request_error_is_a_400_and_its_crash_a_json_500(serve_url):
    """A real Serve application: the ingress and a rollout deployment that refuses long prompts and crashes on
    others. What Ray re-raises at the ingress is answered as above."""

    @serve.deployment(name="RefusingRollout", ray_actor_options={"num_cpus": 0.1})
    class RefusingRollout:
        async def generate(self, request):
            if "long" in request.prompt:
                raise RequestError("prompt", request.prompt, TOO_LONG)
            raise RuntimeError("the engine crashed")

    ingress = serve.deployment(serve.ingress(app)(ApiIngress), name="Api", ray_actor_options={"num_cpus": 0.1})
    serve.run(ingress.bind(RefusingRollout.bind(), None, sampling=SAMPLING), name="api_errors",
              route_prefix="/api_errors")
    try:
        url = f"{serve_url}/api_errors/v1/images/generations"
        refused = requests.post(url, json={"prompt": "a long prompt"}, timeout=60)
        assert refused.status_code == 400, refused.text
        assert refused.json() == {"error": {"message": str(RequestError("prompt", "a long prompt", TOO_LONG)),
                                            "type": "invalid_request_error", "param": "prompt", "code": None}}
        crashed = requests.post(url, json={"prompt": "a sign"}, timeout=60)
        assert crashed.status_code == 500 and crashed.headers["content-type"] == "application/json", crashed.text
        assert crashed.json()["error"] == {"message": "the server failed: RuntimeError: the engine crashed",
                                           "type": "server_error", "param": None, "code": None}
    finally:
        serve.delete("api_errors")
