"""FLUX.1 served by Ray Serve: vllm-omni's FLUX pipeline (our FlowGRPO subclass) behind the load balancer.
Generation over HTTP returns the group and its trajectory (FLUX's conditioning and guidance input included) and
reproduces it from the seed; the guidance input can be set per request (a deployment of a family without one
refuses it: tests/deployments/test_serve_app.py)."""

import base64

import pytest
from served_api import generate, trajectory_metadata

from app.models.flux import model as flux

pytestmark = pytest.mark.slow  # a Ray cluster and Serve

APP, PREFIX = "flowgrpo_flux", "/flux"


@pytest.fixture(scope="module")
def served(serve_url, tiny_flux_dir):
    from ray import serve

    from deployments.builders import build_app

    args = {"model": {"family": "flux", "path": str(tiny_flux_dir), "dtype": "float32"},
            "rollout": {"group_size": 2, "height": 64, "width": 64, "num_inference_steps": 3, "num_replicas": 1,
                        "replica_num_cpus": 0.25, "embedded_guidance_scale": 3.5},
            "reward": {"weights": {"ocr": 1.0}, "replica_num_cpus": 0.25},
            "serve": {"max_n": 4, "max_side": 128, "max_steps": 4, "api_num_cpus": 0.1}}
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


def test_generation_returns_the_group_its_trajectory_and_the_guidance_input(served):
    from safetensors.torch import load

    response = generate(served, n=2, seed=5, return_trajectory=True)
    assert response.status_code == 200, response.text
    body = response.json()
    raw = base64.b64decode(body["trajectory"]["b64"])
    tensors = load(raw)
    assert tensors["latents"].shape == (2, 4, flux.image_tokens(64, 64), 64) and tensors["log_probs"].shape == (2, 3)
    assert tensors["prompt_embeds"].shape == (flux.T5_MAX_LENGTH, 32) and "negative_prompt_embeds" not in tensors
    assert tensors[f"conditioning.{flux.POOLED}"].shape == (16,)
    meta = trajectory_metadata(raw)
    assert (meta["family"], meta["embedded_guidance_scale"], meta["guidance_scale"]) == ("flux", "3.5", "1.0")
    again = generate(served, n=2, seed=5).json()
    assert [d["b64_json"] for d in again["data"]] == [d["b64_json"] for d in body["data"]]
    other = generate(served, n=2, seed=5, embedded_guidance=1.0, return_trajectory=True).json()
    assert trajectory_metadata(base64.b64decode(other["trajectory"]["b64"]))["embedded_guidance_scale"] == "1.0"
    assert [d["b64_json"] for d in other["data"]] != [d["b64_json"] for d in body["data"]]
