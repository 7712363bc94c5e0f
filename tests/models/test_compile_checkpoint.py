"""Gradient checkpointing inside a compiled block (app/models/compile.py): attention's outputs are kept for the
backward rather than recomputed. Torch tags attention's kernels random; recomputed, they had their random state
saved and replayed, which on a GPU made inductor bypass its cache for every trained graph, and which torch 2.13
refuses outright for a checkpointed block with nothing to train."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from app.models import compile as compile_mod
from app.models.compile import _ATTENTION_OPS, _attention_packets, _checkpointed_forward, compile_blocks


class Block(torch.nn.Module):
    def __init__(self, trainable: bool = True):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)
        self.requires_grad_(trainable)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class CountAttention(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket in _attention_packets()
        return func(*args, **(kwargs or {}))


def test_every_attention_kernel_named_is_one_torch_has():
    assert len(_attention_packets()) == len(_ATTENTION_OPS)


def test_a_checkpointed_block_runs_attention_once_and_its_gradients_are_unchanged():
    torch.manual_seed(0)
    block = Block().double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)

    def grads(forward):
        block.zero_grad()
        x.grad = None
        with CountAttention() as counter:
            forward(block, x).square().sum().backward()
        return counter.calls, [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]

    plain_calls, plain = grads(lambda b, t: b(t))
    kept_calls, kept = grads(_checkpointed_forward)
    assert plain_calls == kept_calls == 1  # a plain checkpoint would run it again in the backward
    for a, b in zip(plain, kept, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow  # inductor compiles the block (a forward and a backward graph)
def test_a_compiled_checkpointed_block_with_nothing_to_train_runs(tmp_path, monkeypatch):
    """A block none of whose weights train (an adapter only outside the blocks) under gradients: torch 2.13 refused
    a recomputed attention there (random ops in a recompute region of an inference graph)."""
    for name in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_CACHE_DIR",
                 "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)  # the process's cache settings come back after the test
    compile_mod.use_cache_dir(tmp_path / "cache")  # a cache of its own: nothing compiled elsewhere is reused
    torch.manual_seed(0)
    blocks = [Block(trainable=False), Block(trainable=False)]
    assert compile_blocks(blocks, checkpoint=True) == 2
    head = torch.nn.Linear(16, 1)
    x = torch.randn(2, 5, 16)
    out = head(blocks[1](blocks[0](x))).sum()
    out.backward()
    assert head.weight.grad is not None
    with torch.no_grad():
        expected = head(Block.forward(blocks[1], Block.forward(blocks[0], x))).sum()
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)
