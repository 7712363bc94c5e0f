"""Useful FLOPs of a FlowGRPO step and the model FLOPs utilisation (MFU) they make.

Counted from the model's shape, per image, as matrix-multiply FLOPs (2 per multiply-add); norms, activations,
softmax and the SDE step are left out (a few percent). `useful` means the work the algorithm needs: rollout
forwards (both CFG branches), the trainer's forward and its input-gradient backward (the LoRA weight gradients
are a rounding error), the reference forwards of the KL. Recomputation (gradient checkpointing, recomputed old
log-probs) is not useful work, so it lowers the MFU instead of raising it.

No torch, no Ray: numbers in, numbers out.
"""

from __future__ import annotations

from typing import Any

# dense bf16 of one H100 / H200 SXM (the vendor's datasheet; measured matmuls reach ~790 TFLOP/s)
PEAK_BF16_FLOPS = 989e12


def step_flops(forward: float, *, images: int, num_inference_steps: int, trained_steps: int, branches: int,
               kl: bool) -> dict[str, float]:
    """Useful FLOPs of one step that samples `images` images of `num_inference_steps` steps and trains
    `trained_steps` of each; `forward` = the FLOPs of one denoiser forward of one image (the family's
    `forward_flops`); `branches`: forwards per denoising step (CFG branches)."""
    rollout = images * num_inference_steps * branches * forward
    train = images * trained_steps * branches * forward * 2  # forward + input-gradient backward
    reference = images * trained_steps * branches * forward if kl else 0.0
    return {"rollout": rollout, "train": train, "reference": reference, "total": rollout + train + reference}


def group_flops(family, denoiser_config: Any, traj, *, trained_steps: int, kl: bool,
                sampled: bool = True) -> dict[str, float]:
    """Useful FLOPs of one prompt group: its rollout (unless `sampled` is False: a trainer-only benchmark) and
    `trained_steps` trained steps of each image, counted by its family (`ModelFamily.forward_flops`). The Ray loop,
    the single-GPU baseline and every bench job count with this."""
    forward, branches = family.forward_flops(denoiser_config, traj)
    return step_flops(forward, images=traj.group_size, num_inference_steps=traj.num_inference_steps if sampled else 0,
                      trained_steps=trained_steps, branches=branches, kl=kl)


def mfu(flops: float, seconds: float, gpus: float, peak: float = PEAK_BF16_FLOPS) -> float:
    """Model FLOPs utilisation: useful FLOPs over what `gpus` GPUs could do in `seconds`."""
    return flops / (gpus * peak * seconds)
