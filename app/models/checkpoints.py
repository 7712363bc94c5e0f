"""Checkpoint folders by model family: what one must hold, and the tiny one the project builds in its place."""

from __future__ import annotations

from pathlib import Path

# files that identify a family's checkpoint folder
REQUIRED_FILES = {"qwen_image": ("model_index.json",),
                  "bagel": ("config.json", "llm_config.json", "ema.safetensors", "ae.safetensors")}


def checkpoint_problem(family: str, path: str | Path) -> str | None:
    """None when `path` looks like a `family` checkpoint, else what is missing."""
    missing = [name for name in REQUIRED_FILES[family] if not (Path(path) / name).is_file()]
    if not missing:
        return None
    layout = "a diffusers Qwen-Image folder" if family == "qwen_image" else "a BAGEL-7B-MoT folder"
    return f"is not {layout} (missing {', '.join(missing)})"


def build_tiny(family: str, path: str | Path, seed: int = 0) -> Path:
    """The deterministic tiny random checkpoint of `family` at `path` (kept when an identical build is there)."""
    if family == "bagel":
        from app.models.tiny_bagel import build_tiny_bagel

        return build_tiny_bagel(path, seed=seed)
    from app.models.tiny import build_tiny_qwen_image

    return build_tiny_qwen_image(path, seed=seed)
