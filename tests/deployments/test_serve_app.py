"""The Serve application on a local Ray cluster: two real vllm-omni rollout replicas, the OCR reward, the HTTP API,
load balancing, LoRA publication by broadcast, bad requests, and a bounded schemathesis run."""

import asyncio
import base64
import io
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from PIL import Image, ImageDraw, ImageFont

from app.config import RolloutConfig

# the served app's rollout section (what a request that leaves a setting out gets), and requests sampled as it says
SAMPLING = {"group_size": 2, "height": 64, "width": 64, "num_inference_steps": 2}
TINY = RolloutConfig(**SAMPLING)

pytestmark = pytest.mark.slow  # a Ray cluster and Serve

APP = "flowgrpo"
SCHEMATHESIS = str(Path(sys.executable).with_name("schemathesis"))


@pytest.fixture(scope="module")
def served(serve_url, tiny_model_dir, tiny_clip_dir, tiny_judge_dir):
    from ray import serve

    from deployments.builders import build_app
    from deployments.client import handles

    # serve_config.yaml's `args:` form: a run config's sections plus `serve`
    args = {"model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "rollout": {**SAMPLING, "num_replicas": 2, "replica_num_cpus": 0.5, "max_ongoing_requests": 4},
            # OCR, PickScore from the tiny CLIP (a model-based term in the same replica) and the tiny VLM judge
            # (its own deployment, which the reward replica asks)
            "reward": {"weights": {"ocr": 1.0, "pickscore": 0.5, "vlm_judge": 0.25},
                       "pickscore": {"path": str(tiny_clip_dir)}, "replica_num_cpus": 0.5,
                       "vlm_judge": {"path": str(tiny_judge_dir), "mode": "yesno", "replica_num_cpus": 0.25}},
            "serve": {"max_n": 4, "max_side": 128, "max_steps": 4, "max_reward_images": 4, "api_num_cpus": 0.25}}
    serve.run(build_app(args), name=APP, route_prefix="/")
    rollout, reward, adapters = handles(APP)
    yield {"url": serve_url, "rollout": rollout, "reward": reward, "adapters": adapters, "clip": tiny_clip_dir,
           "judge": tiny_judge_dir}
    serve.delete(APP)


@pytest.fixture
def base_model(served):
    """Every replica serves the base model when the test starts, and again when it ends (tests that publish must
    not leave a version behind for the next one, whatever the order)."""
    from app.rollout.client import publish_lora

    asyncio.run(publish_lora(served["rollout"], served["adapters"], None))
    yield
    asyncio.run(publish_lora(served["rollout"], served["adapters"], None))


def png_b64(image: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def rendered(text: str) -> np.ndarray:
    image = Image.new("RGB", (256, 96), "white")
    ImageDraw.Draw(image).text((10, 20), text, fill="black", font=ImageFont.load_default(size=40))
    return np.asarray(image)


def test_http_generation_returns_decodable_images_and_trajectory(served, base_model):
    from safetensors.torch import load

    body = {"prompt": 'a sign that says "OPEN"', "n": 2, "seed": 3, "return_trajectory": True}
    response = requests.post(f"{served['url']}/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in data["data"]]
    assert [im.size for im in images] == [(64, 64), (64, 64)]
    tensors = load(base64.b64decode(data["trajectory"]["b64"]))
    assert tensors["latents"].shape == (2, 3, 16, 64) and tensors["log_probs"].shape == (2, 2)
    assert data["seed"] == 3 and data["lora_version"] == 0 and data["replica"]


def test_http_reward_scores_rendered_text(served):
    body = {"images": [png_b64(rendered("OPEN 24H")), png_b64(rendered("CLOSED"))],
            "prompts": ['a sign "OPEN 24H"'] * 2}
    response = requests.post(f"{served['url']}/v1/rewards", json=body, timeout=120)
    assert response.status_code == 200, response.text
    ocr, pickscore, judge = (response.json()["components"][name] for name in ("ocr", "pickscore", "vlm_judge"))
    assert ocr[0] >= 0.9 and ocr[1] < ocr[0]
    # the tiny PickScore: as the same term scores the same images in this process, weighted into the total
    from app.rewards.clip import ClipReward

    images = np.stack([rendered("OPEN 24H"), rendered("CLOSED")])
    np.testing.assert_allclose(pickscore, ClipReward("pickscore", str(served["clip"])).score(images, body["prompts"]),
                               rtol=1e-5, atol=1e-6)
    # the judge's deployment answers as the judge in this process does
    from app.rewards.judge import VlmJudgeReward

    np.testing.assert_allclose(judge, VlmJudgeReward(str(served["judge"]), mode="yesno").score(images, body["prompts"]),
                               rtol=0, atol=1e-5)
    np.testing.assert_allclose(response.json()["scores"],
                               np.add(ocr, np.add(np.multiply(0.5, pickscore), np.multiply(0.25, judge))), rtol=1e-6)


def test_groups_are_spread_over_both_replicas(served):
    rollout = served["rollout"]

    async def eight():
        requests_ = [TINY.request(f"prompt {i}", seed=i) for i in range(8)]
        return await asyncio.gather(*[rollout.generate.remote(r) for r in requests_])

    trajs = asyncio.run(eight())
    assert len({t.producer["replica"] for t in trajs}) == 2
    assert [t.seed for t in trajs] == list(range(8))


def test_publication_reaches_every_replica_and_changes_generations(served, tiny_model_dir, base_model):
    from diffusers import QwenImageTransformer2DModel

    from app.models.lora import random_lora
    from app.rollout.client import publish_lora

    rollout = served["rollout"]
    request = TINY.request("a red cube", n=2, seed=11)
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    adapter = random_lora(transformer, version=1, rank=4, target_modules=["to_q", "to_v", "to_out.0"], seed=1,
                          scale=0.5)

    async def from_both_replicas() -> list:
        # the router may send one round of requests to a single replica: ask again until both have answered
        answers = []
        for _ in range(5):
            answers += await asyncio.gather(*[rollout.generate.remote(request) for _ in range(4)])
            if len({t.producer["replica"] for t in answers}) == 2:
                break
        return answers

    async def run():
        before = await from_both_replicas()
        acks = await publish_lora(rollout, served["adapters"], adapter)
        after = await from_both_replicas()
        return before, acks, after

    before, acks, after = asyncio.run(run())
    assert (acks.version, acks.acknowledged, acks.lost) == (1, 2, 0)
    lora = requests.get(f"{served['url']}/v1/lora", timeout=30).json()
    assert lora["versions"] == [1] and len(lora["replicas"]) == 2 and lora["published"] == 1
    assert all(t.lora_version == 1 for t in after) and all(t.lora_version == 0 for t in before)
    assert len({t.producer["replica"] for t in after}) == 2  # both replicas, both changed
    for t in after:
        assert not torch.equal(t.latents, before[0].latents)
        assert torch.equal(t.latents, after[0].latents)  # every replica serves the same adapter


def test_pipelined_groups_more_than_k_versions_behind_are_regenerated_never_trained_on(served, tiny_model_dir,
                                                                                    base_model):
    """Pipelined training (`train.max_staleness: 1`) against the real replicas: groups requested with no version
    are sampled with the adapter the replicas have; two publications later the trainer (now at version 13) keeps
    the groups one version behind and generates those two behind again with its own adapter, by name."""
    from diffusers import QwenImageTransformer2DModel

    from app.models.lora import random_lora
    from app.rollout.client import BlockingRolloutClient, RolloutClient

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    adapters = {v: random_lora(transformer, version=v, rank=4, target_modules=["to_q", "to_v"], seed=v, scale=0.5)
                for v in (11, 12, 13)}
    unpinned = [TINY.request(f"a sign that says {i}", n=2, seed=20 + i, group_id=i) for i in range(4)]
    client = RolloutClient(served["rollout"], served["reward"], served["adapters"], retries=0)
    with BlockingRolloutClient(client) as blocking:
        blocking.publish(adapters[11])
        old = blocking.collect_ahead(unpinned[:2]).result()  # generated while the trainer's step 11 ran
        blocking.publish(adapters[12])
        recent = blocking.collect_ahead(unpinned[2:]).result()
        blocking.publish(adapters[13])
        groups, regenerated = blocking.refresh(old + recent, unpinned, adapters[13], max_staleness=1)
        fresh = blocking.collect_ahead([r.replace(lora_version=13) for r in unpinned[:2]]).result()
    assert [g.trajectory.lora_version for g in old + recent] == [11, 11, 12, 12]
    assert regenerated == 2 and [g.trajectory.lora_version for g in groups] == [13, 13, 12, 12]
    assert groups[2:] == recent  # one version behind: trained as sampled
    for kept, again, stale in zip(groups[:2], fresh, old, strict=True):
        assert torch.equal(kept.trajectory.latents, again.trajectory.latents)  # exactly version 13's group
        assert not torch.equal(kept.trajectory.latents, stale.trajectory.latents)


def test_groups_asked_for_before_their_adapter_is_stored_wait_for_it_and_are_sampled_with_it(served, tiny_model_dir,
                                                                                           base_model):
    """A pipelined rank asks for the next step's groups while rank 0 is still publishing the adapter they must use
    (`collect_ahead(after=v)`): nothing is generated before the adapter store holds version v, then every group is
    sampled with it, whether or not the broadcast had reached its replica; a version that never comes sends the
    requests unpinned after the timeout (the staleness check deals with what they bring)."""
    import time

    from diffusers import QwenImageTransformer2DModel

    from app.models.lora import random_lora
    from app.rollout.client import BlockingRolloutClient, RolloutClient

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    adapters = {v: random_lora(transformer, version=v, rank=4, target_modules=["to_q", "to_v"], seed=v, scale=0.5)
                for v in (31, 32)}
    unpinned = [TINY.request(f"a sign that says {i}", n=2, seed=40 + i, group_id=i) for i in range(4)]
    client = RolloutClient(served["rollout"], served["reward"], served["adapters"], retries=0)
    with BlockingRolloutClient(client) as blocking:
        blocking.publish(adapters[31])
        ahead = blocking.collect_ahead(unpinned, after=32)
        time.sleep(1.0)
        waited = not ahead.done()
        publication = blocking.publish_ahead(adapters[32])
        groups = ahead.result(timeout=120)
        assert publication.result(timeout=120).version == 32
        late = blocking.call(client.collect_after(33, unpinned[:1], timeout_s=0.5))
    assert waited  # version 31 was served all along, yet no group was sampled with it
    assert [g.trajectory.lora_version for g in groups] == [32] * 4
    assert late[0].trajectory.lora_version == 32


def test_a_request_for_a_version_nobody_has_is_refused_and_the_replica_keeps_serving(served):
    from deployments.rollout import AdapterUnavailable

    rollout = served["rollout"]
    published = served["adapters"].current.remote().result()[0]
    with pytest.raises(AdapterUnavailable, match=f"asks for adapter version 99.*serves {published}"):
        rollout.generate.remote(TINY.request("a", n=1, seed=1, lora_version=99)).result()
    ok = rollout.generate.remote(TINY.request("a", n=1, seed=1, lora_version=published)).result()
    assert ok.lora_version == published


def test_a_replica_serve_starts_in_place_of_a_dead_one_serves_the_published_adapter(served, tiny_model_dir, base_model):
    """Kill one Rollout replica for real (`ray.kill`); the replica Serve starts in its place loads the adapter
    store's adapter in its constructor: it reports the published version before it has served any request."""
    import time

    import ray
    from diffusers import QwenImageTransformer2DModel

    from app.models.lora import random_lora
    from app.rollout.client import publish_lora

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    adapter = random_lora(transformer, version=7, rank=4, target_modules=["to_q", "to_v"], seed=7, scale=0.5)
    assert asyncio.run(publish_lora(served["rollout"], served["adapters"], adapter)).acknowledged == 2

    def replicas() -> dict[str, int]:
        answers = requests.get(f"{served['url']}/v1/lora", timeout=60).json()["replicas"]
        return {a["replica"]: a["lora_version"] for a in answers}

    before = replicas()
    victim = sorted(before)[0]  # Serve names a replica's actor after its id (Ray 2.60)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#Rollout#{victim}", namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        now = replicas()
        if len(now) == 2 and set(now) != set(before):
            break
        time.sleep(2)
    else:
        pytest.fail(f"no replacement replica within 240 s: {replicas()}")
    assert list(now.values()) == [7, 7], now  # the new replica served version 7 before any request reached it


def test_a_reward_deployment_that_fails_is_retried_then_the_group_is_named(served):
    """A real Serve deployment standing in for a broken reward model: it raises for one prompt and returns one
    score for a group of two for another. Each is asked again, then fails naming the group: never a silent 0."""
    from ray import serve

    from app.rewards import RewardScores
    from app.rollout.client import GroupFailed, RolloutClient

    @serve.deployment(name="BrokenReward", ray_actor_options={"num_cpus": 0.1})
    class BrokenReward:
        def __init__(self):
            self.calls = 0

        async def score(self, images, prompts):
            self.calls += 1
            if "raises" in prompts[0]:
                raise RuntimeError("the OCR model crashed")
            return RewardScores(total=[0.5])

        async def count(self) -> int:
            return self.calls

    broken = serve.run(BrokenReward.bind(), name="broken_reward", route_prefix=None)
    try:
        client = RolloutClient(served["rollout"], broken, served["adapters"], retries=1, retry_delay_s=0)
        for prompt, why in [("reward raises", "RuntimeError.*the OCR model crashed"),
                            ("reward is short", r"\{'total': 1\} scores for 2 images")]:
            request = TINY.request(prompt, n=2, seed=5, group_id=5)
            with pytest.raises(GroupFailed, match=f"group 5 \\('{prompt}'\\): reward failed 2 times.*{why}"):
                asyncio.run(client.collect([request]))
        assert broken.count.remote().result() == 4
    finally:
        serve.delete("broken_reward")


BAD_GENERATIONS = [
    ("{not json", 422, "not valid JSON"),
    ({"prompt": 3}, 422, "prompt"),
    ({"prompt": "a", "n": 0}, 422, "n:"),
    ({"prompt": "a", "n": 100}, 400, "limit"),
    ({"prompt": "a", "size": "abc"}, 422, "size"),
    ({"prompt": "a", "size": "100x64"}, 400, "multiple of 16"),
    ({"prompt": "a", "size": "4096x4096"}, 400, "limit"),
    ({"n": 2}, 422, "prompt"),
    ({"prompt": "a", "sde_type": "ddim"}, 422, "sde_type"),
    ({"prompt": "a", "bogus": 1}, 422, "bogus"),
    ({"prompt": "a", "embedded_guidance": 3.5}, 400, "takes no guidance input"),  # Qwen-Image is not distilled
]


@pytest.mark.parametrize("body,status,fragment", BAD_GENERATIONS)
def test_bad_generation_requests_get_a_4xx_that_says_why(served, body, status, fragment):
    url = f"{served['url']}/v1/images/generations"
    response = (requests.post(url, data=body, headers={"content-type": "application/json"}, timeout=60)
                if isinstance(body, str) else requests.post(url, json=body, timeout=60))
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]


def test_bad_reward_requests_and_the_service_still_answers(served):
    url = f"{served['url']}/v1/rewards"
    cases = [({"images": ["!!"], "prompts": ["a"]}, 400, "base64"),
             ({"images": [base64.b64encode(b"not an image").decode()], "prompts": ["a"]}, 400, "PNG or JPEG"),
             ({"images": [png_b64(rendered("A"))], "prompts": ["a", "b"]}, 400, "one prompt per image"),
             ({"images": [], "prompts": []}, 422, "images")]
    for body, status, fragment in cases:
        response = requests.post(url, json=body, timeout=60)
        assert response.status_code == status and fragment in response.json()["error"]["message"], response.text
    with ThreadPoolExecutor(4) as pool:  # a burst of bad requests, then a good one
        list(pool.map(lambda _: requests.post(f"{served['url']}/v1/images/generations", json={"n": -1}), range(16)))
    health = requests.get(f"{served['url']}/v1/health", timeout=60).json()
    assert health["status"] == "ok"
    assert health["reward"]["devices"] == {"ocr": "cpu", "pickscore": "cpu"}  # no GPU share: the OCR on onnxruntime
    ok = requests.post(f"{served['url']}/v1/images/generations", json={"prompt": "still here"}, timeout=120)
    assert ok.status_code == 200


def test_schemathesis_finds_no_server_error(served):
    """A bounded property-based run against the served OpenAPI schema: no 5xx, responses match the schema."""
    done = subprocess.run(
        [SCHEMATHESIS, "run", f"{served['url']}/openapi.json", "--checks",
         "not_a_server_error", "--max-examples", "15", "--phases", "examples,coverage,fuzzing",
         "--request-timeout", "120", "--no-color"],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "passed" in done.stdout.lower()
    requests.get(f"{served['url']}/v1/health", timeout=60).raise_for_status()


def test_an_edit_request_to_a_text_only_model_says_what_serves_edits(served):
    response = requests.post(f"{served['url']}/v1/images/edits", data={"prompt": "make it blue"},
                             files={"image": ("a.png", base64.b64decode(png_b64(rendered("A"))), "image/png")},
                             timeout=60)
    assert response.status_code == 400 and "model.family=bagel" in response.json()["error"]["message"]


LONG = "the quick brown fox jumps over the lazy dog " * 228  # 10,032 characters: thousands of tokens


@pytest.mark.parametrize("body,field", [
    ({"prompt": LONG}, "prompt"),
    ({"prompt": "a sign", "guidance": 4.0, "negative_prompt": LONG}, "negative_prompt"),
], ids=["prompt", "negative-prompt"])
def test_a_prompt_over_the_family_s_text_limit_is_a_400_naming_it(served, body, field):
    """Qwen-Image reads at most 1,024 prompt tokens (vllm-omni itself raises on more): the replica refuses the
    request before any engine work, and the API answers in its JSON error format, never a plain-text 500."""
    response = requests.post(f"{served['url']}/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["param"] == field and "the limit is 1024" in error["message"], error
    ok = requests.post(f"{served['url']}/v1/images/generations", json={"prompt": "still here"}, timeout=120)
    assert ok.status_code == 200  # the replicas go on serving


def test_an_application_that_cannot_deploy_is_named_with_its_error_while_the_trainer_starts(ray_cluster):
    """`jobs.train` starts its training workers while the replicas load; should the replicas never start (a
    broken checkpoint, every retry), the job's `ServingWatch` says which deployment failed and why, once, and
    stops."""
    from ray import serve

    from deployments.client import ServingWatch

    @serve.deployment(name="Rollout", max_constructor_retry_count=1, ray_actor_options={"num_cpus": 0.1})
    class NeverStarts:
        def __init__(self):
            raise OSError("Unable to load weights from checkpoint file 'transformer/model.safetensors'")

    failures = []
    serve.run_many([serve.RunTarget(NeverStarts.bind(), name="never_starts", route_prefix=None)],
                   wait_for_applications_running=False)
    watch = ServingWatch("never_starts", failures.append, poll_s=0.2).start()
    try:
        assert watch.wait(timeout=120) and not watch.running
        assert failures == [watch.failure]
        assert watch.failure.startswith("Rollout: OSError: Unable to load weights"), watch.failure
    finally:
        watch.stop()
        serve.delete("never_starts")
