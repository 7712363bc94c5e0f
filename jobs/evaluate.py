"""Evaluate the base model and saved LoRA adapters on a held-out eval set, side by side.

    python -m jobs.evaluate --config configs/tiny_cpu.yaml [--adapter DIR ...] [--out DIR] [key=value ...]
    ray job submit --working-dir . -- python -m jobs.evaluate --config CFG --adapter /abs/run/checkpoints/... ...

An adapter is one of our checkpoints (or its `adapter/` folder), or any peft / diffusers LoRA folder of the config's
model family. The config's `eval:` section says what is evaluated (set, images per prompt, sampling, size) and its
model/rollout/reward sections what serves it: the same Serve application a training run deploys, here as its own
application on a local cluster or RAY_ADDRESS. The base model is always evaluated first (adapter off): the
sentinels compare every adapter's images with its images of the same prompts and seeds. With the same config, an
adapter's figures equal those of the training run's evaluation of that step.

Prints one table (per reward term, OCR accuracy and exact match, sentinels), and writes it as JSON with every
image's result (JSON lines) and a labelled grid per column into --out (default: <logging.dir>/evaluations/<time>).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from app.config import ConfigError, RunConfig, load

APP_NAME = "flowgrpo-eval"  # its own application: a training run's on the same cluster goes on untouched
# rows of the table: (metric, label); the eval/reward/<term> rows are added per reward term
ROWS = [("eval/reward/mean", "reward (total)"), ("eval/ocr_accuracy", "OCR accuracy"),
        ("eval/ocr_exact_match", "OCR exact match"), ("sentinel/colour_entropy", "colour entropy (bits)"),
        ("sentinel/colour_entropy_change", "  change vs base"), ("sentinel/edge_energy", "edge energy"),
        ("sentinel/edge_energy_change", "  change vs base"), ("sentinel/brightness", "brightness"),
        ("sentinel/dark_fraction", "dark fraction"), ("sentinel/distance_to_base", "distance to base"),
        ("sentinel/out_of_band", "sentinels out of band")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run config YAML (its eval: section)")
    parser.add_argument("--adapter", action="append", default=[], metavar="DIR",
                        help="a checkpoint folder, its adapter/ folder, or a peft/diffusers LoRA folder (repeatable)")
    parser.add_argument("--out", help="where the table, per-image results and grids go "
                                      "(default: <logging.dir>/evaluations/<time>)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.prompts=ocr_eval")
    return parser.parse_intermixed_args(argv)


def column_names(adapters: list[str]) -> list[str]:
    """"base", then a name per adapter: its checkpoint's (or folder's) name, made unique."""
    names = ["base"]
    for path in adapters:
        p = Path(path).expanduser().resolve()
        name = p.parent.name if p.name == "adapter" else p.stem if p.is_file() else p.name
        candidate, k = name, 2
        while candidate in names:
            candidate, k = f"{name}#{k}", k + 1
        names.append(candidate)
    return names


def checked(args: argparse.Namespace):
    """(config, eval prompts, adapters) or a ConfigError saying what to change. Starts nothing."""
    from app.models.family import get_family
    from app.models.lora import adapter_problem, read_adapter
    from app.prompt_sets import load_prompts
    from jobs.train import check_eval_set, check_model_path

    config = load(args.config, args.overrides)
    check_model_path(config)
    family = get_family(config.model.family)
    try:
        training = load_prompts(config.data.prompts)
    except ValueError:
        training = None  # no training set to compare with: no overlap check
    prompts = check_eval_set(config, training)
    adapters = []
    for version, path in enumerate(args.adapter, start=1):
        try:
            adapter = read_adapter(path, version=version)
        except ValueError as err:
            raise ConfigError(f"--adapter {path}: {err}") from None
        if problem := adapter_problem(adapter, family=family, rank=config.model.lora_rank,
                                      targets=config.model.lora_targets):
            raise ConfigError(f"--adapter {path} {problem}")
        adapters.append(adapter)
    return config, prompts, adapters


async def evaluate_all(config: RunConfig, prompts: list, adapters: list, handles) -> list:
    """The evaluation of the base model, then of each adapter (published in turn: every replica serves it)."""
    import torch
    from tqdm import tqdm

    from app.eval.evaluate import evaluate
    from app.rollout.client import RolloutClient

    client = RolloutClient(*handles, retries=config.rollout.request_retries,
                           publish_dtype=getattr(torch, config.model.dtype))
    results = []
    for adapter in [None, *adapters]:
        await client.publish(adapter)
        version = adapter.version if adapter is not None else 0
        with tqdm(total=len(prompts), desc="base model" if adapter is None else f"adapter {version}", unit="prompt",
                  disable=False, file=sys.stderr, dynamic_ncols=True) as bar:
            results.append(await evaluate(client, config, prompts, version, on_group=bar.update))
    await client.publish(None)
    return results


def table(names: list[str], lines: list[dict]) -> str:
    terms = sorted({k for line in lines for k in line if k.startswith("eval/reward/")} - {"eval/reward/mean",
                                                                                          "eval/reward/std"})
    rows = [ROWS[0], *[(t, f"  {t.removeprefix('eval/reward/')}") for t in terms], *ROWS[1:]]
    rows = [(key, label) for key, label in rows if any(key in line for line in lines)]
    width = max(12, *(len(n) + 2 for n in names))
    out = ["".ljust(24) + "".join(n.rjust(width) for n in names)]
    for key, label in rows:
        out.append(label.ljust(24) + "".join((f"{line[key]:+.4f}" if key in line else "-").rjust(width)
                                             for line in lines))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config, prompts, adapters = checked(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or Path(config.logging.dir) / "evaluations" / time.strftime("%Y%m%d-%H%M%S")).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    names = column_names(args.adapter)
    from ray import serve

    from app.eval.report import EvalLog, sentinel_metrics
    from jobs.train import deploy_serve_app, start_ray

    context = start_ray(config)
    ev = config.eval
    print(f"ray-flowgrpo: evaluating {len(names)} column(s) ({', '.join(names)}) of {config.model.family} "
          f"{config.model.path} ({config.rollout.engine} engine) on {ev.prompts} ({len(prompts)} prompts x "
          f"{ev.images_per_prompt} images, noise level "
          f"{ev.noise_level:g})" + (f"; Ray dashboard http://{context.dashboard_url}"
                                     if getattr(context, "dashboard_url", None) else ""), flush=True)
    try:
        evaluations = asyncio.run(evaluate_all(config, prompts, adapters, deploy_serve_app(config, APP_NAME)))
    except Exception as err:  # a group failed after its retries (replicas lost, an engine error): say which
        print(f"error: the evaluation failed: {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}",
              file=sys.stderr)
        return 1
    finally:
        serve.delete(APP_NAME)
    log, base, lines = EvalLog(out, grid_prompts=ev.grid_prompts), evaluations[0], []
    for name, path, evaluation in zip(names, [None, *args.adapter], evaluations, strict=True):
        extra, warnings = sentinel_metrics(evaluation, base.images, ev.sentinel_bands) if ev.sentinels else ({}, [])
        lines.append({**log.write(name, None, evaluation, extra),
                      "adapter": str(Path(path).expanduser().resolve()) if path else None})
        for warning in warnings:
            print(f"warning: {name}: {warning}", flush=True)
    report = out / "evaluation.json"
    report.write_text(json.dumps({"config": str(Path(args.config).resolve()), "overrides": args.overrides,
                                  "eval": {k: getattr(ev, k) for k in ev.__dataclass_fields__},
                                  "evaluations": lines}, indent=1))
    print(table(names, lines), flush=True)
    print(f"table:         {report}\nper image:     {out}/<column>.jsonl\ngrids:         {out}/grid_<column>.png",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
