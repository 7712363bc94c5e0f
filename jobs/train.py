"""Train a LoRA of the diffusion transformer with FlowGRPO on Ray.

    python -m jobs.train --config configs/tiny_cpu.yaml [key=value ...] [--resume]
    ray job submit --working-dir . -- python -m jobs.train --config configs/tiny_cpu.yaml logging.dir=/abs/run

Joins the cluster of `cluster.address` / RAY_ADDRESS (what `ray job submit` sets) or starts a local one, deploys
the rollout + reward Serve application from the config and, while its replicas load, starts the `TorchTrainer`
(FSDP2 workers, gloo on CPU, NCCL on GPUs); at the end it draws the reward curve and points at everything it
wrote under `logging.dir`. The config is checked before anything starts: a bad one is a one-line error that names
the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

import psutil

from app.config import ConfigError, RunConfig, load, to_yaml
from app.startup import startup_line

CHECKPOINTS = "checkpoints"  # Ray Train run name: checkpoints land in <logging.dir>/checkpoints/checkpoint_step_*


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run config YAML, e.g. configs/tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.learning_rate=1e-3")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in logging.dir from its latest checkpoint")
    parser.add_argument("--keep-serving", action="store_true",
                        help="leave the rollout/reward Serve application running after training")
    return parser.parse_intermixed_args(argv)  # overrides before or after the options


def checked_config(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """The run config and run folder, or a ConfigError saying what to change. Starts nothing."""
    config = load(args.config, args.overrides)
    check_model_path(config)
    from app.prompt_sets import load_prompts

    try:
        prompts = load_prompts(config.data.prompts)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if config.eval.enabled:
        check_eval_set(config, prompts)
    # Ray workers run in their own folders: every path they read becomes absolute here
    for section, key in ((config.data, "prompts"), (config.eval, "prompts")):
        if Path(getattr(section, key)).expanduser().is_file():
            setattr(section, key, str(Path(getattr(section, key)).expanduser().resolve()))
    run_dir = Path(config.logging.dir).expanduser().resolve()
    compiled = config.model.compile
    if compiled.enabled:  # one inductor cache for the run's processes: restarts and --resume start warm
        compiled.cache_dir = str(Path(compiled.cache_dir).expanduser().resolve() if compiled.cache_dir
                                 else run_dir / "compile_cache")
    has_checkpoint = any((run_dir / CHECKPOINTS).glob("checkpoint_step_*"))
    if args.resume and not has_checkpoint:
        raise ConfigError(f"logging.dir={config.logging.dir!r} has no checkpoint to resume: drop --resume, or point "
                          "logging.dir at the run to continue")
    if not args.resume and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"logging.dir={config.logging.dir!r} already holds a run: pass --resume to continue it, "
                          "or set logging.dir to a new folder")
    return config, run_dir


def check_model_path(config: RunConfig) -> None:
    """A ConfigError unless model.path is a checkpoint of model.family (or the tiny model is built there); the path
    made absolute (Ray workers and replicas run in their own folders)."""
    from app.models.family import get_family

    model = Path(config.model.path).expanduser()
    if not config.model.build_tiny and (problem := get_family(config.model.family).checkpoint_problem(model)):
        raise ConfigError(f"model.path={config.model.path!r} {problem}: point it at a model.family="
                          f"{config.model.family} checkpoint, or set model.build_tiny=true for the tiny CPU model")
    config.model.path = str(model.resolve())


def check_eval_set(config: RunConfig, training_prompts: list | None) -> list:
    """The eval set's prompts (a ConfigError if it cannot be read); a warning when some are training prompts."""
    from app.prompt_sets import eval_prompts, overlap

    try:
        prompts = eval_prompts(config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    shared = overlap(prompts, training_prompts) if training_prompts else 0
    if shared:
        print(f"warning: {shared} of the {len(prompts)} prompts of eval.prompts={config.eval.prompts} are also "
              f"training prompts (data.prompts={config.data.prompts}): the evaluation is not held out there",
              file=sys.stderr, flush=True)
    return prompts


def start_ray(config: RunConfig):
    from app import console

    verbose = config.logging.verbose
    console.set_driver_env(verbose)  # read when ray is imported
    import ray
    import ray.serve  # configures Serve's logger when imported: quiet it after

    console.quiet_this_process(verbose)
    # workers started by a local cluster inherit this environment; an existing cluster keeps its own
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    context = ray.init(address=config.cluster.address, log_to_driver=True,
                       logging_level=console.log_level(verbose))
    console.quiet_this_process(verbose)  # ray.init set up its own handlers
    return context


def resource_shortfall(config: RunConfig, available: dict[str, float]) -> str | None:
    """None when the cluster's resources hold everything the run reserves; else a message naming what is
    short, the parts that need it and the keys that set them (Ray would otherwise wait for them forever)."""
    parts = config.resources()
    short = []
    for kind in ["CPU", "GPU", *sorted({k for p in parts.values() for k in p} - {"CPU", "GPU"})]:
        need = sum(p.get(kind, 0.0) for p in parts.values())
        have = float(available.get(kind, 0.0))
        if need > have + 1e-9:
            where = ", ".join(f"{name} {p[kind]:g}" for name, p in parts.items() if p.get(kind, 0.0) > 0)
            short.append(f"{need:g} {kind if kind in ('CPU', 'GPU') else repr(kind)}s ({where}) but the cluster has "
                         f"{have:g}")
    if not short:
        return None
    return "the run reserves " + "; and ".join(short) + ": lower those settings or use a larger cluster"


def shares_gpus(config: RunConfig) -> bool:
    """Replicas and ranks both on fractions of GPUs: the shared placement (a replica and a rank on each GPU)."""
    cl, ro = config.cluster, config.rollout
    return cl.use_gpu and 0 < ro.replica_num_gpus < 1 and 0 < cl.worker_num_gpus < 1


def packing_warning(config: RunConfig) -> str | None:
    """Ray hands out a fraction of a GPU from the fullest GPU it still fits (best fit), so replicas of half a GPU
    or less pack two to a GPU, and the ranks take the GPUs left: not a replica and a rank on each GPU."""
    ro = config.rollout
    if not (shares_gpus(config) and ro.num_replicas > 1 and ro.replica_num_gpus <= 0.5):
        return None
    return (f"rollout.num_replicas={ro.num_replicas} at rollout.replica_num_gpus={ro.replica_num_gpus:g}: Ray packs "
            f"fractions of a GPU best-fit, so {int(1 // ro.replica_num_gpus)} replicas share a GPU and the ranks "
            "another; for a replica and a rank on each GPU give the replica more than half "
            "(rollout.replica_num_gpus=0.6 cluster.worker_num_gpus=0.4)")


def wait_for_replica_gpus(config: RunConfig, timeout_s: float = 120.0) -> None:
    """In the shared placement the replicas must hold their GPUs before the ranks ask for theirs: a rank placed
    first takes a fraction of GPU 0, and best fit then puts the next rank there too. The replicas' actors reserve
    their GPUs within a second or two of the deployment (long before their models load); wait for that."""
    import ray

    if not shares_gpus(config):
        return
    need = config.rollout.num_replicas * config.rollout.replica_num_gpus
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = ray.cluster_resources().get("GPU", 0.0) - ray.available_resources().get("GPU", 0.0)
        if held >= need - 1e-6:
            return
        time.sleep(0.2)
    print(f"warning: the rollout replicas hold no GPUs after {timeout_s:.0f} s; the training ranks may pack onto "
          "the same GPUs", file=sys.stderr, flush=True)


def deploy_serve_app(config: RunConfig, app_name: str | None = None, *, wait: bool = True):
    """Deploy the rollout/reward application of `config` as `app_name` (default: deployments.builders.APP_NAME);
    its (Rollout, Reward, Adapters) handles. `wait=False` returns once the application is registered, while its
    replicas still start: requests through the handles queue until they serve (`ServingWatch` says whether they
    ever will). An application of that name that runs and was built from the same sections and environment
    (`deployments.builders.app_fingerprint`) is used as it is: an earlier job's, kept with `--keep-serving` on a
    long-lived cluster; the training loop resets its replicas to the run's own adapter first."""
    from ray import serve

    from app.console import log_level
    from deployments.builders import APP_NAME, app_fingerprint, build_app
    from deployments.client import handles, running_fingerprint

    app_name = app_name or APP_NAME

    level = log_level(config.logging.verbose)
    serve.start(http_options={"host": "127.0.0.1", "port": config.cluster.serve_port},
                logging_config={"log_level": level})  # the controller and proxy
    app = config.app()
    if app.serve.log_level is None:  # the replicas follow logging.verbose unless serve.log_level says otherwise
        app = dataclasses.replace(app, serve=dataclasses.replace(app.serve, log_level=level))
    if running_fingerprint(app_name) == app_fingerprint(app):
        print(f"using the running rollout/reward application {app_name!r} (the same sections: nothing reloads)",
              flush=True)
        return handles(app_name)
    print(f"deploying the rollout/reward application ({config.rollout.num_replicas} rollout replicas, "
          f"{config.reward.num_replicas} reward replicas)...", flush=True)
    serve.run_many([serve.RunTarget(build_app(app), name=app_name, route_prefix=f"/{app_name}")],
                   wait_for_applications_running=wait)
    return handles(app_name)


def abort_training(message: str) -> None:
    """`ServingWatch`'s action in the job: SIGINT to this process, which Ray Train's `fit` answers by aborting the
    run gracefully (workers stopped, nothing left behind); before `fit` listens it is a KeyboardInterrupt."""
    import signal

    os.kill(os.getpid(), signal.SIGINT)


def fit(config: RunConfig, run_dir: Path, rollout, reward, adapters, startup: dict[str, float] | None = None):
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from app.console import log_level
    from app.train.loop import train_loop_per_worker

    cl = config.cluster
    resources = {"CPU": cl.worker_num_cpus, **({"GPU": cl.worker_num_gpus} if cl.use_gpu else {}),
                 **cl.worker_resources}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": config, "run_dir": str(run_dir), "rollout": rollout, "reward": reward,
                           "adapters": adapters, "startup": {**(startup or {}), "fit_called": time.time()}},
        scaling_config=ray.train.ScalingConfig(num_workers=cl.num_workers, use_gpu=cl.use_gpu,
                                               resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if cl.use_gpu else "gloo"),
        # a dead worker restarts the whole worker group from the latest checkpoint (`train.max_failures` times)
        run_config=ray.train.RunConfig(name=CHECKPOINTS, storage_path=str(run_dir),
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.train.checkpoints_to_keep),
                                       failure_config=ray.train.FailureConfig(max_failures=config.train.max_failures),
                                       logging_config=ray.train.LoggingConfig(log_level=log_level(config.logging.verbose))),
    )
    return trainer.fit()


def startup_summary(config: RunConfig, run_dir: Path, dashboard_url: str | None, *, resume: bool,
                    nodes: int = 1) -> str:
    """What is about to run, in a few lines (the console's first lines); `nodes`: the Ray cluster's live nodes."""
    model, rollout, train, cluster = config.model, config.rollout, config.train, config.cluster
    rewards = " + ".join(f"{weight:g}·{name}" for name, weight in config.reward.weights.items())
    tiny = " (tiny, built locally)" if model.build_tiny else ""
    backend = "GPU, nccl" if cluster.use_gpu else "CPU, gloo"
    return "\n".join([
        f"ray-flowgrpo: FlowGRPO LoRA training of {model.family} {model.path}{tiny}",
        f"  run folder:  {run_dir}{' (resuming)' if resume else ''}",
        f"  cluster:     {cluster.address or 'local Ray cluster'}{f' ({nodes} nodes)' if nodes > 1 else ''}"
        + (f", dashboard http://{dashboard_url}" if dashboard_url else ""),
        f"  rollout:     {rollout.engine} engine x {rollout.num_replicas} replicas; groups of {rollout.group_size}, "
        f"{rollout.width}x{rollout.height}, {rollout.num_inference_steps} steps, noise level {rollout.noise_level:g}"
        + (f" on a {rollout.sde_window.placement} window of {rollout.sde_window.size} (the steps trained)"
           if rollout.sde_window.size else ""),
        f"  reward:      {rewards} ({config.reward.num_replicas} replicas"
        + (f", {config.reward.replica_num_gpus:g} GPU each: the models and the OCR networks run there)"
           if config.reward.replica_num_gpus else ")"),
        f"  training:    {cluster.num_workers} FSDP2 workers ({backend}); {train.num_steps} steps of "
        f"{train.groups_per_step} groups; LoRA rank {model.lora_rank}, lr {train.learning_rate:g}; a checkpoint "
        f"every {train.checkpoint_every or train.num_steps} steps; up to {train.max_failures} worker-group restarts",
        "  evaluation:  " + (f"{config.eval.prompts} every {config.eval.every or '-'} steps"
                             + (" and before the first" if config.eval.before_train else "")
                             + f", {(config.eval.width or rollout.width)}x{(config.eval.height or rollout.height)}, "
                               f"noise level {config.eval.noise_level:g}"
                             + (", sentinels against the base model" if config.eval.sentinels else "")
                             if config.eval.enabled else "off (eval.every=0)"),
        "  schedule:    " + ("on-policy (each step samples the adapter of the step before)" if not train.max_staleness
                             else f"pipelined: the next {train.max_staleness} step(s) generate while one trains, "
                                  f"groups at most {train.max_staleness} adapter version(s) old"),
    ])


def summarize(run_dir: Path, result, dashboard_url: str | None, family: str) -> None:
    from app.metrics import plot_reward_curve, read_history
    from app.models.family import get_family

    history = read_history(run_dir)
    lines = [f"run folder:    {run_dir}", f"tensorboard:   tensorboard --logdir {run_dir / 'tensorboard'}"]
    if history:
        curve = plot_reward_curve(history, run_dir / "reward_curve.png")
        first, last = history[0]["reward/mean"], history[-1]["reward/mean"]
        lines += [f"reward:        {first:+.4f} (step {history[0]['step']}) -> {last:+.4f} "
                  f"(step {history[-1]['step']})", f"reward curve:  {curve}"]
        started = [line for row in history if (line := startup_line(row))]
        if started:
            lines.append(started[-1])  # this launch's (a resumed run's history holds the earlier ones too)
    from app.eval.report import EvalLog

    evaluations = [e for e in EvalLog(run_dir / "eval").history() if "eval/reward/mean" in e]
    if evaluations:
        first, last = evaluations[0], evaluations[-1]
        ocr = (f", OCR accuracy {first['eval/ocr_accuracy']:.3f} -> {last['eval/ocr_accuracy']:.3f}"
               if "eval/ocr_accuracy" in last else "")
        lines += [f"eval reward:   {first['eval/reward/mean']:+.4f} (step {first['step']}) -> "
                  f"{last['eval/reward/mean']:+.4f} (step {last['step']}){ocr}",
                  f"eval curve:    {run_dir / 'eval_curve.png'} (grids, per-prompt results: {run_dir / 'eval'})"]
    grids = sorted((run_dir / "images").glob("step_*.png"))
    if grids:
        final = run_dir / "samples.png"
        shutil.copyfile(grids[-1], final)
        lines.append(f"image grid:    {final} (every logged step in {run_dir / 'images'})")
    if result is not None and result.checkpoint is not None:
        adapter = Path(result.checkpoint.path) / "adapter"
        lines += [f"checkpoint:    {result.checkpoint.path}",
                  f"LoRA adapter:  {adapter} ({get_family(family).adapter_format})"]
    if dashboard_url:
        lines.append(f"Ray dashboard: http://{dashboard_url} (Metrics: ray_flowgrpo_*)")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config, run_dir = checked_config(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    startup = {"launched": psutil.Process().create_time()}  # where the start goes (app/startup.py)
    context = start_ray(config)
    startup["ray_ready"] = time.time()
    import ray

    shortfall = resource_shortfall(config, ray.cluster_resources())
    if shortfall and config.cluster.address is None:  # the local cluster this job started cannot grow
        print(f"error: {shortfall}", file=sys.stderr)
        return 2
    if shortfall:  # an existing cluster may add nodes (an autoscaler): say so and go on
        print(f"warning: {shortfall} now; the run waits until it has them", file=sys.stderr, flush=True)
    if (packing := packing_warning(config)) is not None:
        print(f"warning: {packing}", file=sys.stderr, flush=True)
    nodes = sum(1 for node in ray.nodes() if node["Alive"])
    print(startup_summary(config, run_dir, getattr(context, "dashboard_url", None), resume=args.resume, nodes=nodes),
          flush=True)
    from ray import serve

    from deployments.builders import APP_NAME
    from deployments.client import ServingWatch

    watch = ServingWatch(APP_NAME, abort_training)
    result = None
    try:
        # the replicas and the training workers load at the same time; the first rollout request waits for both
        handles = deploy_serve_app(config, wait=False)
        startup["serve_registered"] = time.time()
        watch.start()
        wait_for_replica_gpus(config)
        result = fit(config, run_dir, *handles, startup=startup)
    except BaseException:  # Ray Train's abort, or the KeyboardInterrupt before `fit` listened for SIGINT
        if watch.failure is None:
            raise
    finally:
        watch.stop()
        if not args.keep_serving:
            serve.delete(APP_NAME)
    if watch.failure is not None:
        print(f"error: the rollout/reward application failed to deploy, so the run stopped before it trained: "
              f"{watch.failure}", file=sys.stderr, flush=True)
        return 1
    summarize(run_dir, result, getattr(context, "dashboard_url", None), config.model.family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
