"""`python -m jobs.train` on the tiny FLUX.1 config end to end, in a fresh process as a user runs it: vllm-omni's
FLUX pipeline (our FlowGRPO subclass) behind Serve, the guidance-distilled model's guidance input carried from the
config to every group, the OCR + JPEG reward, two FSDP2 workers training a LoRA of the transformer. The trainer
reproduces the rollout's log-probs (vllm-omni's transformer fuses q/k/v: equal within 1e-5 in fp32), evaluations
run through the same Serve app, and the adapter is saved as diffusers loads FLUX LoRAs. The Serve application the run
leaves running (`--keep-serving`) then answers HTTP as under `serve run`: the group, its trajectory (FLUX's
conditioning and guidance input included) reproduced from the seed, the guidance input set per request (a deployment
of a family without one refuses it: tests/deployments/test_serve_app.py)."""

import base64
import math

import pytest
from job_runs import assert_a_trained_lora_loads, assert_evaluated_before_and_after, history, run_job
from served_api import generate, trajectory_metadata

from app.models.flux import model as flux

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
STEPS = 4  # one checkpoint, evaluations before the first step and after the last


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory, job_cluster):
    run_dir = tmp_path_factory.mktemp("flux") / "run"
    # one replica of each (the Qwen-Image jobs exercise two): half the start-up CPU on 2 cores
    done = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "rollout.num_replicas=1",
                   "reward.num_replicas=1", f"eval.every={STEPS}", "--keep-serving",
                   config="configs/tiny_flux_cpu.yaml", cluster=job_cluster)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "training of flux" in done.stdout
    return run_dir


def test_tiny_flux_run_trains_on_policy_with_the_rollout_s_log_probs(flux_run):
    records = history(flux_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for step, r in enumerate(records, start=1):
        assert r["rollout/logprob_mismatch_max"] <= 1e-5 and r["actor/ratio_dev_first_pass_max"] <= 1e-5
        assert r["rollout/adapter_version"] == step and math.isfinite(r["actor/loss"]) and r["perf/useful_tflop"] > 0
        assert r["rollout/staleness_max"] == 0 and r["rollout/images"] == 16
    assert any(r["actor/grad_norm"] > 0 for r in records)


def test_tiny_flux_run_saves_a_diffusers_lora_and_evaluates(flux_run, tiny_flux_dir):
    assert_a_trained_lora_loads("FluxPipeline", tiny_flux_dir, flux_run, STEPS, "configs/tiny_flux_cpu.yaml")
    assert_evaluated_before_and_after(flux_run, STEPS)


def test_the_run_s_application_generates_over_http_with_the_trajectory_and_the_guidance_input(flux_run, job_cluster):
    from safetensors.torch import load

    served = job_cluster.served_url()  # the run's replica, serving its last adapter
    response = generate(served, n=2, seed=5, num_inference_steps=3, return_trajectory=True)
    assert response.status_code == 200, response.text
    body = response.json()
    raw = base64.b64decode(body["trajectory"]["b64"])
    tensors = load(raw)
    assert tensors["latents"].shape == (2, 4, flux.image_tokens(64, 64), 64) and tensors["log_probs"].shape == (2, 3)
    assert tensors["prompt_embeds"].shape == (flux.T5_MAX_LENGTH, 32) and "negative_prompt_embeds" not in tensors
    assert tensors[f"conditioning.{flux.POOLED}"].shape == (16,)
    meta = trajectory_metadata(raw)
    assert (meta["family"], meta["embedded_guidance_scale"], meta["guidance_scale"]) == ("flux", "3.5", "1.0")
    again = generate(served, n=2, seed=5, num_inference_steps=3).json()
    assert [d["b64_json"] for d in again["data"]] == [d["b64_json"] for d in body["data"]]
    other = generate(served, n=2, seed=5, num_inference_steps=3, embedded_guidance=1.0, return_trajectory=True).json()
    assert trajectory_metadata(base64.b64decode(other["trajectory"]["b64"]))["embedded_guidance_scale"] == "1.0"
    assert [d["b64_json"] for d in other["data"]] != [d["b64_json"] for d in body["data"]]
