"""`python -m jobs.train` on the tiny SD3 config end to end, in a fresh process as a user runs it: vllm-omni's SD3
pipeline (our FlowGRPO subclass) behind Serve, the OCR + JPEG reward, two FSDP2 workers training a LoRA of the
MMDiT. The trainer reproduces the rollout's log-probs (the trainer runs diffusers' transformer,
vllm-omni its own with fused q/k/v projections: equal within 1e-5 in fp32; the diffusers engine's are bit-equal,
tests/rollout/test_sd3_engines.py), evaluations run through the same Serve app, and the adapter is saved as diffusers
loads SD3 LoRAs.

The run is pipelined with an SDE window (`train.max_staleness=1`, noise on 2 of the first 4 steps), the schedule of
the fast recipes, as a user runs it: step 1 trains on the base model's groups with the rollout's log-probs
reproduced, every later step on groups sampled while the step before trained, exactly one adapter version old,
none regenerated. (One run instead of one more: each end-to-end run pays a Ray cluster, a Serve app and a Train
worker group before its first step.)

It is also the two-node run: the job cluster has two nodes (`job_runs.JobCluster`), and the run keeps its replica
on one (`rollout.replica_resources`) and its FSDP2 ranks on the other (`cluster.worker_resources`), so the adapter's
way to the replicas, the checkpoints, the run folder and the evaluations cross nodes as on a real cluster.

The Serve application the run leaves running (`--keep-serving`) then answers HTTP as under `serve run`: generation
with CFG returns the group and its trajectory (SD3's conditioning included) and reproduces it from the seed; an edit
is refused with what serves edits; a prompt over T5's limit is a 400 naming it."""

import base64
import io
import json
import math

import numpy as np
import pytest
import requests
from job_runs import TWO_NODES, eval_lines, history, run_job
from PIL import Image
from served_api import generate, trajectory_metadata

from app.models.sd3 import model as sd3

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
STEPS = 8  # two checkpoints (every 4 steps; the latest kept), evaluations before the first step and after the last


@pytest.fixture(scope="module")
def sd3_run(tmp_path_factory, job_cluster):
    run_dir = tmp_path_factory.mktemp("sd3") / "run"
    # one replica of each (the Qwen-Image jobs exercise two): half the start-up CPU on 2 cores
    done = run_job(f"logging.dir={run_dir}", f"train.num_steps={STEPS}", "rollout.num_replicas=1",
                   "reward.num_replicas=1", "train.max_staleness=1", "rollout.sde_window.size=2",
                   "rollout.sde_window.range=[0,3]", "train.checkpoints_to_keep=1", *TWO_NODES, "--keep-serving",
                   config="configs/tiny_sd3_cpu.yaml", cluster=job_cluster)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "training of sd3" in done.stdout
    assert f"cluster:     {job_cluster.address} (2 nodes)" in done.stdout
    assert "pipelined: the next 1 step(s) generate while one trains" in done.stdout
    assert "\x1b[" not in done.stdout + done.stderr  # a pipe gets the workers' lines without colour codes
    return run_dir


def test_tiny_sd3_pipelined_run_trains_on_groups_at_most_one_version_old(sd3_run):
    records = history(sd3_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["rollout/staleness_max"] for r in records] == [0] + [1] * (STEPS - 1)
    assert [r["rollout/staleness_mean"] for r in records] == [0] + [1] * (STEPS - 1)
    assert all(r["rollout/regenerated_groups"] == 0 and r["rollout/images"] == 16 for r in records)
    # the last step's adapter reached the replicas behind this step's generation (none before the first step)
    assert [r["timing/publication_s_max"] > 0 for r in records] == [False] + [True] * (STEPS - 1)
    first = records[0]  # the base model's groups: the trainer scores exactly what was sampled
    assert first["rollout/logprob_mismatch_max"] <= 1e-5 and first["actor/ratio_dev_first_pass_max"] <= 1e-5
    assert all(r["actor/ratio_dev_stale_max"] > 1e-6 for r in records[1:])  # scored by a policy one update on
    for step, r in enumerate(records, start=1):
        assert r["rollout/adapter_version"] == step and math.isfinite(r["actor/loss"]) and r["perf/useful_tflop"] > 0
        assert 0 <= r["perf/rollout_busy_share"] <= 1
    assert any(r["actor/grad_norm"] > 0 for r in records)
    # train.checkpoints_to_keep=1: step 4's checkpoint gave way to step 8's
    kept = sorted(p.name for p in (sd3_run / "checkpoints").glob("checkpoint_step_*"))
    assert kept == [f"checkpoint_step_{STEPS:06d}"]
    state = json.loads((sd3_run / "checkpoints" / f"checkpoint_step_{STEPS:06d}" / "trainer_state.json").read_text())
    assert state["adapter_version"] == STEPS


def test_tiny_sd3_run_saves_a_diffusers_lora_and_evaluates(sd3_run, tiny_sd3_dir):
    import torch
    from diffusers import StableDiffusion3Pipeline

    from app.config import load

    adapter = sd3_run / "checkpoints" / f"checkpoint_step_{STEPS:06d}" / "adapter"
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, dtype=torch.float32)
    before = pipe.transformer.proj_out.weight.clone()
    pipe.load_lora_weights(adapter)  # as a user loads it, into the base model's pipeline
    config = pipe.transformer.peft_config["default_0"]
    assert (config.r, sorted(config.target_modules)) == (load("configs/tiny_sd3_cpu.yaml").model.lora_rank,
                                                         ["proj_out"])
    pipe.fuse_lora()
    assert not torch.equal(pipe.transformer.proj_out.weight, before)  # a trained adapter, not zeros
    evaluations = eval_lines(sd3_run)
    assert sorted(evaluations) == [0, 8]
    assert evaluations[0]["sentinel/distance_to_base"] == 0.0 and evaluations[8]["sentinel/distance_to_base"] > 0
    assert all(e["eval/images"] == 8 and math.isfinite(e["eval/reward/mean"]) for e in evaluations.values())


def test_the_run_s_application_generates_with_cfg_over_http_with_the_trajectory(sd3_run, job_cluster):
    from safetensors.torch import load

    served = job_cluster.served_url()  # the run's replica, serving its last adapter
    response = generate(served, n=2, seed=5, num_inference_steps=3, guidance=4.5, negative_prompt="",
                        return_trajectory=True)
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
    assert trajectory_metadata(raw)["family"] == "sd3"
    again = generate(served, n=2, seed=5, num_inference_steps=3, guidance=4.5, negative_prompt="").json()
    assert [d["b64_json"] for d in again["data"]] == [d["b64_json"] for d in body["data"]]


def test_the_run_s_application_refuses_an_edit_and_a_prompt_over_t5_s_limit(sd3_run, job_cluster):
    served = job_cluster.served_url()
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)).save(buffer, format="PNG")
    response = requests.post(f"{served}/v1/images/edits", data={"prompt": "make it blue"},
                             files={"image": ("a.png", buffer.getvalue(), "image/png")}, timeout=60)
    assert response.status_code == 400 and "model.family=bagel" in response.json()["error"]["message"]
    response = generate(served, prompt="a sign that says OPEN " * 60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and f"the limit is {sd3.T5_MAX_LENGTH}" in error["message"], error
    assert generate(served, n=2).status_code == 200  # the replica goes on serving
