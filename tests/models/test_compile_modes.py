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


def test_lean_guards_keep_the_adapters_switches_tensors_and_grad_mode_and_drop_module_bookkeeping():
    """`model.compile.guards: lean` (the trainer's blocks): dynamo's guards on module attributes a trainer never
    changes go, every guard that can tell two calls of a block apart in a run stays."""
    from types import SimpleNamespace

    from app.models.compile import lean_guards

    def entry(kind, name, module=True):
        source = SimpleNamespace(is_unspecialized_nn_module=lambda: module)
        return SimpleNamespace(guard_type=kind, name=name, orig_guard=SimpleNamespace(source=source))

    block = "self._modules['attn']._modules['to_q']"
    entries = [entry("CONSTANT_MATCH", f"{block}._disable_adapters"),  # the reference forward turns it
               entry("CONSTANT_MATCH", f"{block}.merged_adapters"),
               entry("CONSTANT_MATCH", "self.training"),
               entry("TENSOR_MATCH", f"{block}._parameters['weight']"),
               entry("ID_MATCH", f"{block}._modules['lora_A']"),
               entry("GRAD_MODE", "", module=False),
               entry("TENSOR_MATCH", "L['hidden_states']", module=False),
               entry("CONSTANT_MATCH", "L['attention_kwargs']", module=False),
               entry("EMPTY_NN_MODULE_HOOKS_DICT", f"{block}._forward_hooks"),
               entry("NOT_PRESENT_IN_GENERIC_DICT", f"{block}.__dict__"),
               entry("TYPE_MATCH", f"{block}"),
               entry("CONSTANT_MATCH", "self._modules['attn'].heads")]
    assert lean_guards(entries) == [True] * 8 + [False] * 4


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
