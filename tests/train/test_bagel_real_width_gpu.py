"""Our BAGEL engine and the trainer at BAGEL-7B-MoT's real layer width (hidden 3584, MLP 18944, 28 heads, 4 KV
heads; both experts; 4 of the 28 layers; SigLIP at so400m's width; the real FLUX autoencoder) in bf16 on one GPU,
from a checkpoint built by `jobs.make_tiny_models --preset bagel-real-width` and loaded as a real one would be.
Runs on the lent GPU machine; deselected elsewhere.

A text-to-image group and an edit group (512², 8 images, 10 steps, text CFG 4 against the empty context, image CFG
1.5 for the edit) are sampled by the engine, then the FSDP2 policy (LoRA r=64 on the generation expert) re-scores
every step: in micro-batches of the whole group (as the GPU configs train) the log-probs must be the rollout's within
1e-3; one sample at a time, the GPU's batch-dependent kernels make them differ more (bounded loosely, printed)."""

import time

import numpy as np
import pytest
import torch
from test_real_width_gpu import trainer_log_probs  # the Qwen-Image GPU test's micro-batched re-scoring

from app.config import RolloutConfig
from app.models.bagel import GENERATION_TARGETS
from app.models.bagel.real_width import build_real_width_bagel
from app.rollout.bagel_engine import BagelEngine
from app.train.policy import Policy

pytestmark = pytest.mark.gpu
TOLERANCE = 1e-3  # bf16 rollout vs bf16 trainer, mean log-density per latent element, scored at the group's size
CROSS_BATCH = 1e-2  # scored one sample at a time (another batch size than the rollout's)
EDIT_SIDE = 512


@pytest.fixture(scope="module")
def real_width_bagel(tmp_path_factory):
    started = time.perf_counter()
    path = build_real_width_bagel(tmp_path_factory.mktemp("bagel-real-width") / "model", seed=0, layers=4,
                                  device="cuda")
    print(f"\nbuilt {path.name} in {time.perf_counter() - started:.1f} s "
          f"({sum(f.stat().st_size for f in path.iterdir()) / 2**30:.2f} GiB)")
    return path


def requests(side: int, group: int, steps: int) -> dict:
    """A text-to-image and an edit group at the BAGEL GPU config's sampling settings (image CFG 1.5 for the edit)."""
    rollout = RolloutConfig(group_size=group, height=side, width=side, num_inference_steps=steps, guidance_scale=4.0,
                            negative_prompt="")
    image = torch.from_numpy((np.random.default_rng(0).random((side, side, 3)) * 255).astype(np.uint8))
    return {"t2i": rollout.request('a storefront sign that says "OPEN"', seed=11),
            "edit": rollout.request('Change the sign so that it says "CLOSED"', seed=12, image=image,
                                    image_guidance_scale=1.5)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def measure(model_dir, aio, *, device: str = "cuda", side: int = 512, group: int = 8, steps: int = 10,
            lora_rank: int = 64) -> dict:
    """Sample both groups with the engine (each twice: the second is timed), free the engine, re-score with the
    sharded policy at micro-batch `group` (timed) and 1; every figure in one dict."""
    device = torch.device(device)
    figures = {}
    engine = BagelEngine(model_dir, dtype="bfloat16", device=str(device))
    aio(engine.start())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trajs = {}
    for name, request in requests(side, group, steps).items():
        aio(engine.generate(request))  # warm-up (kernel selection, allocator)
        _sync(device)
        started = time.perf_counter()
        trajs[name] = aio(engine.generate(request))
        _sync(device)
        figures[f"rollout_s_per_group[{name}]"] = time.perf_counter() - started
        tokens = (side // 16) ** 2
        assert trajs[name].latents.shape == (group, steps + 1, tokens, 64)
        assert torch.isfinite(trajs[name].log_probs).all()
    figures["rollout_peak_gib"] = _peak_gib(device)
    engine.model = engine.autoencoder = None  # the rollout's copy of the weights is no longer needed
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    policy = Policy.from_pretrained(model_dir, lora_rank=lora_rank, lora_alpha=2 * lora_rank,
                                    target_modules=GENERATION_TARGETS, dtype=torch.bfloat16, device=device,
                                    family="bagel")
    assert policy.sharded
    for name, traj in trajs.items():
        trainer_log_probs(policy, traj, group)  # warm-up
        _sync(device)
        started = time.perf_counter()
        scored = trainer_log_probs(policy, traj, group)
        _sync(device)
        figures[f"score_s_all_steps[{name}]"] = time.perf_counter() - started
        figures[f"mismatch_mb{group}[{name}]"] = float((scored - traj.log_probs).abs().max())
        figures[f"mismatch_mb1[{name}]"] = float((trainer_log_probs(policy, traj, 1) - traj.log_probs).abs().max())
    figures["trainer_peak_gib"] = _peak_gib(device)
    return figures


def test_bagel_rollout_and_trainer_agree_at_real_width_in_bf16(real_width_bagel, nccl_group, aio):
    figures = measure(real_width_bagel, aio)
    print(f"device: {torch.cuda.get_device_name()}; BAGEL real width (3584/18944, 28/4 heads), 4 layers, bf16; "
          "groups of 8 at 512², 10 steps, CFG 4 (edit: image CFG 1.5), LoRA r=64 on the generation expert, FSDP2")
    for key, value in figures.items():
        print(f"  {key}: {value:.3e}" if key.startswith("mismatch") else f"  {key}: {value:.2f}")
    for name in ("t2i", "edit"):
        assert figures[f"mismatch_mb8[{name}]"] <= TOLERANCE, name  # scored as sampled, a whole group at a time
        assert figures[f"mismatch_mb1[{name}]"] <= CROSS_BATCH, name  # another batch size: other kernels
