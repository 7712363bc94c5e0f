"""`python -m jobs.train` on the tiny Z-Image config end to end, in a fresh process as a user runs it: vllm-omni's
Z-Image pipeline (our FlowGRPO subclass) behind Serve, the OCR + JPEG reward, two FSDP2 workers training a LoRA of
the transformer. The trainer's first pass reproduces its own old log-probs exactly and vllm-omni's within 1e-5
(its transformer fuses q/k/v and the MLP's w1/w3), evaluations run through the same Serve app, and the adapter is
saved as diffusers loads Z-Image LoRAs. The Serve application the run leaves running (`--keep-serving`) then answers
HTTP as under `serve run`: the group and its trajectory (the captions at their own lengths, fp32 latents) reproduced
from the seed, CFG at our scale, and a prompt over the text encoder's limit refused with a 400 naming it while the
deployment keeps serving."""

import base64
import math

import pytest
from job_runs import assert_a_trained_lora_loads, assert_evaluated_before_and_after, history, run_job
from served_api import generate, trajectory_metadata

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
STEPS = 4  # one checkpoint, evaluations before the first step and after the last


@pytest.fixture(scope="module")
def z_image_run(tmp_path_factory, job_cluster):
    run_dir = tmp_path_factory.mktemp("z_image") / "run"
    # one replica of each (the Qwen-Image jobs exercise two): half the start-up CPU on 2 cores
    done = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "rollout.num_replicas=1",
                   "reward.num_replicas=1", f"eval.every={STEPS}", "--keep-serving",
                   config="configs/tiny_z_image_cpu.yaml", cluster=job_cluster)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "training of z_image" in done.stdout
    return run_dir


def test_tiny_z_image_run_trains_on_policy(z_image_run):
    records = history(z_image_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for step, r in enumerate(records, start=1):
        assert r["actor/ratio_dev_first_pass_max"] == 0.0 and r["rollout/logprob_mismatch_max"] <= 1e-5
        assert r["rollout/adapter_version"] == step and math.isfinite(r["actor/loss"]) and r["perf/useful_tflop"] > 0
        assert r["rollout/staleness_max"] == 0 and r["rollout/images"] == 16
    assert any(r["actor/grad_norm"] > 0 for r in records)


def test_tiny_z_image_run_saves_a_diffusers_lora_and_evaluates(z_image_run, tiny_z_image_dir):
    assert_a_trained_lora_loads("ZImagePipeline", tiny_z_image_dir, z_image_run, STEPS, "configs/tiny_z_image_cpu.yaml")
    assert_evaluated_before_and_after(z_image_run, STEPS)


def test_the_run_s_application_generates_over_http_and_refuses_a_long_prompt(z_image_run, job_cluster):
    from safetensors.torch import load

    served = job_cluster.served_url()  # the run's replica, serving its last adapter
    response = generate(served, n=2, seed=5, num_inference_steps=3, return_trajectory=True, guidance=3.0,
                        negative_prompt=" ")
    assert response.status_code == 200, response.text
    body = response.json()
    raw = base64.b64decode(body["trajectory"]["b64"])
    tensors = load(raw)
    assert tensors["latents"].shape == (2, 4, 16, 8, 8) and tensors["log_probs"].shape == (2, 3)
    assert tensors["prompt_embeds"].shape[1] == 32 and tensors["negative_prompt_embeds"].shape[1] == 32
    assert tensors["prompt_mask"].sum() == tensors["prompt_embeds"].shape[0]  # its own tokens, no padding
    meta = trajectory_metadata(raw)
    assert (meta["family"], meta["guidance_scale"]) == ("z_image", "3.0")
    again = generate(served, n=2, seed=5, num_inference_steps=3, guidance=3.0, negative_prompt=" ").json()
    assert [d["b64_json"] for d in again["data"]] == [d["b64_json"] for d in body["data"]]
    too_long = generate(served, n=2, prompt="zebra " * 600)
    assert too_long.status_code == 400 and "prompt" in too_long.text and "512" in too_long.text
    assert generate(served, n=1, seed=6).status_code == 200  # the replica serves on
