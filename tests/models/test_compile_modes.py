"""torch.compile's modes with CUDA graphs (`model.compile.mode: reduce-overhead | max-autotune`;
app/models/compile.py): an engine's no-grad denoiser marks one step of the CUDA-graph trees per forward, at its
first block (every block runs one compiled function, so without the mark each block's call starts a new generation
and overwrites the outputs of the block before: the GPU's error of docs/perf/kernels/rollout_reduce-overhead_h200.err);
a trainer compiles the same mode without CUDA graphs."""

import pytest
import torch

from app.config import CompileConfig
from app.models import compile as compile_mod
from app.models.compile import apply_compile


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8, dtype=torch.float64) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x


class StackFamily:
    """The two methods of a model family that apply_compile reads."""

    def prepare_compile(self, settings):
        pass

    def compiled_blocks(self, module):
        return list(module.blocks)


@pytest.fixture
def marks(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append(1))
    monkeypatch.setattr(compile_mod, "use_cache_dir", lambda cache_dir: None)  # torch's own cache folder
    return calls


def test_an_engine_under_reduce_overhead_marks_one_step_per_forward_and_computes_the_same(marks):
    module, x = Stack(), torch.randn(4, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = module(x)
        assert apply_compile(module, StackFamily(), CompileConfig(enabled=True, mode="reduce-overhead"),
                             inference=True) == 3
        outputs = [module(x) for _ in range(2)]
    assert len(marks) == 2  # once per forward, not once per block
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("mode", "trainer_mode"), [("reduce-overhead", "default"),
                                                    ("max-autotune", "max-autotune-no-cudagraphs"),
                                                    ("default", "default")])
def test_a_trainer_compiles_the_mode_without_cuda_graphs_and_marks_no_step(monkeypatch, marks, mode, trainer_mode):
    compiled = {}
    monkeypatch.setattr(compile_mod, "compile_blocks", lambda blocks, **kw: compiled.update(kw) or len(blocks))
    module = Stack()
    assert apply_compile(module, StackFamily(), CompileConfig(enabled=True, mode=mode)) == 3
    assert compiled["mode"] == trainer_mode
    module(torch.randn(2, 8, dtype=torch.float64))
    assert marks == []
    engine = Stack()
    apply_compile(engine, StackFamily(), CompileConfig(enabled=True, mode=mode), inference=True)
    assert compiled["mode"] == mode
    engine(torch.randn(2, 8, dtype=torch.float64))
    assert len(marks) == (mode != "default")


class LoraBlock(torch.nn.Module):
    """A block as the trainer compiles it: submodules, a norm, a peft LoRA on a projection."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(8, dtype=torch.float64)
        self.attn = torch.nn.Module()
        self.attn.to_q = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x):
        return x + self.attn.to_q(self.norm(x))


def test_lean_guards_drop_the_blocks_bookkeeping_and_keep_the_adapters_switch(monkeypatch, world_of_one):
    """`model.compile.guards: lean` on dynamo's own guards of a compiled block (a real compilation), wrapped by
    FSDP2 as the trainer's blocks are (its guards then name every attribute of the module tree): guards on the
    block's tree that a trainer never changes go (hooks dicts, types, attributes' absence), and the block still
    computes what it computes eager with the adapter on and off: the adapter's switch, grad mode and the inputs
    keep their guards. (The rule before 2026-12-07 asked for a module's own source and dropped nothing here.)"""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer
    from torch.distributed.fsdp import fully_shard

    from app.models.compile import compile_blocks

    seen = []
    real = compile_mod.lean_guards
    monkeypatch.setattr(compile_mod, "lean_guards", lambda entries: seen.append(list(entries)) or real(entries))
    block = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"], init_lora_weights=False),
                                    LoraBlock())
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)

    def switch(on: bool):
        for module in block.modules():
            if isinstance(module, LoraLayer):
                module.enable_adapters(on)

    expected_on, expected_off = block(x), (switch(False), block(x))[1]
    switch(True)
    fully_shard(block, ignored_params={p for p in block.parameters() if not p.requires_grad})  # the LoRA's alone
    torch._dynamo.reset()  # graphs of `_forward` made by other tests' blocks
    compile_blocks([block], backend="eager", guards="lean")
    on = block(x)
    switch(False)
    with torch.no_grad():
        off = block(x)
    switch(True)
    assert torch.equal(on, expected_on) and torch.equal(off, expected_off)
    assert not torch.equal(on, off)
    assert len(seen) == 2  # one compilation each: adapter on with gradients, off without
    entries = [e for compilation in seen for e in compilation]
    kept = real(entries)
    dropped = [e for e, k in zip(entries, kept, strict=True) if not k]
    assert len(dropped) > len(entries) // 4
    assert all(e.name.startswith(("block", "type(block", "dict(type(block")) for e in dropped)
    assert any(e.guard_type == "EMPTY_NN_MODULE_HOOKS_DICT" for e in dropped)
    switches = [k for e, k in zip(entries, kept, strict=True) if "_disable_adapters" in e.name]
    assert switches and all(switches)
    assert all(k for e, k in zip(entries, kept, strict=True) if e.guard_type in ("TENSOR_MATCH", "GRAD_MODE"))


def test_guards_take_full_lean_or_skip_and_the_engines_keep_full(monkeypatch, marks):
    from app.models.compile import compile_blocks

    with pytest.raises(ValueError, match="guards='none': full, lean or skip"):
        compile_blocks([], guards="none")
    asked = []
    monkeypatch.setattr(compile_mod, "compile_blocks", lambda blocks, **kw: asked.append(kw["guards"]) or 0)
    for guards in ("lean", "skip"):
        for inference in (False, True):
            apply_compile(Stack(), StackFamily(), CompileConfig(enabled=True, guards=guards), inference=inference)
    assert asked == ["lean", "full", "skip", "full"]  # the trainer's blocks as configured, an engine's full


def test_guard_evaluation_is_skipped_only_for_guards_skip(monkeypatch):
    """After a trainer's first step: torch's stance changes for `guards: skip` alone (compiled), never otherwise."""
    from app.models.compile import skip_guard_evaluation

    stances = []
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **kw: stances.append((a, kw)))
    for settings in (None, CompileConfig(enabled=False, guards="skip"), CompileConfig(enabled=True, guards="full"),
                     CompileConfig(enabled=True, guards="lean")):
        assert not skip_guard_evaluation(settings)
    assert stances == []
    assert skip_guard_evaluation(CompileConfig(enabled=True, guards="skip"))
    assert stances == [(("default",), {"skip_guard_eval_unsafe": True})]


def test_compiled_blocks_bring_their_settings_to_every_thread(marks):
    """Since torch 2.13 a config value set in one thread is not seen in another, and an engine compiles in its
    loading thread but samples in others: the blocks apply dynamo's raised limit, floats as constants and the
    trainer's activation budget in whichever thread calls them, before dynamo reads them."""
    import threading

    import torch._dynamo
    import torch._functorch.config

    module, x = Stack(), torch.randn(4, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = module(x)
    assert apply_compile(module, StackFamily(), CompileConfig(enabled=True), activation_memory_budget=0.5) == 3
    seen = {}

    def call():
        seen["before"] = torch._dynamo.config.recompile_limit  # a new thread starts from torch's defaults
        with torch.no_grad():
            seen["out"] = module(x)
        seen["after"] = (torch._dynamo.config.recompile_limit, torch._dynamo.config.specialize_float,
                         torch._functorch.config.activation_memory_budget)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert seen["before"] == 8
    assert seen["after"] == (compile_mod.RECOMPILE_LIMIT, True, 0.5)
    torch.testing.assert_close(seen["out"], expected, rtol=1e-12, atol=1e-12)
