"""vllm-omni's start-up warm-up (one request of 512x512 pixels, 2 steps, made by the diffusion engine before it
serves) at the smallest size, where it buys nothing or cannot run: on the CPU platform (no kernels to tune, CUDA
graphs or compilation to warm: it only costs a replica's start seconds of CPU) and for a checkpoint that generates
less than 512 pixels (a tiny BAGEL). Patched in the engine process, where the pipeline class is imported before the
warm-up runs; each caller adds its condition on the engine's diffusion config (its `model` folder, its
`model_class_name`)."""

from __future__ import annotations

WARMUP_REQUEST_SIDE = 512  # pixels: vllm-omni's own warm-up request (DiffusionEngine._dummy_run)
WARMUP_SIDE = 32  # pixels: one latent token pair at BAGEL's stride of 16, a 2x2 patch grid for Qwen-Image and SD3
_CONDITIONS: list = []


def shrink_warmup(applies) -> None:
    """Ask for WARMUP_SIDE pixels instead of 512 where `applies(od_config)`; idempotent per condition."""
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

    if applies not in _CONDITIONS:
        _CONDITIONS.append(applies)
    if getattr(DiffusionEngine._make_dummy_request, "flowgrpo_shrunk", False):
        return
    make = DiffusionEngine._make_dummy_request

    def make_dummy_request(engine, *, height: int, width: int, **kwargs):
        if any(condition(engine.od_config) for condition in _CONDITIONS):
            height = width = WARMUP_SIDE
        return make(engine, height=height, width=width, **kwargs)

    make_dummy_request.flowgrpo_shrunk = True
    DiffusionEngine._make_dummy_request = make_dummy_request


def on_the_cpu_platform(od_config) -> bool:
    from app.platform.vllm_omni.plugin import cpu_platform_active

    return cpu_platform_active()
