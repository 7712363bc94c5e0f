"""The fingerprint that lets a job use a running Serve application instead of deploying its own: equal exactly when
the replicas would be built the same (the same sections, the model path as the replicas get it, the same
environment)."""

import dataclasses
from pathlib import Path

from app.config import AppConfig, load
from deployments.builders import app_fingerprint

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")


def _app(*overrides: str) -> AppConfig:
    return load(TINY, list(overrides)).app()


def test_the_same_sections_give_the_same_fingerprint_a_relative_path_its_absolute_one(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    relative, absolute = _app("model.path=model"), _app(f"model.path={tmp_path / 'model'}")
    assert app_fingerprint(relative) == app_fingerprint(absolute) == app_fingerprint(dataclasses.asdict(absolute))


def test_any_change_to_what_a_replica_is_built_from_changes_it(monkeypatch):
    base = app_fingerprint(_app())
    for override in ("rollout.num_replicas=1", "rollout.noise_level=0.5", "reward.weights={ocr: 1.0}",
                     "model.lora_rank=8", "serve.max_n=8", "serve.log_level=DEBUG"):
        assert app_fingerprint(_app(override)) != base, override
    monkeypatch.setenv("RAY_FLOWGRPO_CRASH", "rollout.generate=1@/tmp/marker")  # handed to the replicas
    assert app_fingerprint(_app()) != base
