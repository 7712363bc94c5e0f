"""SD3 served by Ray Serve: vllm-omni's SD3 pipeline (our FlowGRPO subclass) behind the load balancer. Generation
over HTTP with CFG returns the group and its trajectory (SD3's conditioning included) and reproduces it from the
seed; an edit is refused with what serves edits; a prompt over T5's limit is a 400 naming it."""

import base64
import io
import json

import numpy as np
import pytest
import requests
from PIL import Image
from served_api import generate

from app.models.sd3 import model as sd3

pytestmark = pytest.mark.slow  # a Ray cluster and Serve

APP, PREFIX = "flowgrpo_sd3", "/sd3"


@pytest.fixture(scope="module")
def served(serve_url, tiny_sd3_dir):
    from ray import serve

    from deployments.builders import build_app

    args = {"model": {"family": "sd3", "path": str(tiny_sd3_dir), "dtype": "float32"},
            "rollout": {"group_size": 2, "height": 64, "width": 64, "num_inference_steps": 3, "num_replicas": 1,
                        "replica_num_cpus": 0.25},
            "reward": {"weights": {"ocr": 1.0}, "replica_num_cpus": 0.25},
            "serve": {"max_n": 4, "max_side": 128, "max_steps": 4, "api_num_cpus": 0.1}}
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


def test_generation_with_cfg_returns_the_group_and_its_trajectory(served):
    from safetensors.torch import load

    response = generate(served, n=2, seed=5, guidance=4.5, negative_prompt="", return_trajectory=True)
    assert response.status_code == 200, response.text
    body = response.json()
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in body["data"]]
    assert [im.shape for im in images] == [(64, 64, 3)] * 2 and not np.array_equal(images[0], images[1])
    raw = base64.b64decode(body["trajectory"]["b64"])
    tensors = load(raw)
    text = 77 + sd3.T5_MAX_LENGTH
    assert tensors["latents"].shape == (2, 4, 16, 8, 8) and tensors["log_probs"].shape == (2, 3)
    assert tensors["prompt_embeds"].shape == tensors["negative_prompt_embeds"].shape == (text, 32)
    assert tensors[f"conditioning.{sd3.POOLED}"].shape == tensors[f"conditioning.{sd3.NEGATIVE_POOLED}"].shape == (32,)
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])  # safetensors: length, then JSON
    assert header["__metadata__"]["family"] == "sd3"
    again = generate(served, n=2, seed=5, guidance=4.5, negative_prompt="").json()
    assert [d["b64_json"] for d in again["data"]] == [d["b64_json"] for d in body["data"]]


def test_an_edit_is_refused_with_what_serves_edits(served):
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)).save(buffer, format="PNG")
    response = requests.post(f"{served}/v1/images/edits", data={"prompt": "make it blue"},
                             files={"image": ("a.png", buffer.getvalue(), "image/png")}, timeout=60)
    assert response.status_code == 400 and "model.family=bagel" in response.json()["error"]["message"]


def test_a_prompt_over_t5_s_limit_is_a_400_naming_it(served):
    response = generate(served, prompt="a sign that says OPEN " * 60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and f"the limit is {sd3.T5_MAX_LENGTH}" in error["message"], error
    assert generate(served).status_code == 200  # the replica goes on serving
