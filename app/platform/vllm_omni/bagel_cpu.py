"""What vllm-omni 0.30's BAGEL pipeline needs to run on the CPU, and to run a tiny checkpoint on any device: every
workaround in one place. Nothing here knows our models: what a checkpoint declares (a tiny autoencoder's geometry)
is handed in by the caller.

On the CPU only (no-ops on CUDA):
1. `_C::silu_and_mul`: vllm's `SiluAndMul.__init__` binds this op on a CPU platform, and the CUDA vllm wheel has no
   CPU kernels: app/platform/vllm_omni/cpu_ops.py defines it (and the other ops vLLM's layers bind) when missing.
2. Input casts: the pipeline runs its model calls under CUDA autocast, which it disables on the CPU, so fp32 inputs
   (timestep embeddings, latents, pixels) meet bf16 weights at the model's entry points. A forward pre-hook casts
   them there, which is what autocast does on CUDA.

For a tiny checkpoint, on every device (CUDA included: without 3, vllm-omni's loader finds the checkpoint's
autoencoder weights fit no parameter, "weights were not initialized from checkpoint"):
3. The tiny autoencoder: vllm-omni always builds the 84M-parameter FLUX autoencoder; a tiny checkpoint declares a
   smaller geometry, which the caller passes (`adapt_pipeline(..., autoencoder=...)`), and it is swapped in.
4. The engine's start-up warm-up asks for a 512x512 image (with an input image), which a checkpoint that generates
   less refuses (and which takes minutes in bf16 on a CPU): it asks for the smallest size instead, on the CPU and
   for a tiny checkpoint (app/platform/vllm_omni/warmup.py, as every family's warm-up on the CPU platform).
"""

from __future__ import annotations

import torch


def _cast_to_weight_dtype(module: torch.nn.Module, args: tuple, kwargs: dict):
    dtype = next(module.parameters()).dtype

    def cast(value):
        return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def adapt_pipeline(pipeline, *, autoencoder: dict | None = None) -> None:
    """Workaround 3 on a constructed `BagelPipeline` (before its weights load), and 2 when it runs off CUDA.
    autoencoder: the `AutoEncoderParams` of a smaller autoencoder the checkpoint holds (None: FLUX's own)."""
    if autoencoder:
        from vllm_omni.diffusion.models.bagel.autoencoder import AutoEncoderParams, DistributedAutoEncoder

        dtype = next(pipeline.vae.parameters()).dtype
        pipeline.vae = DistributedAutoEncoder(AutoEncoderParams(**autoencoder)).to(pipeline.device, dtype)
    if pipeline.device.type == "cuda":
        return
    bagel = pipeline.bagel
    for module in (bagel.time_embedder.mlp, bagel.vae2llm, bagel.llm2vae, pipeline.vae.encoder,
                   pipeline.vae.decoder, bagel.vit_model):
        if module is not None:
            module.register_forward_pre_hook(_cast_to_weight_dtype, with_kwargs=True)
