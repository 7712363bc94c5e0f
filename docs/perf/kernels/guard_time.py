"""What dynamo's guards cost the trainer's host per call of a compiled block, `model.compile.guards` full, lean and
skip, measured where the trainer calls the blocks (issue 54: 0.13 s of a micro-step's 0.32 s GPU wait was guard
checks on the real-size Qwen-Image, one H200).

    python docs/perf/kernels/guard_time.py [--config configs/tiny_cpu.yaml] [--passes 3] [key=value ...]

A block's guards depend on its module tree (submodules, parameters, the adapter's switches), not on its width, so the
tiny Qwen-Image's blocks carry the real one's guards. One process per setting: the policy compiles with the setting's
guard filter, trains one pass (every graph made: the adapter on and off, with and without gradients), then, in a
pre-hook on every compiled block at every call of the following passes (the adapter's state, grad mode and inputs as
dynamo is about to see them), checks the cached graphs as dynamo does: in order, each one's whole guard set until one
passes (`full`, `lean`), or only the guards that tell them apart (`skip`: torch's skip_guard_eval_unsafe, what
`skip_guard_evaluation` switches on after a run's first step). Prints one JSON line a setting: the microseconds a
call, the guards a graph holds, and whether the differentiating guards picked the graph the whole set picks at every
call (`same_graph`: where they would not, `skip` would run the wrong graph).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

REPEATS = 20  # checks timed per call (pure functions of the call's state)


def count(manager) -> int:
    """Leaf guards under a guard manager (None: no guards)."""
    if manager is None:
        return 0
    return len(manager.get_leaf_guards()) + sum(count(child) for child in manager.get_child_managers())


def measure(config_path: str, guards: str, passes: int, overrides: list[str]) -> dict:
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from app.config import load
    from app.metrics import Stats
    from app.models import compile as compile_mod
    from app.train.policy import Policy
    from app.train.update import make_optimizer, train_pass
    from jobs.bench_train_step import synthetic_group
    from jobs.world import init_world

    torch.set_num_threads(1)
    init_world()  # a world of one: FSDP2 wraps the LoRA as a Ray Train worker's does
    config = load(config_path, ["model.compile.enabled=true", f"model.compile.guards={guards}",
                                "train.old_logprob=trainer", "train.kl_beta=0.04",
                                "train.gradient_checkpointing=true", *overrides])
    model, train = config.model, config.train
    policy = Policy.from_pretrained(model.path, lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
                                    target_modules=model.lora_targets, family=str(model.family), shard=True,
                                    gradient_checkpointing=train.gradient_checkpointing, compile=model.compile)
    optimizer = make_optimizer(policy, train)
    optimizer.step = lambda: None  # the same weights in every pass
    group = synthetic_group(config, policy.family, policy.transformer.config, 0, train.seed)
    advantages = torch.randn(group.group_size, generator=torch.Generator().manual_seed(0))

    def one_pass() -> None:
        train_pass(policy, optimizer, train, step=0, epoch=0, trajectories=[group], advantages=[advantages],
                   old=[group.log_probs], stats=Stats(), mismatch=Stats())

    one_pass()  # the first step: every graph made
    code = (compile_mod._checkpointed_forward if train.gradient_checkpointing else compile_mod._forward).__code__
    entries = _debug_get_cache_entry_list(code)
    full_us, diff_us, same = [], [], []

    def first_passing(managers, f_locals) -> int:
        return next((i for i, m in enumerate(managers) if m is None or m.check(f_locals)), -1)

    def timed(managers, f_locals) -> tuple[int, float]:
        began = time.perf_counter()
        for _ in range(REPEATS):
            index = first_passing(managers, f_locals)
        return index, (time.perf_counter() - began) / REPEATS * 1e6

    def check_guards(block, args, kwargs):
        f_locals = {"block": block, "args": args, "kwargs": kwargs}
        whole, whole_s = timed([e.guard_manager for e in entries], f_locals)
        diff, diff_s = timed([e.guard_manager.diff_guard_root for e in entries], f_locals)
        full_us.append(whole_s)
        diff_us.append(diff_s)
        same.append(whole == diff and whole >= 0)

    blocks = list(policy.family.compiled_blocks(policy.transformer))
    handles = [b.register_forward_pre_hook(check_guards, with_kwargs=True) for b in blocks]
    for _ in range(passes):
        one_pass()
    for h in handles:
        h.remove()
    if guards == "skip":
        full_us = diff_us  # what dynamo checks once the stance is on
    return {"guards": guards, "graphs": len(entries), "blocks": len(blocks), "calls_per_pass": len(full_us) // passes,
            "guards_per_graph": [count(e.guard_manager.root) for e in entries],
            "differentiating_guards_per_graph": [count(e.guard_manager.diff_guard_root) for e in entries],
            "check_us_per_call_median": round(statistics.median(full_us), 1),
            "check_us_per_call_mean": round(statistics.fmean(full_us), 1),
            "same_graph": all(same)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny_cpu.yaml")
    parser.add_argument("--passes", type=int, default=3, help="trained passes whose block calls are measured")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: this setting only
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    if args.one:
        print(json.dumps(measure(args.config, args.one, args.passes, args.overrides)))
        return 0
    for guards in ("full", "lean", "skip"):  # one process each: dynamo keeps graphs on the function's code
        out = subprocess.run([sys.executable, __file__, "--config", args.config, "--passes", str(args.passes),
                              "--one", guards, *args.overrides], capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
