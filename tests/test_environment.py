"""The installed environment: the pinned stack imports on this machine, in a fresh process (as Ray workers do)."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_pinned_stack_imports_in_a_fresh_process():
    code = ("import vllm_omni, vllm, ray, diffusers, peft, torch, transformers; "
            "print(vllm.__version__, vllm_omni.__version__, ray.__version__, diffusers.__version__, torch.__version__,"
            " transformers.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    vllm, vllm_omni, ray, diffusers, torch, transformers = done.stdout.split()[-6:]
    assert (vllm, vllm_omni, ray, diffusers) == ("0.30.0", "0.30.0", "2.60.0", "0.40.0")
    assert torch.startswith("2.13.0") and transformers.startswith("5.14.")


def test_shim_installer_follows_the_torch_build(tmp_path, monkeypatch):
    import torch

    from app.platform import install_cpu_shim

    message = install_cpu_shim.install(tmp_path)
    pth = tmp_path / f"{install_cpu_shim.MODULE_NAME}.pth"
    if torch.version.cuda is None:
        assert "installed" in message and pth.read_text().strip() == f"import {install_cpu_shim.MODULE_NAME}"
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        assert "no shim installed" in install_cpu_shim.install(tmp_path)
    else:
        assert "no shim installed" in message
    assert not pth.exists()  # on CUDA torch it installs nothing and removes a stale one


@pytest.mark.slow
@pytest.mark.parametrize("module", ["torchvision", "torchaudio"])
def test_cuda_built_companions_import_next_to_cpu_torch(module):
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
