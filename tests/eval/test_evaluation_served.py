"""Evaluations through a real Serve application (tiny Qwen-Image on the diffusers engine, 2 rollout replicas, the
OCR + JPEG reward): deterministic, pinned to the adapter evaluated, a replica dying mid-evaluation retried as a
training group is, and an evaluation that fails after its retries logged as failed while the run goes on."""

import asyncio
import json

import numpy as np
import pytest

from app.config import load
from app.eval.evaluate import evaluate, prompt_seed
from app.eval.report import sentinel_metrics
from app.faults import ENV as CRASH_ENV
from app.prompt_sets import eval_prompts
from app.rollout.client import BlockingRolloutClient, RolloutClient, publish_lora

pytestmark = pytest.mark.slow  # a Ray cluster and Serve

APP = "flowgrpo_eval_test"
FAILING_SEED = 7  # the eval seed whose first prompt crashes every replica that starts it, twice


@pytest.fixture(scope="module")
def served(serve_url, tiny_model_dir, tmp_path_factory):
    """The application, its replicas built with two crash points armed: prompt 1 of eval seed 0 (once) and prompt
    0 of eval seed FAILING_SEED (twice)."""
    import os

    from ray import serve

    from deployments.builders import build_app
    from deployments.client import handles

    markers = tmp_path_factory.mktemp("crashes")
    once = f"rollout.seed={prompt_seed(0, 1)}@{markers / 'once'}"
    twice = ",".join(f"rollout.seed={prompt_seed(FAILING_SEED, 0)}@{markers / f'twice-{k}'}" for k in range(2))
    config = load("configs/tiny_cpu.yaml", [
        f"model.path={tiny_model_dir}", "rollout.engine=diffusers", "rollout.num_replicas=2",
        "rollout.replica_num_cpus=0.3", "reward.num_replicas=1", "eval.prompts=ocr_eval_tiny",
        "eval.images_per_prompt=2", "eval.every=1"])
    os.environ[CRASH_ENV] = f"{once},{twice}"
    try:
        serve.run(build_app(config.app()), name=APP, route_prefix=f"/{APP}")
    finally:
        del os.environ[CRASH_ENV]
    yield config, handles(APP), markers
    serve.delete(APP)


def random_adapter(tiny_model_dir, version: int):
    from diffusers import QwenImageTransformer2DModel

    from app.models.lora import random_lora

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    return random_lora(transformer, version=version, rank=4, target_modules=["to_q", "to_v", "to_out.0"], seed=5,
                       scale=0.5)


def comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in ("eval/seconds", "eval/retries")}


def test_the_same_adapter_twice_is_identical_and_a_replica_death_changes_nothing(served, tiny_model_dir):
    config, handles, markers = served
    client = RolloutClient(*handles, retries=3, retry_delay_s=0.5)
    prompts = eval_prompts(config)
    adapter = random_adapter(tiny_model_dir, version=1)

    async def run():
        await publish_lora(handles[0], handles[2], adapter)
        first = await evaluate(client, config, prompts, 1)  # prompt 1's first replica dies: retried
        second = await evaluate(client, config, prompts, 1)
        await publish_lora(handles[0], handles[2], None)
        base = await evaluate(client, config, prompts, 0)
        return first, second, base

    first, second, base = asyncio.run(run())
    assert (markers / "once").exists() and first.retries >= 1 and second.retries == 0
    assert np.array_equal(first.images, second.images) and first.images.shape == (4, 2, 64, 64, 3)
    assert comparable(first.metrics()) == comparable(second.metrics())
    assert first.records() == second.records() and len(first.records()) == 8
    assert {"ocr_text", "exact_match", "target", "seed", "jpeg_compressibility"} <= set(first.records()[0])
    # every prompt has its own fixed seed, and its two images differ
    assert len(set(first.seeds)) == 4 and not np.array_equal(first.images[0, 0], first.images[0, 1])
    # pinned: the adapter's images are not the base model's
    assert not np.array_equal(first.images, base.images)
    metrics, _ = sentinel_metrics(first, base.images, config.eval.sentinel_bands)
    assert metrics["sentinel/distance_to_base"] > 0
    assert sentinel_metrics(base, base.images, config.eval.sentinel_bands)[0]["sentinel/distance_to_base"] == 0


def test_an_evaluation_failing_after_its_retries_is_logged_and_the_run_goes_on(served, tmp_path, capfd):
    from app.train.evaluation import RunEvaluator

    config, handles, markers = served
    config = load("configs/tiny_cpu.yaml", [f"model.path={config.model.path}", "rollout.engine=diffusers",
                                            "eval.prompts=ocr_eval_tiny", f"eval.seed={FAILING_SEED}",
                                            "eval.every=1", "eval.before_train=true"])
    with BlockingRolloutClient(RolloutClient(*handles, retries=1, retry_delay_s=0.5)) as rollout:
        rollout.publish(None)
        evaluator = RunEvaluator(config, tmp_path, rollout)
        evaluator.start(0)  # both attempts at prompt 0 die: the evaluation fails, nothing raises
        assert all((markers / f"twice-{k}").exists() for k in range(2))
        assert evaluator.base is None
        evaluator.after_step(1, 0)  # the next one (Serve restarted the replicas) goes through
    lines = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and lines[0]["eval/failed"] == 1.0 and "GroupFailed" in lines[0]["error"]
    assert lines[1]["step"] == 1 and "eval/reward/mean" in lines[1] and "eval/failed" not in lines[1]
    assert "the evaluation of the base model at step 0 failed; the run goes on" in capfd.readouterr().out
    assert (tmp_path / "eval" / "grid_step_000001.png").is_file() and (tmp_path / "eval_curve.png").is_file()
