"""Import hook: let the CUDA-built torchvision 0.28.0, torchaudio 2.11.0 and torchcodec (pinned by vllm 0.30.0)
coexist with CPU-only torch 2.13.0. Does nothing when torch has CUDA.

- torchvision: its compiled ops (`_C.so`) cannot load; `_meta_registrations` then registers fake kernels for
  `torchvision::nms`/`qnms` and raises "operator torchvision::nms does not exist". Defining the two op schemas
  before torchvision is imported is enough for `import vllm_omni` (which never calls them).
- torchaudio: `torchaudio._extension` loads `_torchaudio.abi3.so`, which needs `libc10_cuda.so`, and lets the
  OSError escape; transformers imports torchaudio whenever it is installed, so `import vllm` fails. The hook makes
  that loader report "extension not available" instead, which torchaudio supports (a build without its ops).
- torchcodec: its `_core` loads a CUDA-linked library at import and raises OSError. The hook turns `import
  torchcodec` into an ImportError, which vllm handles (audio decoding off); nothing here decodes audio or video.

`app.platform.install_cpu_shim` copies this file into site-packages with a `.pth` line that imports it, so every
process of the venv (Ray workers included) gets it. Standalone on purpose: it must not import `app`.
"""

import importlib.abc
import importlib.machinery
import sys

_LIBRARY = None  # keeps the torch.library.Library alive: the schemas vanish when it is collected


def _cpu_only_torch() -> bool:
    import torch

    return torch.version.cuda is None


def _define_torchvision_op_schemas() -> None:
    global _LIBRARY
    if _LIBRARY is not None:
        return
    import torch

    try:
        _LIBRARY = torch.library.Library("torchvision", "DEF")
        _LIBRARY.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIBRARY.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:  # a working torchvision (or another shim) already defined them
        pass


def _tolerant_load_lib(module) -> None:
    real_load_lib = module._load_lib

    def _load_lib(lib: str) -> bool:
        try:
            return real_load_lib(lib)
        except OSError:  # a CUDA-built extension next to CPU torch: torchaudio runs without its compiled ops
            return False

    module._load_lib = _load_lib


class _PatchAfterExec(importlib.abc.Loader):
    """Runs the real loader, then patches the fresh module before anyone else sees it."""

    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


class _Unavailable(importlib.abc.Loader):
    """Found (so metadata checks still work) but fails to import with an ImportError that says why."""

    def create_module(self, spec):
        raise ImportError(f"{spec.name} is a CUDA build and cannot load next to CPU-only torch (ray-flowgrpo shim)")

    def exec_module(self, module):  # never reached
        raise ImportError(module.__name__)


class _CpuTorchShim(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            if _cpu_only_torch():
                _define_torchvision_op_schemas()
            return None  # let the normal finders locate torchvision
        if name == "torchaudio._extension.utils" and _cpu_only_torch():
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchAfterExec(spec.loader, _tolerant_load_lib)
            return spec
        if name == "torchcodec" and _cpu_only_torch():
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None:
                spec.loader = _Unavailable()
            return spec
        return None


if not any(type(f).__name__ == "_CpuTorchShim" for f in sys.meta_path):
    sys.meta_path.insert(0, _CpuTorchShim())
