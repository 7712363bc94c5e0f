"""An out-of-tree OmniPlatform that runs vllm-omni diffusion on torch's CPU backend (selected by `plugin.py`).

What vllm-omni 0.30.0 needs from a platform, in the order its absence fails:
a device type and the gloo backend; no-op device calls; memory figures (from psutil: torch.cpu keeps no
allocator statistics); and an attention backend whose `forward` works off CUDA (vllm-omni's SDPA impl dispatches
only on cuda/rocm/npu/xpu/musa, although its CUDA path is plain `torch.nn.functional.scaled_dot_product_attention`).
Run it in fp32: the text encoder and VAE load in the checkpoint dtype while the DiT uses the engine dtype.
"""

import os

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT
    device_type = "cpu"
    device_name = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend, head_size, allow_trtllm_default=False) -> str:
        # by name: the attention module imports `current_omni_platform`, which is being resolved right now
        return "app.platform.vllm_omni.attention.CpuSDPABackend"

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def supports_float64(cls) -> bool:
        return True

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @classmethod
    def get_current_memory_usage(cls, device: torch.device | None = None) -> float:
        return float(psutil.Process(os.getpid()).memory_info().rss)

    # vllm's Platform.__getattr__ returns None for unknown names and the diffusion runner calls these.
    @classmethod
    def reset_peak_memory_stats(cls, device=None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device=None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def memory_allocated(cls, device=None) -> int:
        return 0
