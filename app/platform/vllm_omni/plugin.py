"""Entry points that put vllm and vllm-omni on the CPU on machines without a GPU, and only there.

Registered in pyproject.toml under `vllm.platform_plugins` and `vllm_omni.platform_plugins`; both libraries call
them while resolving their current platform, in every process (Ray workers included). Without them vllm-omni
picks `UnspecifiedOmniPlatform` on a CPU-only machine and fails in `DiffusionWorker.init_device`.

`RAY_FLOWGRPO_CPU_PLATFORM=1` forces the CPU platform on, `=0` forces it off; unset, it is on exactly when torch
sees no CUDA device. GPU machines therefore keep vllm's and vllm-omni's own platforms. Import-light: no vllm here.
"""

import os

ENV_VAR = "RAY_FLOWGRPO_CPU_PLATFORM"


def cpu_platform_active() -> bool:
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    if forced:
        raise ValueError(f"{ENV_VAR}={forced!r}: use 1 (force CPU), 0 (never) or leave it unset (auto)")
    import torch

    return not torch.cuda.is_available()


def vllm_platform() -> str | None:
    """vllm's own CPU platform (memory queries, distributed defaults) when the CPU platform is active."""
    if not cpu_platform_active():
        return None
    # vllm imports humming (its quantized-kernel library), which on import starts two interpreters that build
    # CUDA launchers in the background: with no GPU they can only fail, and each costs a torch import (about
    # 3.5 s of CPU in every rollout replica); vllm resolves its platform before it imports humming
    os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
    return "vllm.platforms.cpu.CpuPlatform"


def omni_platform() -> str | None:
    return "app.platform.vllm_omni.platform.CpuOmniPlatform" if cpu_platform_active() else None
