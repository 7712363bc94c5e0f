"""`model.attention_kernels` (app/models/attention.py): the kernels torch's attention may choose among, set in each
process that runs the denoiser; an engine and a policy given a choice sample and score as with torch's (fp32, to
the kernels' rounding)."""

import os

import pytest
import torch

from app.models.attention import SDPA_KERNELS, sdpa_kernels, use_sdpa_kernels
from app.rollout.diffusers_engine import DiffusersEngine
from app.types import GenerationRequest


@pytest.fixture(autouse=True)
def torchs_own_choice():
    """Each test starts and ends with every kernel allowed (process-wide flags)."""
    use_sdpa_kernels(SDPA_KERNELS)
    yield
    use_sdpa_kernels(SDPA_KERNELS)


def test_only_the_named_kernels_are_allowed_and_none_leaves_them():
    use_sdpa_kernels(["cudnn", "math"])
    assert sdpa_kernels() == ["cudnn", "math"]
    use_sdpa_kernels(None)
    assert sdpa_kernels() == ["cudnn", "math"]
    use_sdpa_kernels(["math"])
    q = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    reference = torch.softmax(q.double() @ q.double().transpose(-1, -2) / 2.0, dim=-1) @ q.double()
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernels", [[], ["fa3"], ["flash", "sage"]])
def test_an_unknown_kernel_is_named_with_the_choices(kernels):
    with pytest.raises(ValueError, match=r"name one or more of \['cudnn', 'flash', 'efficient', 'math'\]"):
        use_sdpa_kernels(kernels)
    assert sdpa_kernels() == list(SDPA_KERNELS)  # nothing changed


def test_an_engine_given_kernels_samples_what_torchs_choice_samples(diffusers_engine, aio, tiny_model_dir):
    request = GenerationRequest("a red cube", n=2, height=64, width=64, num_inference_steps=3, noise_level=0.7,
                                sde_type="sde", seed=4)
    reference = aio(diffusers_engine.generate(request))
    engine = DiffusersEngine(tiny_model_dir, attention_kernels=["math"])
    aio(engine.start())
    try:
        assert sdpa_kernels() == ["math"]
        traj = aio(engine.generate(request))
    finally:
        aio(engine.close())
    torch.testing.assert_close(traj.latents, reference.latents, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(traj.log_probs, reference.log_probs, rtol=1e-4, atol=1e-4)


def test_a_policy_given_kernels_scores_what_torchs_choice_scores(diffusers_engine, aio, tiny_model_dir):
    from app.train.policy import Policy

    traj = aio(diffusers_engine.generate(GenerationRequest("a red cube", n=2, height=64, width=64,
                                                           num_inference_steps=3, noise_level=0.7, sde_type="sde",
                                                           seed=5)))
    scores = []
    for kernels in (None, ["math"]):
        policy = Policy.from_pretrained(tiny_model_dir, lora_rank=4, lora_alpha=4, target_modules=["to_q"],
                                        shard=False, attention_kernels=kernels)
        with torch.no_grad():
            scores.append(torch.stack([o.log_prob for o in policy.score(traj, range(3), range(2))], dim=1))
    assert sdpa_kernels() == ["math"]
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(scores[0], traj.log_probs, rtol=1e-4, atol=1e-4)  # the engine's own


def test_a_process_allowing_only_some_kernels_caches_its_graphs_apart(tmp_path, monkeypatch):
    """A cached graph keeps the attention kernel picked when it was traced, and the caches' keys do not say which
    were allowed: a process allowing only some must not share a folder with one allowing every kernel."""
    from app.models import compile as compile_mod

    for name in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_CACHE_DIR",
                 "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    compile_mod.use_cache_dir(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
    use_sdpa_kernels(["flash", "math"])
    for _ in range(2):  # the same folder each time, not a subfolder of a subfolder
        compile_mod.use_cache_dir(tmp_path)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "attention-flash-math")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "attention-flash-math" / "triton")
    compile_mod.use_cache_dir(None)  # inductor's own folder, apart too
    default = compile_mod.cache_dir_for(None, SDPA_KERNELS)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(default / "attention-flash-math")
    use_sdpa_kernels(SDPA_KERNELS)
    compile_mod.use_cache_dir(None)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(default)
    assert compile_mod.cache_dir_for(tmp_path, ["math"]) == tmp_path / "attention-math"
    # a child process inherits the folder its parent chose: its own choice goes beside it, not inside
    monkeypatch.setattr(compile_mod, "_DEFAULT_CACHE_DIR", str(default / "attention-flash-math"))
    assert compile_mod.cache_dir_for(None, ["cudnn", "math"]) == default / "attention-cudnn-math"
    assert compile_mod.cache_dir_for(None, SDPA_KERNELS) == default


class _GradientReadAsContiguous(torch.autograd.Function):
    """Attention whose backward reads the output's gradient memory as if it were contiguous [B, H, S, D], the
    mistake cuDNN's kernel made on an H200 (docs/perf/flux/): right for a contiguous gradient, wrong for diffusers'."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        strides = torch.empty(grad.shape).stride()
        misread = grad.as_strided(grad.shape, strides, grad.storage_offset())
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.autograd.grad(out, (q, k, v), misread)


def test_the_backward_check_finds_a_kernel_that_misreads_diffusers_gradient_layout():
    from app.models.attention import BACKWARD_TOLERANCE, _kernel, backward_errors

    assert max(backward_errors(_kernel("math"), head_dim=16, seq=24)) < 1e-6
    errors = backward_errors(_GradientReadAsContiguous.apply, head_dim=16, seq=24)
    assert min(errors) > 10 * BACKWARD_TOLERANCE, errors


def test_a_trainer_leaves_out_cudnn_only_where_its_backward_is_wrong(monkeypatch):
    from app.models import attention

    monkeypatch.setattr(attention, "backward_problem", lambda kernel, device: f"{kernel} is wrong on {device}")
    assert attention.leave_out_broken_backward(torch.device("cuda", 0)) == "cudnn is wrong on cuda:0"
    assert sdpa_kernels() == ["flash", "efficient", "math"]
    assert attention.leave_out_broken_backward(torch.device("cuda", 0)) is None  # nothing left to leave out

    use_sdpa_kernels(SDPA_KERNELS)
    monkeypatch.setattr(attention, "backward_problem", lambda kernel, device: None)
    assert attention.leave_out_broken_backward(torch.device("cuda", 0)) is None
    assert sdpa_kernels() == list(SDPA_KERNELS)

    def never(kernel, device):
        raise AssertionError("no check off CUDA")

    monkeypatch.setattr(attention, "backward_problem", never)
    assert attention.leave_out_broken_backward(torch.device("cpu")) is None


def test_a_trainer_on_a_gpu_leaves_cudnn_out_unless_its_config_lists_it():
    from app.models.attention import trainer_kernels

    use_sdpa_kernels(SDPA_KERNELS)
    assert trainer_kernels(None, torch.device("cuda", 0)) == ["flash", "efficient", "math"]
    assert trainer_kernels(None, torch.device("cpu")) is None  # torch's own choice: no cuDNN on a CPU
    assert trainer_kernels(["cudnn", "math"], torch.device("cuda", 0)) == ["cudnn", "math"]  # listed: kept, checked


def test_the_backward_check_measures_beside_the_callers_work_and_applies_when_asked(monkeypatch):
    """A trainer starts the check before its model loads and applies it before its blocks compile."""
    import threading

    from app.models import attention

    started, release = threading.Event(), threading.Event()

    def slow(kernel, device):
        started.set()
        release.wait(30)
        return "wrong"

    monkeypatch.setattr(attention, "backward_problem", slow)
    apply = attention.check_backward_in_background(torch.device("cuda", 0))
    assert started.wait(30)  # measuring while the caller goes on
    assert sdpa_kernels() == list(SDPA_KERNELS)  # nothing changed before it is applied
    release.set()
    assert apply() == "wrong" and sdpa_kernels() == ["flash", "efficient", "math"]


def test_the_backward_check_runs_in_a_child_process_and_reports_a_kernel_that_fails():
    """A faulting kernel must not take the trainer's CUDA context with it: the check runs in a child process. On a
    CPU cuDNN's kernel takes no input, which is how a failure reads."""
    from app.models.attention import backward_problem

    assert backward_problem("math", "cpu") is None
    problem = backward_problem("cudnn", "cpu")
    assert problem is not None and problem.startswith("its attention backward failed on cpu"), problem


def test_the_backward_check_reports_the_worst_shape_it_measured(monkeypatch):
    """The fault depends on the shape (right at 320 tokens, wrong at FLUX.1's 1152 on an H200): one wrong shape
    among right ones is enough, and the answer names it."""
    import json
    import subprocess

    from app.models import attention

    right = {"B=2 S=320 H=4 D=64": [3e-3] * 3, "B=2 S=320 H=4 D=128": [3e-3] * 3}
    wrong = {**right, "B=2 S=1152 H=24 D=128": [1.41, 1.41, 1.40]}
    for errors, expected in ((right, None), (wrong, "B=2 S=1152 H=24 D=128")):
        answer = subprocess.CompletedProcess([], 0, stdout=json.dumps(errors) + "\n", stderr="")
        monkeypatch.setattr(attention.subprocess, "run", lambda *args, answer=answer, **kwargs: answer)
        problem = attention.backward_problem.__wrapped__("cudnn", "cuda:0")  # uncached
        if expected is None:
            assert problem is None
        else:
            assert "1.4 off fp32 math" in problem and f"at {expected}" in problem, problem


@pytest.mark.gpu
def test_every_kernel_a_trainer_keeps_has_the_right_backward_on_this_gpu():
    from app.models.attention import (
        BACKWARD_TOLERANCE,
        GPU_CHECK_SHAPES,
        _kernel,
        backward_errors,
        backward_problem,
        trainer_kernels,
    )

    print("cuDNN's backward at GPU_CHECK_SHAPES:", backward_problem("cudnn", "cuda:0") or "right")  # a diagnosis
    use_sdpa_kernels(trainer_kernels(None, torch.device("cuda", 0)))
    for kernel in sdpa_kernels():
        for batch, seq, heads in GPU_CHECK_SHAPES:
            for head_dim in (64, 128):
                errors = backward_errors(_kernel(kernel), "cuda", dtype=torch.bfloat16, head_dim=head_dim,
                                         batch=batch, seq=seq, heads=heads)
                assert max(errors) < BACKWARD_TOLERANCE, (kernel, seq, heads, head_dim, errors)
