"""Held-out evaluation during a training run (rank 0): the base model once before the first step (the sentinels'
reference, and the `eval.before_train` point), then the adapter every `eval.every` steps and after the last.

An evaluation goes through the run's own Serve application, pinned to the adapter version just published, while
the other workers go on; its seeds are its own (app/eval/evaluate.py), so the training groups, their seeds and the
trainer's random streams are the same with evaluation on or off. A group that fails after the client's retries
fails the evaluation, which is logged as failed; the run goes on.
"""

from __future__ import annotations

import sys
from pathlib import Path

from app.config import RunConfig
from app.eval.evaluate import Evaluation, eval_requests, evaluate
from app.eval.report import EvalLog, plot_eval_curve, sentinel_metrics
from app.prompt_sets import eval_prompts
from app.rollout.client import BlockingRolloutClient


def _say(line: str) -> None:
    print(f"[flowgrpo] {line}", file=sys.__stdout__, flush=True)  # the real stdout, as the progress line


def eval_due(config: RunConfig, step: int) -> bool:
    """Whether the adapter of step `step` (0-based, just trained and published) is evaluated."""
    every = config.eval.every
    return every > 0 and ((step + 1) % every == 0 or step + 1 == config.train.num_steps)


class RunEvaluator:
    def __init__(self, config: RunConfig, run_dir: Path, rollout: BlockingRolloutClient, writer=None):
        self.config, self.run_dir, self.rollout = config, run_dir, rollout
        self.prompts = eval_prompts(config)
        self.log = EvalLog(run_dir / "eval", grid_prompts=config.eval.grid_prompts, writer=writer)
        self.base = None  # uint8 [P, k, H, W, 3] ([P, k, F, H, W, 3]: videos): the base model's (sentinels on)

    def start(self, step: int) -> None:
        """While the replicas serve the base model (before a resumed adapter is published again): the base
        images, made or read back, and the step-0 evaluation when `eval.before_train` asks for one."""
        ev = self.config.eval
        if ev.sentinels:
            requests = eval_requests(self.config, self.prompts, 0)
            frames = () if requests[0].num_frames is None else (requests[0].num_frames,)  # a video family's
            shape = (ev.images_per_prompt, *frames, requests[0].height, requests[0].width, 3)
            self.base = self.log.load_base([str(p) for p in self.prompts], [r.seed for r in requests], shape)
        fresh = step == 0 and ev.before_train
        if not fresh and (self.base is not None or not ev.sentinels):
            return
        evaluation = self._run(0)
        if isinstance(evaluation, Evaluation) and ev.sentinels and self.base is None:
            self.base = evaluation.images
            self.log.save_base(evaluation)
            if not fresh:
                _say(f"base images for the sentinels: {len(self.prompts)} eval prompts ({evaluation.seconds:.1f} s)")
        if fresh:
            self._record(0, 0, evaluation)

    def after_step(self, step: int, version: int) -> None:
        """Evaluate adapter `version`, which the replicas serve, as the evaluation of step `step` (1-based)."""
        self._record(step, version, self._run(version))

    def _run(self, version: int) -> Evaluation | str:
        """The evaluation of adapter `version`, or why it failed (a failed evaluation must not end the run)."""
        try:
            return self.rollout.call(evaluate(self.rollout.client, self.config, self.prompts, version))
        except Exception as err:
            return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"

    def _record(self, step: int, version: int, evaluation: Evaluation | str) -> None:
        what = "the base model" if version == 0 else f"adapter version {version}"
        name = f"step_{step:06d}"
        if isinstance(evaluation, str):
            self.log.failed(name, step, version, evaluation)
            _say(f"warning: the evaluation of {what} at step {step} failed; the run goes on ({evaluation})")
            return
        extra, warnings = {}, []
        if self.base is not None:
            extra, warnings = sentinel_metrics(evaluation, self.base, self.config.eval.sentinel_bands)
        line = self.log.write(name, step, evaluation, extra)
        plot_eval_curve(self.log.history(), self.run_dir / "eval_curve.png")
        ocr = (f"  OCR accuracy {line['eval/ocr_accuracy']:.3f}  exact match {line['eval/ocr_exact_match']:.3f}"
               if "eval/ocr_accuracy" in line else "")
        _say(f"eval at step {step} ({what}): reward {line['eval/reward/mean']:+.4f}{ocr}  "
             f"{int(line['eval/images'])} images in {evaluation.seconds:.1f} s")
        for warning in warnings:
            _say(f"warning: step {step}: {warning}")
