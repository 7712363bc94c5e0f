"""The CPU platform is chosen on machines without CUDA, and an environment variable forces it either way."""

import os
import subprocess
import sys

import pytest
import torch

from app.platform.vllm_omni import plugin


@pytest.mark.parametrize("value,active", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_environment_variable_forces_the_choice(monkeypatch, value, active):
    monkeypatch.setenv(plugin.ENV_VAR, value)
    assert plugin.cpu_platform_active() is active
    assert (plugin.omni_platform() is not None) is active
    assert (plugin.vllm_platform() is not None) is active


def test_auto_follows_cuda(monkeypatch):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    assert plugin.cpu_platform_active() is (not torch.cuda.is_available())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plugin.omni_platform() is None  # GPU machines keep vllm-omni's own platform


@pytest.mark.parametrize("value,off", [("1", True), ("0", False)])
def test_the_cpu_platform_turns_off_humming_s_background_cuda_builds(monkeypatch, value, off):
    """vllm's humming starts two interpreters that build CUDA launchers on import; only the CPU platform stops
    them (they can only fail there), and a value the user set stays."""
    monkeypatch.setenv(plugin.ENV_VAR, value)
    monkeypatch.delenv("HUMMING_DISABLE_PARALLEL_BUILD", raising=False)
    plugin.vllm_platform()
    assert (os.environ.get("HUMMING_DISABLE_PARALLEL_BUILD") == "1") is off
    monkeypatch.setenv("HUMMING_DISABLE_PARALLEL_BUILD", "0")
    plugin.vllm_platform()
    assert os.environ["HUMMING_DISABLE_PARALLEL_BUILD"] == "0"


def test_bad_value_says_what_to_use(monkeypatch):
    monkeypatch.setenv(plugin.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="use 1"):
        plugin.cpu_platform_active()


@pytest.mark.slow
def test_installed_entry_points_resolve_in_a_fresh_process():
    code = ("from vllm_omni.platforms import current_omni_platform as p; from vllm.platforms import current_platform"
            " as v; print(type(p).__name__, type(v).__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    if torch.cuda.is_available():
        assert "CpuOmniPlatform" not in done.stdout
    else:
        assert done.stdout.split()[-2:] == ["CpuOmniPlatform", "CpuPlatform"]
