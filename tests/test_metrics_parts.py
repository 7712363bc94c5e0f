"""The run's numbers before they are logged: weighted means and extremes, phase timing."""

import time

import pytest

from app.metrics import BusyClock, PhaseTimer, Stats, busy_shares, throughput


def test_stats_weighted_means_and_extremes():
    stats = Stats()
    stats.add({"actor/loss": 1.0, "actor/ratio_max": 1.1, "actor/ratio_min": 0.9}, weight=1)
    stats.add({"actor/loss": 4.0, "actor/ratio_max": 1.3, "actor/ratio_min": 0.95}, weight=3)
    assert stats.result() == {"actor/loss": pytest.approx(13 / 4), "actor/ratio_max": 1.3, "actor/ratio_min": 0.9}


def test_phase_timer_adds_up_a_phase_entered_twice():
    timer = PhaseTimer()
    with timer("rollout"):
        time.sleep(0.01)
    with timer("rollout"):
        time.sleep(0.01)
    time.sleep(0.01)  # outside every phase
    out = timer.metrics()
    assert set(out) == {"timing/rollout_s", "timing/step_s", "timing/other_s"}
    assert 0.02 <= out["timing/rollout_s"] <= out["timing/step_s"] and out["timing/other_s"] >= 0.01
    assert out["timing/rollout_s"] + out["timing/other_s"] == pytest.approx(out["timing/step_s"])


def test_phase_timer_counts_the_work_a_phase_queued_inside_it():
    """With `sync` (a GPU's synchronize) each phase ends when what it queued has run: here a sync that takes
    0.02 s is counted inside the phase, once per phase, even when the phase raises."""
    calls = []
    timer = PhaseTimer(sync=lambda: (calls.append(1), time.sleep(0.02)))
    with timer("decode"):
        pass
    with pytest.raises(RuntimeError), timer("denoise"):
        raise RuntimeError("a failed group")
    assert len(calls) == 2 and timer.seconds["decode"] >= 0.02 and timer.seconds["denoise"] >= 0.02


def test_busy_clock_charges_overlapping_requests_their_share_of_the_time():
    """Two groups queued in one engine: 0-10 s the first alone, 10-20 s both, 20-30 s the second alone, then idle
    and a third 40-45 s. Charged 15, 15 and 5: they add up to the 35 s the engine had work, where each group's own
    wall time (20, 20, 5) would count the overlap twice."""
    now = [0.0]
    clock = BusyClock(now=lambda: now[0])
    first = clock.enter()
    now[0] = 10.0
    second = clock.enter()
    now[0] = 20.0
    charged_first = clock.leave(first)
    now[0] = 30.0
    charged_second = clock.leave(second)
    now[0] = 40.0
    third = clock.enter()
    now[0] = 45.0
    assert (charged_first, charged_second, clock.leave(third)) == (15.0, 15.0, 5.0)


def test_throughput_and_mfu_of_a_step():
    step = {"rollout/images": 32.0, "timing/step_s": 4.0}
    assert throughput(step, useful_tflop=989.0, gpus=2) == {
        "perf/images_per_s": 8.0, "perf/useful_tflop": 989.0, "perf/images_per_s_per_gpu": 4.0,
        "perf/mfu": pytest.approx(989e12 / (2 * 989e12 * 4.0))}
    assert set(throughput(step, useful_tflop=1.0, gpus=0)) == {"perf/images_per_s", "perf/useful_tflop"}


def test_busy_shares_and_gpu_idle_share_by_hand():
    """A 40 s step: the trainer trains 18 s (0.45 of it), the one replica generated for 14 s (0.35).
    On two GPUs, one each: 0.8 GPU-steps of 2 used, idle 0.6. Sharing one GPU (0.5 + 0.5): 0.8 of 1, idle 0.2.
    On CPUs: the shares only."""
    step = {"timing/step_s": 40.0, "timing/train_s": 18.0}
    two = busy_shares(step, rollout_busy_s=14.0, replicas=1, replica_gpus=1, workers=1, worker_gpus=1)
    shared = busy_shares(step, rollout_busy_s=14.0, replicas=1, replica_gpus=0.5, workers=1, worker_gpus=0.5)
    cpu = busy_shares(step, rollout_busy_s=14.0, replicas=1, replica_gpus=0, workers=2, worker_gpus=0)
    assert two == pytest.approx({"perf/rollout_busy_share": 0.35, "perf/trainer_busy_share": 0.45,
                                 "perf/gpu_idle_share": 0.6})
    assert shared["perf/gpu_idle_share"] == pytest.approx(0.2)
    assert cpu == pytest.approx({"perf/rollout_busy_share": 0.35, "perf/trainer_busy_share": 0.45})


# the metrics every progress line reads
LINE = {"reward/mean": 1.0, "actor/loss": 0.0, "actor/ratio_dev_first_pass_max": 0.0,
        "rollout/logprob_mismatch_max": 0.0, "rollout/staleness_max": 1.0, "timing/step_s": 2.0}


def test_the_progress_line_names_a_compilation_after_the_first_step(capfd):
    """A compiled run's console line says when a process compiled again after its first step (a shape or state
    the compiled blocks are guarded on changed); the first step compiles by design and says nothing."""
    from app.metrics import Progress

    step = LINE
    progress = Progress(first=0, total=3)
    progress.step_done(0, {**step, "compile/trainer_new_frames": 4.0, "compile/rollout_new_frames": 2.0})
    progress.step_done(1, {**step, "compile/trainer_new_frames": 0.0, "compile/rollout_new_frames": 0.0})
    progress.step_done(2, {**step, "compile/trainer_new_frames": 2.0, "compile/rollout_new_frames": 0.0})
    first, steady, again = capfd.readouterr().out.strip().splitlines()  # the real stdout (Ray Train patches print)
    assert "compiled again" not in first and "compiled again" not in steady
    assert again.endswith("compiled again: trainer +2 frames")


def test_the_first_progress_line_names_graphs_the_compile_caches_could_not_hold(capfd):
    """Graphs inductor or AOTAutograd bypassed (a restart compiles them again) are named once, on the first line."""
    from app.metrics import Progress

    step = {**LINE, "compile/trainer_fx_bypasses_max": 8.0, "compile/trainer_aot_bypasses_max": 0.0,
            "compile/rollout_fx_bypasses_max": 0.0}
    progress = Progress(first=0, total=2)
    progress.step_done(0, step)
    progress.step_done(1, step)
    first, second = capfd.readouterr().out.strip().splitlines()
    assert first.endswith("not cached: trainer 8 graphs")
    assert "not cached" not in second
    Progress(first=0, total=1).step_done(0, {**step, "compile/trainer_fx_bypasses_max": 0.0})
    assert "not cached" not in capfd.readouterr().out


def test_image_grids_are_drawn_off_the_loops_thread(tmp_path, monkeypatch, capfd):
    """`RunLog.log_images` returns before the grid is drawn (the drawing waits here until the caller has its
    future back; drawn on the caller's thread it would hold the caller 10 s and say so); `close` leaves the PNG and
    the tensorboard image written, and a grid that fails is said on stderr without raising."""
    import threading

    import numpy as np
    from PIL import Image

    import app.metrics as metrics

    returned, drawn_on = threading.Event(), []
    draw = metrics.labelled_grid

    def slow_grid(*args, **kwargs):
        drawn_on.append((threading.current_thread().name, returned.wait(10)))
        return draw(*args, **kwargs)

    monkeypatch.setattr(metrics, "labelled_grid", slow_grid)
    log = metrics.RunLog(tmp_path, first_step=0, total_steps=2)
    images = np.full((4, 16, 16, 3), 128, np.uint8)
    done = log.log_images(1, images, ["a sign", "a cat"], [{"total": [0.1, 0.2]}, {"total": [0.3, 0.4]}])
    returned.set()
    broken = log.log_images(2, images[:3], ["a sign", "a cat"], [{"total": [0.1]}, {"total": [0.2]}])  # 3 in 2 rows
    log.close()
    assert drawn_on[0] == ("image-grid_0", True)  # another thread, which found the caller already returned
    png = tmp_path / "images" / "step_000001.png"
    assert done.result() == png and Image.open(png).size[0] >= 2 * 192
    assert any(f.name.startswith("events.out.tfevents") for f in (tmp_path / "tensorboard").iterdir())
    assert isinstance(broken.exception(), ValueError) and not (tmp_path / "images" / "step_000002.png").exists()
    assert "the step's image grid was not logged: ValueError('3 images, 2 prompts" in capfd.readouterr().err


def test_each_history_row_carries_its_wall_clock_time(tmp_path):
    """A step's row in metrics.jsonl says when it was written (the cost of a restart is read from these)."""
    import time

    import app.metrics as metrics

    log = metrics.RunLog(tmp_path, first_step=0, total_steps=2)
    before = time.time()
    log.log(1, {"reward/mean": 0.5})
    log.log(2, {"reward/mean": 0.25})
    log.close()
    rows = metrics.read_history(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward/mean"] == 0.25
    assert before - 0.01 <= rows[0]["time"] <= rows[1]["time"] <= time.time() + 0.01
