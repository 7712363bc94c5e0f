"""`jobs.train` on one GPU with a small model: the 2-GPU config's recipe with the rollout replica and the training
worker sharing the GPU, two steps. Runs on the lent GPU machine; deselected elsewhere."""

import pytest
from job_runs import run_job

from app.metrics import read_history

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_two_steps_on_one_gpu(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    done = run_job(f"model.path={tiny_model_dir}", "rollout.height=64", "rollout.width=64", "rollout.group_size=4",
                   "train.micro_batch_size=4", "train.groups_per_step=2", "train.num_steps=2",
                   "rollout.replica_num_gpus=0.5", "cluster.worker_num_gpus=0.5", "reward.ocr_detect_min_side=64",
                   f"logging.dir={run_dir}",
                   config="configs/qwen_image_ocr_2gpu.yaml")
    assert done.returncode == 0, done.stderr[-4000:]
    records = read_history(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/staleness_max"] == 0 and r["rollout/logprob_mismatch_max"] <= 1e-3
        assert r["memory/rollout_peak_gib_max"] > 0 and r["memory/trainer_peak_gib_max"] > 0
        assert 0 < r["perf/mfu"] < 1 and r["perf/images_per_s_per_gpu"] > 0
