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
