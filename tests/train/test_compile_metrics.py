"""A step's compile metrics (app/train/loop.py `_compile_metrics`): the trainer's counts from its own process, the
replicas' from the groups they produced (each group carries its replica's counts)."""

from types import SimpleNamespace

from app.train.loop import _compile_metrics


def _group(frames: int, new: int, cache: dict | None):
    producer = {"compile_frames": frames, "compile_frames_new": new}
    if cache is not None:
        producer["compile_cache"] = cache
    return SimpleNamespace(trajectory=SimpleNamespace(producer=producer))


def test_the_replicas_counts_are_the_largest_any_group_carried_and_new_frames_add_up():
    worker = SimpleNamespace(compiled_frames=0)
    groups = [_group(6, 2, {"fx_hits": 3, "fx_misses": 0, "aot_hits": 2, "aot_misses": 1}),
              _group(4, 0, {"fx_hits": 5, "fx_misses": 1, "aot_hits": 0, "aot_misses": 0}),
              _group(0, 0, None)]  # vllm-omni's groups carry no counts
    out = _compile_metrics(worker, groups)
    assert out["compile/rollout_frames_max"] == 6.0 and out["compile/rollout_new_frames_sum"] == 2.0
    assert {k: v for k, v in out.items() if k.startswith("compile/rollout_") and "frames" not in k} == {
        "compile/rollout_fx_hits_max": 5.0, "compile/rollout_fx_misses_max": 1.0,
        "compile/rollout_aot_hits_max": 2.0, "compile/rollout_aot_misses_max": 1.0}
    assert {"compile/trainer_fx_hits_max", "compile/trainer_aot_misses_max"} <= set(out)
    assert worker.compiled_frames == out["compile/trainer_frames_max"]
