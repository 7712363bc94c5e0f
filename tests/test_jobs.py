"""Entry-point jobs run end to end on the tiny config (in a fresh process, as a user would run them)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.jobs]

REPO = Path(__file__).resolve().parents[1]


def test_bench_rollout_prints_one_json_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "jobs.bench_rollout", "--config", "configs/tiny_cpu.yaml", "--groups", "2",
         "--repeats", "1", f"model.path={tmp_path / 'tiny'}"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["batched_images_per_s"] > 0 and result["per_sample_images_per_s"] > 0
    assert result["batched_over_per_sample"] > 0 and "trajectory_overhead_pct" in result
    # a group's seconds and the images per second are one timing: they agree to their rounding
    group_s = result["group_size"] / result["batched_images_per_s"]
    assert result["batched_s_per_group"] == pytest.approx(group_s, rel=1e-3, abs=1e-3)


def test_bench_train_step_shards_the_base_over_two_ranks_under_torchrun(tiny_model_dir):
    """`torchrun --nproc_per_node=2`: the base sharded over both ranks, each rank's own groups, one line from rank 0
    counting both ranks' images; FSDP2 keeps the gathered blocks for the backward when told."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
         "jobs.bench_train_step", "--config", "configs/tiny_cpu.yaml", "--groups", "1", "--repeats", "1",
         f"model.path={tiny_model_dir}", "train.reshard_after_forward=false"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["world_size"] == 2 and result["images"] == 2 * 4 and result["shard_frozen"] is True
    assert result["reshard_after_forward"] is False and result["pass_s"] > 0


def test_bench_rollout_serves_an_adapter_merged_times_its_swap_and_profiles_a_group(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "jobs.bench_rollout", "--config", "configs/tiny_cpu.yaml", "--groups", "2",
         "--repeats", "1", "--batched-only", "--adapter", "--profile", str(tmp_path / "profile.json"),
         f"model.path={tmp_path / 'tiny'}",
         "rollout.engine=diffusers", "rollout.merge_lora=true", "train.old_logprob=trainer"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert result["adapter"] is True and result["merge_lora"] == "device" and result["engine"] == "diffusers"
    assert result["adapter_swap_s"] > 0 and result["batched_images_per_s"] > 0
    assert set(result["batched_phase_share"]) == {"encode", "denoise", "decode"}
    assert 0.5 < sum(result["batched_phase_share"].values()) <= 1.0
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["group_s"] > 0 and profile["images"] == 4 and "top_kernels" in profile


@pytest.mark.parametrize("config,model", [("tiny_cpu", "tiny_model_dir"), ("tiny_sd3_cpu", "tiny_sd3_dir"),
                                          ("tiny_bagel_cpu", "tiny_bagel_dir")])
def test_bench_train_step_prints_one_json_line(tmp_path, config, model, request):
    """The trainer benchmark runs the real update (FSDP2 over a world of one, gloo on CPU) with gradient
    checkpointing, as the GPU configs do, and profiles one micro-step; for each family (its groups shaped by the
    family: BAGEL's text-to-image groups with a negative prompt's context under CFG). On the session's tiny
    checkpoints (built by the functions jobs.make_tiny_models calls), not built again in a process of their own."""
    done = subprocess.run(
        [sys.executable, "-m", "jobs.bench_train_step", "--config", f"configs/{config}.yaml", "--groups", "1",
         "--repeats", "1", "--profile", str(tmp_path / "profile.json"),
         f"model.path={request.getfixturevalue(model)}",
         "train.gradient_checkpointing=true", "rollout.guidance_scale=4.5", "rollout.negative_prompt=' '"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["gradient_checkpointing"] is True and result["cfg"] == 4.5
    assert result["pass_s"] > 0 and result["ms_per_image_step"] > 0
    assert result["images"] == 4 and result["trained_steps"] >= 1
    assert result["ratio_dev_first_pass_max"] == 0.0  # every pass's old log-probs are of the adapter it finds
    profile = json.loads((tmp_path / "profile.json").read_text())  # GPU kernels only: none on a CPU
    assert profile["micro_step_s"] > 0 and profile["images"] == 4 and profile["gpu_s_total"] == 0
    assert profile["gpu_busy"] is None  # no GPU to be busy


def test_bench_publish_swap_prints_one_json_line():
    """The replica-side swap benchmark on one block of the real width: the first adapter, peft's path and the
    fused copy the engines use, for the recipe's adapter (12 targets, A and B each: 24 tensors)."""
    done = subprocess.run([sys.executable, "-m", "jobs.bench_publish", "--swap", "--layers", "1", "--rank", "4",
                           "--repeats", "1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(line)
    assert result["tensors"] == 24 and result["layers"] == 1
    assert result["first_attach_s"] > 0 and result["peft_set_state_dict_s"] > 0 and result["fused_copy_s"] > 0


def test_bench_ocr_prints_one_json_line(capfd):
    """The reward replica's OCR throughput by CPUs, run in this process (no Ray, no engine): both thread counts
    read the same scores."""
    from jobs.bench_ocr import main

    assert main(["--threads", "1", "2", "--images", "3", "--size", "128", "--repeats", "1"]) == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1])
    assert result["same_scores"] is True and result["mean_score"] > 0.5
    assert set(result["images_per_s"]) == {"1", "2"} and result["speedup"]["1"] == 1.0


def test_bench_ode_steps_prints_one_json_line(capfd, tiny_model_dir):
    """Cheaper ODE steps against the full computation on the same groups, in this process: at a threshold every ODE
    step after a full one falls under, the cache is used; with FP8 the rewards move too; the window (first in every
    group here) keeps its log-probs bit for bit (each setting's figures on one line)."""
    from jobs.bench_ode_steps import main

    assert main(["--config", "configs/tiny_cpu.yaml", "--groups", "2", "--thresholds", "1e9", "--fp8", "--",
                 f"model.path={tiny_model_dir}", "model.build_tiny=false", "rollout.engine=diffusers",
                 "rollout.sde_window.size=1", "rollout.sde_window.placement=fixed"]) == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1])
    cached, fp8 = result["first_block_1000000000.0"], result["fp8"]
    assert result["images"] == 8 and result["full"]["images_per_s"] > 0 and cached["speedup"] > 0
    # the ODE steps 1-3: the first runs every block, the other two reuse its residual
    assert cached["window_first_groups"] == 2 and cached["window_first_logprobs_exact"] is True
    assert cached["ode_forwards_cached_share"] == 0.667 and "fp8_quantize_s" not in cached
    assert cached["reward_shift"] != 0.0 and cached["reward_seed_std"] == result["full"]["reward_std"]
    assert fp8["window_first_logprobs_exact"] is True and fp8["reward_shift"] != 0.0
    assert fp8["fp8_quantize_s"] > 0 and "ode_forwards_cached_share" not in fp8
    assert (fp8["fp8_scaling"], fp8["fp8_fast_accum"]) == ("rowwise", False)
    assert result["full"]["denoise_s_per_group"] > 0 and fp8["denoise_speedup"] > 0
    for row in (cached, fp8):  # the learning signal: advantages from either setting's rewards on the same images
        assert -1.0 <= row["advantage_corr"] <= 1.0 and 0.0 <= row["advantage_sign_agreement"] <= 1.0
    # every setting is credited with the full computation's FLOPs (a cheaper step does the work it replaces): its
    # effective TFLOP/s over its images/s is the same FLOPs per image; no GPU, no MFU
    per_image = result["rollout_gflops_per_image"] * 1e9
    assert per_image > 0
    for row in (result["full"], cached, fp8):
        assert row["effective_tflops"] * 1e12 / row["images_per_s"] == pytest.approx(per_image, rel=1e-3)
        assert row["effective_mfu"] is None


def test_bench_ode_steps_advantage_agreement_is_the_runs_advantages_compared():
    """The advantages come per group (the run's normalisation): a shift of one group's rewards changes nothing, a
    swap of two images within a group flips both signs."""
    from app.config import TrainConfig
    from jobs.bench_ode_steps import _advantages, _agreement

    train = TrainConfig()
    full = [1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0]
    shifted = [x + 5.0 for x in full[:4]] + full[4:]
    assert _agreement(_advantages(train, full, 4), _advantages(train, shifted, 4)) == {
        "advantage_corr": 1.0, "advantage_sign_agreement": 1.0}
    swapped = [4.0, 2.0, 3.0, 1.0] + full[4:]
    got = _agreement(_advantages(train, full, 4), _advantages(train, swapped, 4))
    assert got["advantage_sign_agreement"] == 0.75 and got["advantage_corr"] < 0.5


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], [0.1 * i * i for i in range(37)]])
def test_the_serving_bench_percentiles_are_numpys_linear_ones(values):
    import numpy as np

    from jobs.bench_serving import percentile

    for q in (0, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)
