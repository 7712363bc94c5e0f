"""`python -m jobs.train` end to end on the tiny config, in fresh processes as a user runs it: a bad config is
refused before anything starts; the tiny run learns, stays on-policy, evaluates and writes what it promises;
`jobs.evaluate` reproduces its evaluations. (Resuming a stopped run and processes dying:
tests/test_fault_tolerance.py. Each end-to-end run pays a Ray cluster, a Serve app and a Train worker group before
its first step, so the features the tiny config leaves off ride on the other families' runs: the loss terms on
BAGEL's, tests/test_train_job_bagel.py; the pipelined schedule with an SDE window on SD3's,
tests/test_train_job_sd3.py.)"""

import json
import math
import subprocess
import sys

import pytest
from job_runs import REPO, comparable, eval_lines, history, run_job

pytestmark = [pytest.mark.slow, pytest.mark.jobs]


@pytest.mark.parametrize("override, key", [
    ("train.learning_rat=1e-3", "train.learning_rat"),  # unknown key
    ("rollout.group_size=many", "rollout.group_size"),  # wrong type
    ("model.build_tiny=false", "model.path"),  # no checkpoint at the model path
    ("data.prompts=/nowhere/prompts.txt", "data.prompts"),
    ("reward.weights={ocrr: 1.0}", "reward.weights"),  # a misspelt reward, caught before any replica starts
    ("eval.prompts=ocr_evall", "eval.prompts"),
])
def test_bad_config_is_one_line_naming_the_key_and_starts_nothing(tmp_path, override, key):
    run_dir = tmp_path / "run"
    done = run_job(f"logging.dir={run_dir}", f"model.path={tmp_path / 'no-model'}", override, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], done.stderr
    assert not run_dir.exists() and "Ray" not in done.stdout + done.stderr  # nothing was started or written


def test_a_run_larger_than_its_local_cluster_is_refused_naming_the_parts(tmp_path):
    """Reward replicas asking for more CPUs than the machine has: Ray would leave them pending forever; the job
    stops once its local cluster is up, before deploying anything, and names what reserves the CPUs."""
    done = run_job(f"logging.dir={tmp_path / 'run'}", "reward.replica_num_cpus=512", timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "reward (2 x reward.replica_num_cpus/gpus) 1024" in error[0], done.stderr[-3000:]
    assert "CPUs" in error[0] and "GPUs" not in error[0] and "deploying" not in done.stdout


@pytest.mark.parametrize("job", ["jobs.train", "jobs.evaluate"])
def test_a_config_file_that_does_not_exist_is_one_line_naming_it(job):
    done = subprocess.run([sys.executable, "-m", job, "--config", "configs/nonexistent.yaml"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == ("error: --config configs/nonexistent.yaml: no such file "
                                                            "(configs/ holds the project's configs, e.g. "
                                                            "configs/tiny_cpu.yaml)")


def test_missing_model_path_names_the_key(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jobs.train", "--config", "configs/qwen_image_ocr.yaml"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "model.path" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_tiny_run_learns_jpeg_compressibility(tiny_run):
    """Mean JPEG-compressibility reward (−kB) of the last 4 steps minus that of the first 4, tiny config, seed 0.

    Measured with this job on the 2-core machine, one whole 24-step run per figure (train.seed sets the prompt
    order, the rollout noise and the LoRA init):
      learning (lr 3e-2, as shipped):  seed 0: +0.117, seed 1: +0.086, seed 2: +0.140
      no learning (lr 0), the noise:   seed 0: +0.027, seed 1: +0.011, seed 2: −0.011  (mean +0.009, std 0.019)
      advantage sign flipped, seed 0:  −0.047 (this test then fails; measured before reward.ocr_detect_min_side)
    The threshold 0.06 is 2.7 noise stds above the noise mean and below every learning seed.
    """
    jpeg = [r["reward/jpeg_compressibility/mean"] for r in history(tiny_run)]
    assert len(jpeg) == 24
    gain = sum(jpeg[-4:]) / 4 - sum(jpeg[:4]) / 4
    assert gain > 0.06, (gain, jpeg)


def test_tiny_run_is_on_policy_every_step(tiny_run):
    records = history(tiny_run)
    for step, r in enumerate(records, start=1):
        assert r["step"] == step and r["rollout/adapter_version"] == step  # published after every step
        assert r["rollout/staleness_max"] == 0  # step k+1 sampled from the adapter of step k
        assert r["actor/ratio_dev_first_pass_max"] <= 1e-5  # ratio = 1 at the first inner step
        assert r["rollout/logprob_mismatch_max"] <= 1e-5  # the trainer scores what the rollout sampled
        assert r["rollout/images"] == 16 and math.isfinite(r["actor/loss"])
        assert r["timing/publication_s_max"] > 0  # the step's own adapter, on every replica before the next step
    assert any(r["actor/grad_norm"] > 0 for r in records)


def test_tiny_run_says_where_its_start_went(tiny_run):
    """The first step logs the start-up breakdown (app/startup.py): every phase measured, each inside the total, the
    replicas serving before the first step ended; no later step logs one."""
    first, *rest = history(tiny_run)
    start = {k: v for k, v in first.items() if k.startswith("timing/startup_")}
    assert set(start) == {f"timing/startup_{p}_s" for p in ("ray", "serve", "replica", "replicas_ready", "workers",
                                                             "policy", "setup", "first_step", "total")}
    assert all(0 <= v <= start["timing/startup_total_s"] for v in start.values()), start
    assert start["timing/startup_first_step_s"] == pytest.approx(first["timing/step_s"], abs=0.5)
    assert not any(k.startswith("timing/startup_") for r in rest for k in r)


def test_tiny_run_writes_checkpoints_logs_and_pictures(tiny_run):
    final = tiny_run / "checkpoints" / "checkpoint_step_000024"
    for name in ("adapter/pytorch_lora_weights.safetensors", "optimizer.pt", "trainer_state.json",
                 "rng_rank0.pt", "rng_rank1.pt"):
        assert (final / name).is_file(), name
    state = json.loads((final / "trainer_state.json").read_text())
    assert state == {"step": 24, "adapter_version": 24, "data_position": 96, "seed": 0}
    assert (tiny_run / "checkpoints" / "checkpoint_step_000008").is_dir()
    assert any((tiny_run / "tensorboard").glob("events.out.tfevents.*"))
    for picture in ("reward_curve.png", "samples.png"):
        assert (tiny_run / picture).stat().st_size > 1000


def test_tiny_run_evaluates_the_same_held_out_prompts_and_noise_every_time(tiny_run):
    """The shipped config evaluates before the first step and every 8 steps (ocr_eval_tiny: 4 prompts x 2 images,
    noise level 0): eval metrics, per-image lines, a grid each time and the eval curve; the sentinels of the base
    evaluation are the base model against itself."""
    evaluations = eval_lines(tiny_run)
    assert sorted(evaluations) == [0, 8, 16, 24]
    for step, line in evaluations.items():
        assert line["adapter_version"] == step and line["eval/images"] == 8
        assert all(math.isfinite(line[k]) for k in line if k.startswith(("eval/", "sentinel/")))
        assert {"eval/reward/ocr", "eval/reward/jpeg_compressibility", "eval/ocr_accuracy",
                "eval/ocr_exact_match", "sentinel/colour_entropy_change", "sentinel/edge_energy_change",
                "sentinel/brightness_change", "sentinel/dark_fraction_change", "sentinel/distance_to_base"} <= set(line)
        records = [json.loads(x) for x in (tiny_run / "eval" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(records) == 8 and [r["prompt_index"] for r in records] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert (tiny_run / "eval" / f"grid_step_{step:06d}.png").stat().st_size > 1000
    base = evaluations[0]
    assert base["sentinel/distance_to_base"] == 0 and base["sentinel/colour_entropy_change"] == 0
    assert all(evaluations[s]["sentinel/distance_to_base"] > 0 for s in (8, 16, 24))  # the adapter changed them
    first = [json.loads(x)["seed"] for x in (tiny_run / "eval" / "step_000000.jsonl").read_text().splitlines()]
    last = [json.loads(x)["seed"] for x in (tiny_run / "eval" / "step_000024.jsonl").read_text().splitlines()]
    assert first == last  # the same noise every evaluation
    assert (tiny_run / "eval_curve.png").stat().st_size > 1000
    events = b"".join(p.read_bytes() for p in (tiny_run / "tensorboard").glob("events.out.tfevents.*"))
    assert b"eval/reward/mean" in events and b"sentinel/distance_to_base" in events and b"eval/grid" in events


def test_jobs_evaluate_on_a_checkpoint_equals_the_evaluation_during_training(tiny_run, tmp_path, job_cluster):
    """`python -m jobs.evaluate` of the checkpoint of step 8, twice, beside the base model: each column equals the
    training run's evaluation of that step (the base: of step 0), image for image; a bad adapter is refused."""
    adapter = tiny_run / "checkpoints" / "checkpoint_step_000008"
    refused = subprocess.run([sys.executable, "-m", "jobs.evaluate", "--config", "configs/tiny_cpu.yaml",
                              "--adapter", str(adapter), "model.lora_rank=8"], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "set model.lora_rank=4" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Ray" not in refused.stdout + refused.stderr
    out = tmp_path / "evaluation"
    done = subprocess.run([sys.executable, "-m", "jobs.evaluate", "--config", "configs/tiny_cpu.yaml",
                           "--adapter", str(adapter), "--adapter", str(adapter / "adapter"), "--out", str(out),
                           f"cluster.address={job_cluster.address}", f"cluster.serve_port={job_cluster.serve_port}",
                           "rollout.num_replicas=1", "reward.num_replicas=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "checkpoint_step_000008#2" in done.stdout and "OCR exact match" in done.stdout
    assert "(vllm_omni engine)" in done.stdout.splitlines()[0]
    columns = json.loads((out / "evaluation.json").read_text())["evaluations"]
    assert [c["name"] for c in columns] == ["base", "checkpoint_step_000008", "checkpoint_step_000008#2"]
    during = eval_lines(tiny_run)
    assert comparable(columns[0]) == comparable(during[0])
    assert comparable(columns[1]) == comparable(during[8]) == comparable(columns[2])

    def per_image(path):
        return [{k: v for k, v in json.loads(x).items() if k != "adapter_version"}
                for x in path.read_text().splitlines()]

    assert per_image(out / "checkpoint_step_000008.jsonl") == per_image(tiny_run / "eval" / "step_000008.jsonl")
    assert (out / "grid_checkpoint_step_000008.png").is_file()


def test_a_line_printed_on_either_node_of_the_job_cluster_reaches_the_driver_once(job_cluster):
    """One log monitor for the host (Ray's rule: both nodes write to the head's session folder, which it reads
    whole): a worker's line on the trainer node reaches a driver joining the cluster, and only once."""
    import contextlib
    import queue
    import threading
    import time

    from job_runs import ROLLOUT_NODE, TRAINER_NODE

    code = ("import ray, time\n"
            f"ray.init(address={job_cluster.address!r})\n"
            "@ray.remote(num_cpus=0)\n"
            "def say(node):\n    print(f'hello from the {node} node', flush=True)\n"
            f"ray.get([say.options(resources={{{ROLLOUT_NODE!r}: 1}}).remote('rollout'),"
            f" say.options(resources={{{TRAINER_NODE!r}: 1}}).remote('trainer')])\n"
            "time.sleep(300)  # the log monitor's lines come after the results: stopped by the test\n")
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in driver.stdout], daemon=True).start()
    seen, deadline, quiet_until = [], time.monotonic() + 180, None
    try:  # until both lines arrived and 3 s more passed (a second copy would come then), or the deadline
        while time.monotonic() < min(deadline, quiet_until or deadline) and driver.poll() is None:
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=0.5))
            output = "".join(seen)
            if quiet_until is None and all(f"hello from the {n} node" in output for n in ("rollout", "trainer")):
                quiet_until = time.monotonic() + 3
    finally:
        driver.kill()
        driver.wait()
    output = "".join(seen)
    assert output.count("hello from the rollout node") == 1, output[-3000:]
    assert output.count("hello from the trainer node") == 1, output[-3000:]
