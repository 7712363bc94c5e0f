"""Regional torch.compile: each repeated block of a family's denoiser (`ModelFamily.compiled_blocks`) compiled on
its own, in the trainer and in the in-process rollout engines.

- The block's `forward` is compiled, not its `__call__`: module hooks stay eager, so FSDP2's all-gather and
  reshard run around the compiled region.
- Identical blocks share one compiled graph (dynamo caches per code object and treats parameters as inputs), so a
  60-block transformer compiles each variant once: with and without gradients, adapter on and off, a first block
  whose input needs no gradient and the later ones whose input does.
- Gradient checkpointing of a compiled block happens inside the compiled region (`checkpoint=True`): the block's
  forward is wrapped in `torch.utils.checkpoint` and compiled with it, so compile's partitioner recomputes the
  block in the backward graph it built, all but attention's outputs, which are kept (`_keep_attention`).
  Checkpointing around a compiled block instead (diffusers' own) dispatches
  the recomputation through dynamo a second time, and on a GPU under FSDP2 it was seen to pick a graph that saves
  other tensors than the forward did (torch.utils.checkpoint's CheckpointError).
- Shapes are dynamic from the start: prompts have different lengths, and a graph specialised to the first length
  would be compiled again for the second. The variants above are more than dynamo's default limit of 8 per
  function; past it a call runs eager, and a checkpointed block whose forward ran compiled but whose recompute ran
  eager (or the reverse) saves tensors of another layout: the limit is raised.
- Dynamo's settings for the blocks (the raised limit, floats as constants, the trainer's activation budget) are
  applied in whichever thread calls them, at its first call (`_settings_here`): since torch 2.13 a config value
  set in one thread or context is not seen in another, and an engine compiles in its loading thread but samples in
  others (`asyncio.to_thread`), where the limit was dynamo's 8 again and floats were traced as symbols.
- Inductor's caches (FX graphs, autograd graphs, kernels) live in one folder that every process of a run shares
  (`use_cache_dir`), so that a restarted worker, a replacement replica or a resumed run start warm.

A compiled forward with gradients is not bit-equal to a compiled forward without them on a GPU (inductor fuses
the two graphs differently), which is why `train.old_logprob: trainer` exists: see app/train/update.py.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

# inductor's own cache folder as this process began (TORCHINDUCTOR_CACHE_DIR or torch's default): the base when a
# run names none; once set, torch keeps its choice in the environment
_DEFAULT_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def cache_dir_for(cache_dir: str | os.PathLike | None, kernels: Iterable[str]) -> Path:
    """The folder whose caches a process allowing only attention `kernels` uses: `cache_dir` (None: inductor's
    default) when it allows every kernel, else its subfolder `attention-<kernels>`. The caches' keys do not say
    which attention kernels were allowed: torch picks one while it traces, and a cached graph keeps that one (on a
    GPU, a process allowing every kernel loaded the graphs of one allowing only flash, and ran FA2 instead of
    cuDNN's kernel, about 45 % more attention time)."""
    from app.models.attention import SDPA_KERNELS

    if cache_dir is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        cache_dir = _DEFAULT_CACHE_DIR or default_cache_dir()
        if Path(cache_dir).name.startswith("attention-"):  # inherited from a parent process that chose kernels
            cache_dir = Path(cache_dir).parent
    root = Path(cache_dir).expanduser().resolve()
    kernels = list(kernels)
    return root if kernels == list(SDPA_KERNELS) else root / f"attention-{'-'.join(kernels)}"


def use_cache_dir(cache_dir: str | os.PathLike | None) -> None:
    """Point this process's inductor (and Triton) caches at `cache_dir` (None: torch's default) and turn on the
    persistent FX-graph and autograd caches. Every process of a run calls it with the run's `model.compile`
    section (trainer workers, rollout replicas), before its first compilation and after it chose its attention
    kernels (`cache_dir_for`: a process allowing only some has a subfolder of its own)."""
    from app.models.attention import sdpa_kernels

    root = cache_dir_for(cache_dir, sdpa_kernels())
    root.mkdir(parents=True, exist_ok=True)
    env = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(root)}
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = str(root / "triton")
    os.environ.update(env)


RECOMPILE_LIMIT = 64  # compiled variants of one block's forward (dynamo's default: 8)


# the settings this context has applied (each thread, each copy of a context, starts without)
_APPLIED: ContextVar[tuple | None] = ContextVar("flowgrpo_compile_settings", default=None)


def _settings_here(settings: tuple) -> None:
    """Apply `settings` ((config module, name, value), ...) in the calling thread's context unless it has them."""
    if _APPLIED.get() is not settings:
        for config, name, value in settings:
            setattr(config, name, value)
        _APPLIED.set(settings)


def dynamo_settings(activation_memory_budget: float | None = None) -> tuple:
    """What compiled blocks need of dynamo (and of the partitioner: the trainer's activation budget)."""
    import torch._dynamo
    import torch._functorch.config

    settings = [(torch._dynamo.config, "recompile_limit", RECOMPILE_LIMIT),
                # a block's float attributes (a norm's eps) as constants: traced as symbols under dynamic=True, they
                # fail a later pass that then restarts the whole analysis, so every first compilation ran twice
                (torch._dynamo.config, "specialize_float", True)]
    if activation_memory_budget is not None:  # read when a block compiles, at its first call
        settings.append((torch._functorch.config, "activation_memory_budget", float(activation_memory_budget)))
    return tuple(settings)


def _forward(block, *args, **kwargs):
    """A block's own forward (its class's: an FSDP2-wrapped block's hooks stay outside)."""
    return type(block).forward(block, *args, **kwargs)


# Attention's kernels, kept from a checkpointed block's forward for its backward instead of recomputed. Torch tags
# them random (they can apply dropout): recomputed, they had their random state saved and replayed, and on a GPU
# that wrapping made inductor bypass its FX-graph cache for every trained graph (a carried cache missed them all).
# Saving them also spares the backward the attention forward, for one output per block.
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_flash_attention_forward", "_efficient_attention_forward", "_cudnn_attention_forward")


def _keep_attention(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: save attention's outputs, recompute the rest of the block."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = getattr(op, "_overloadpacket", None) in _attention_packets()
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _attention_packets() -> frozenset:
    import torch

    return frozenset(getattr(torch.ops.aten, name) for name in _ATTENTION_OPS if hasattr(torch.ops.aten, name))


def _checkpoint_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_attention)


# what AOTAutograd's cache keys the policy by (it bypasses the cache for a policy without one): change it with
# the policy
_checkpoint_contexts.cache_hash = "keep-attention:" + ",".join(_ATTENTION_OPS)


def _checkpointed_forward(block, *args, **kwargs):
    """A block's forward, recomputed in the backward pass when gradients are on (attention's outputs kept)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    if torch.is_grad_enabled():
        return checkpoint(_forward, block, *args, use_reentrant=False, context_fn=_checkpoint_contexts, **kwargs)
    return _forward(block, *args, **kwargs)


# `model.compile.guards: lean`: the guards dynamo drops on a trainer's blocks, where they guard the block's module
# tree (dynamo names it after `_forward`'s argument: `block._modules['attn']...`, `type(block)`), which the trainer
# never changes after its first step (its hooks dicts, an attribute's absence, types, closures, constants such as
# head counts). Kept: every guard on the adapter's switches (peft's `_disable_adapters`, `merged_adapters`, the
# active adapter: the reference forward runs the adapter off), on train/eval mode, tensors (parameters too), grad
# mode, shapes, the call's arguments and globals. (Until 2026-12-07 the rule asked for an nn module's own source,
# which a module passed as an argument never has: lean dropped nothing.)
LEAN_DROPPED_GUARDS = frozenset({"EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "TYPE_MATCH",
                                 "DICT_KEYS_MATCH", "DICT_NOT_CONTAINS", "CLOSURE_MATCH", "SEQUENCE_LENGTH",
                                 "CONSTANT_MATCH", "EQUALS_MATCH"})
LEAN_KEPT_NAMES = ("adapter", "merged", "training", "scaling", "use_dora")
_ON_THE_BLOCK = re.compile(r"(?<![\w'\".])block(?![\w'\"])")  # the argument `block`, not a key such as ['block']


def lean_guards(entries) -> list[bool]:
    """dynamo's `guard_filter_fn` for `guards: lean`: which of a compiled block's guards to keep."""
    return [entry.guard_type not in LEAN_DROPPED_GUARDS or not _ON_THE_BLOCK.search(entry.name)
            or any(name in entry.name for name in LEAN_KEPT_NAMES) for entry in entries]


def compile_blocks(blocks: Iterable[Any], *, backend: str = "inductor", mode: str | None = None,
                   checkpoint: bool = False, guards: str = "full",
                   activation_memory_budget: float | None = None) -> int:
    """Compile each block's forward in place (lazily: the first call compiles), with gradient checkpointing inside
    the compiled region when `checkpoint`; returns how many blocks. Every block runs one compiled function (the
    block is its argument), so identical blocks share its graphs. guards: `full` (dynamo's), `lean`
    (`lean_guards`: fewer checked on every call of every block) or `skip` (lean until `skip_guard_evaluation`).
    activation_memory_budget: the share of activations the partitioner keeps for the backward (None: torch's)."""
    import types

    import torch

    settings = dynamo_settings(activation_memory_budget)  # applied by each call (`run`), before dynamo reads them
    mode = None if mode in (None, "default") else str(mode)
    if guards not in ("full", "lean", "skip"):
        raise ValueError(f"guards={guards!r}: full, lean or skip")
    options = {"guard_filter_fn": lean_guards} if guards in ("lean", "skip") else None
    compiled = torch.compile(_checkpointed_forward if checkpoint else _forward, backend=str(backend), mode=mode,
                             dynamic=True, options=options)

    def run(block, *args, **kwargs):
        _settings_here(settings)  # in the calling thread: a block compiles at its first call
        return compiled(block, *args, **kwargs)

    count = 0
    for block in blocks:
        if getattr(block, "_flowgrpo_compiled", False):
            continue
        block.forward = types.MethodType(run, block)
        block._flowgrpo_compiled = True
        count += 1
    return count


def skip_guard_evaluation(settings: Any) -> bool:
    """`model.compile.guards: skip`, once a trainer's first step has made every graph its blocks need: from now on
    this process checks only the guards that tell a block's graphs apart (torch's `skip_guard_eval_unsafe`: the
    adapter on or off, grad mode), not each graph's whole set at every call of every block. Returns whether it
    did. Every later step calls the blocks as the first did (the same shapes, switches and grad modes); were one
    to need another graph, it would run a graph made for other inputs without a word: the first pass's
    |ratio - 1| (exactly 0 while the graphs are right) is the check that stays."""
    if settings is None or not settings.enabled or str(settings.guards) != "skip":
        return False
    import torch

    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    return True


# the modes whose graphs torch replays as CUDA graphs, and each one's graphs without them
CUDA_GRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def trainer_mode(mode: Any) -> str:
    """The mode a trainer compiles for `model.compile.mode`: the same without CUDA graphs (see apply_compile)."""
    return CUDA_GRAPH_MODES.get(str(mode), str(mode))


def _new_cuda_graph_step(block, args) -> None:
    """One forward of the denoiser (from its first block on) is one step of torch's CUDA-graph trees. Every block
    runs one compiled function, and each call of it would otherwise start a new generation, whose replay
    overwrites the outputs of the block before while the forward still holds them."""
    import torch

    torch.compiler.cudagraph_mark_step_begin()


def apply_compile(module: Any, family: Any, settings: Any, *, inference: bool = False,
                  activation_memory_budget: float | None = None) -> int:
    """Compile `module`'s blocks as the family names them, with a `model.compile` section's settings (nothing
    when it is off); returns how many blocks were compiled. A module with gradient checkpointing on (diffusers'
    `enable_gradient_checkpointing`) has it moved inside the compiled blocks.

    CUDA graphs (`reduce-overhead`, `max-autotune`) serve `inference` modules, the engines' no-grad denoisers: the
    first block's call marks a step of the graph trees. A trainer compiles the same mode without them: its
    forwards keep tensors for a backward across other forwards (CFG's two branches, the KL's reference), which a
    new step would overwrite."""
    if settings is None or not settings.enabled:
        return 0
    use_cache_dir(settings.cache_dir)
    family.prepare_compile(settings)
    blocks = list(family.compiled_blocks(module))
    mode = str(settings.mode)
    if not inference:
        mode = trainer_mode(mode)
    elif mode in CUDA_GRAPH_MODES and blocks and not getattr(blocks[0], "_flowgrpo_compiled", False):
        blocks[0].register_forward_pre_hook(_new_cuda_graph_step)
    checkpoint = bool(getattr(module, "gradient_checkpointing", False))
    if checkpoint:
        module.gradient_checkpointing = False  # the compiled blocks checkpoint themselves
    guards = "full" if inference else str(settings.guards)  # the engines keep dynamo's own
    return compile_blocks(blocks, backend=settings.backend, mode=mode, checkpoint=checkpoint, guards=guards,
                          activation_memory_budget=activation_memory_budget)


def compile_counts() -> dict[str, int]:
    """This process's dynamo counters: frames compiled (`frames`: every compilation, recompiles included) and
    distinct graphs. Steady state means neither grows."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["ok"]), "graphs": int(counters["stats"]["unique_graphs"])}


def cache_counts() -> dict[str, int]:
    """This process's hits and misses of the shared cache: inductor's FX graphs (`fx_hits`, `fx_misses`) and
    AOTAutograd's forward/backward pairs (`aot_hits`, `aot_misses`), and the graphs they could not hold
    (`fx_bypasses`, `aot_bypasses`). A warm start shows hits and no misses; what a
    hit saves is code generation, not dynamo's tracing."""
    from torch._dynamo.utils import counters

    return {"fx_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fx_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
            "aot_hits": int(counters["aot_autograd"]["autograd_cache_hit"]),
            "aot_misses": int(counters["aot_autograd"]["autograd_cache_miss"]),
            # graphs the caches could not hold (inductor or AOTAutograd said why in its log): a later start misses them
            "fx_bypasses": int(counters["inductor"]["fxgraph_cache_bypass"]),
            "aot_bypasses": int(counters["aot_autograd"]["autograd_cache_bypass"])}


def compile_seconds(top: int = 8) -> dict[str, float]:
    """Where this process's compilation time went: dynamo's own phase timers (seconds summed over every
    compilation), the `top` largest. `_compile.compile_inner` is the whole of dynamo's part, inductor's code
    generation is `GraphLowering.compile_to_module`, waiting for kernels to build is `async_compile.wait`."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {name: round(sum(times), 1) for name, times in compilation_time_metrics.items()}
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:top])
