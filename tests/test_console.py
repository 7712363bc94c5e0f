"""The console stays quiet by default (app/console.py): no progress bars from the Hugging Face libraries when a
checkpoint is written or read, whether they were imported before or after, and `logging.verbose` keeps them; no
colour codes in the workers' lines when the console is not a terminal."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD = """
{before}
from app import console
console.quiet_this_process({verbose})
from app.rewards.tiny import build_tiny_clip
build_tiny_clip({out!r}, overwrite=True)
"""


@pytest.mark.slow  # fresh processes that import the ML stack
@pytest.mark.parametrize("before", ["import transformers, diffusers", "pass"])
@pytest.mark.parametrize("verbose", [False, True])
def test_writing_a_checkpoint_shows_no_progress_bar_unless_verbose(tmp_path, before, verbose):
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    done = subprocess.run([sys.executable, "-c", BUILD.format(before=before, verbose=verbose, out=str(tmp_path / "m"))],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("Writing model shards" in done.stderr) is verbose


def test_no_colour_codes_for_a_console_that_is_not_a_terminal():
    env = {k: v for k, v in os.environ.items() if k != "RAY_COLOR_PREFIX"}
    # Ray's own note on deduplicated lines is coloured whatever RAY_COLOR_PREFIX says: the driver's streams drop it
    code = ("import os, sys; from app import console; console.set_driver_env(False); "
            "print(os.environ.get('RAY_COLOR_PREFIX')); "
            "from ray._private.ray_logging import _color; print('a line' + _color(' [repeated 3x]')); "
            "print(_color('on stderr'), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["0", "a line [repeated 3x]"]  # a pipe: Ray's lines without colour
    assert done.stderr.strip() == "on stderr"
