"""BAGEL served by Ray Serve: our BAGEL engine behind the load balancer, text-to-image and OpenAI-style image edits
over HTTP (a multipart upload of the image to change), and bad edit requests refused with a reason."""

import base64
import io

import numpy as np
import pytest
import requests
from PIL import Image

from app.prompt_sets import rendered_sign

pytestmark = pytest.mark.slow  # a Ray cluster and Serve

APP, PREFIX = "flowgrpo_bagel", "/bagel"


@pytest.fixture(scope="module")
def served(serve_url, tiny_bagel_dir):
    from ray import serve

    from deployments.builders import build_app

    args = {"model": {"family": "bagel", "path": str(tiny_bagel_dir), "dtype": "float32"},
            "rollout": {"engine": "bagel", "group_size": 2, "height": 64, "width": 64, "num_inference_steps": 3,
                        "num_replicas": 1, "replica_num_cpus": 0.25},
            "reward": {"weights": {"ocr": 1.0}, "replica_num_cpus": 0.25},
            "serve": {"max_n": 4, "max_side": 128, "max_steps": 4, "api_num_cpus": 0.1}}
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


def png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def decoded(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def edit(url: str, image: bytes | None, **fields):
    files = {"image": ("sign.png", image, "image/png")} if image is not None else None
    form = {"prompt": 'Change the sign so that it says "OPEN"', "size": "64x64", **fields}
    return requests.post(f"{url}/v1/images/edits", data=form, files=files, timeout=120)


def test_an_edit_over_http_returns_the_group_and_its_trajectory(served):
    from safetensors.torch import load

    sign = png(rendered_sign("CLOSED", 96))
    fields = {"n": "2", "seed": "4", "guidance": "4", "negative_prompt": "", "image_guidance": "1.5",
              "return_trajectory": "true"}
    response = edit(served, sign, **fields)
    assert response.status_code == 200, response.text
    body = response.json()
    images = [decoded(item["b64_json"]) for item in body["data"]]
    assert len(images) == 2 and all(im.shape == (64, 64, 3) for im in images)
    raw = base64.b64decode(body["trajectory"]["b64"])
    tensors = load(raw)
    assert tensors["latents"].shape == (2, 4, 16, 64)
    assert tensors["conditioning.edit_latents"].shape == (64, 64)  # the 96 px sign, conditioned at 128 px
    again = edit(served, sign, **fields).json()
    assert [item["b64_json"] for item in again["data"]] == [item["b64_json"] for item in body["data"]]
    other = edit(served, png(rendered_sign("STOP", 96)), **fields).json()  # another input image: another group
    assert [item["b64_json"] for item in other["data"]] != [item["b64_json"] for item in body["data"]]
    text = requests.post(f"{served}/v1/images/generations", json={"prompt": 'a sign that says "OPEN"', "n": 2,
                                                                  "guidance": 4, "negative_prompt": ""}, timeout=120)
    assert text.status_code == 200 and len(text.json()["data"]) == 2


@pytest.mark.parametrize("image, fields, status, fragment", [
    (None, {}, 422, "image"),
    (b"not an image", {}, 400, "PNG or JPEG"),
    (png(np.zeros((8, 8, 3), dtype=np.uint8)), {}, 400, "at least 16x16"),
    (png(np.zeros((64, 64, 3), dtype=np.uint8)), {"image_guidance": "0.5"}, 422, "image_guidance"),
    (png(np.zeros((64, 64, 3), dtype=np.uint8)), {"bogus": "1"}, 422, "bogus"),
    (png(np.zeros((64, 64, 3), dtype=np.uint8)), {"size": "256x256"}, 400, "limit"),
], ids=["no-image", "not-an-image", "too-small", "bad-image-guidance", "unknown-field", "too-large"])
def test_bad_edit_requests_get_a_4xx_that_says_why(served, image, fields, status, fragment):
    response = edit(served, image, **fields)
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]
    assert requests.get(f"{served}/v1/health", timeout=60).json()["status"] == "ok"


def test_over_long_prompts_are_a_400_naming_the_prompt_at_every_endpoint(served):
    """BAGEL's prompt must fit its LLM's context (the tiny model's 2,048 positions, less the image blocks'): the
    text-to-image and the edit endpoint both refuse a longer one with a JSON 400 naming `prompt`."""
    long = "re-letter the sign to say OPEN " * 330  # 10,230 characters
    generated = requests.post(f"{served}/v1/images/generations", json={"prompt": long}, timeout=120)
    edited = edit(served, png(rendered_sign("OPEN", 64)), prompt=long)
    for response in (generated, edited):
        assert response.status_code == 400, response.text
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert error["param"] == "prompt" and "the limit is 2045" in error["message"], error


def test_an_edit_evaluation_through_the_served_app_is_deterministic_and_edits_its_signs(served, tiny_bagel_dir):
    """`ocr_edit_eval_tiny` through the application: each request carries its sign, the images are the edits'
    (not the text-to-image images of the same instructions), two evaluations agree, the OCR's reading is kept."""
    import asyncio

    from app.config import load
    from app.eval.evaluate import evaluate
    from app.eval.report import sentinel_metrics
    from app.prompt_sets import eval_prompts
    from app.rollout.client import RolloutClient
    from deployments.client import handles

    config = load("configs/tiny_bagel_cpu.yaml", [f"model.path={tiny_bagel_dir}", "rollout.num_inference_steps=3",
                                                  "eval.prompts=ocr_edit_eval_tiny", "eval.images_per_prompt=2"])
    edits = eval_prompts(config)
    as_text = [str(p) for p in edits]  # the same instructions without their images
    client = RolloutClient(*handles(APP), retries=1, retry_delay_s=0.5)

    async def run():
        return (await evaluate(client, config, edits, 0), await evaluate(client, config, edits, 0),
                await evaluate(client, config, as_text, 0))

    first, second, text_to_image = asyncio.run(run())
    assert first.images.shape == (2, 2, 64, 64, 3) and np.array_equal(first.images, second.images)
    assert first.records() == second.records()
    assert not np.array_equal(first.images, text_to_image.images)  # conditioned on the sign
    assert [r["target"] for r in first.records()] == ["RIVER", "RIVER", "WINTER", "WINTER"]
    assert all(isinstance(r["ocr_text"], str) for r in first.records())
    metrics, _ = sentinel_metrics(first, text_to_image.images, config.eval.sentinel_bands)
    assert metrics["sentinel/distance_to_base"] > 0
