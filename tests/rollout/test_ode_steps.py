"""`rollout.ode_steps`: FP8 matmuls and First Block Cache on the ODE steps outside the SDE window
(app/rollout/ode_steps.py), on the diffusers engines and the tiny models. The window's steps are untouched: their
transitions and log-probs are bit for bit the full computation's and the trainer's; the cache restarts after every
window step; each CFG forward keeps its own cache; a threshold nothing falls under changes nothing; the config refuses
what it cannot do, naming the field."""

import pytest
import torch

from app.config import ConfigError, load
from app.models.qwen_image import FAMILY as QWEN
from app.types import GenerationRequest

HUGE = 1e9  # every ODE step after a full one reuses its residual
TINY = 1e-12  # no ODE step does


def request(**changes) -> GenerationRequest:
    fields = dict(prompt='a sign that says "OPEN"', n=2, height=64, width=64, num_inference_steps=4,
                  noise_level=0.7, sde_type="sde", seed=7)
    return GenerationRequest(**(fields | changes))


def sample(engine, aio, req, threshold, fp8=False):
    engine.ode_cache_threshold, engine.ode_fp8 = threshold, fp8
    try:
        return aio(engine.generate(req))
    finally:
        engine.ode_cache_threshold, engine.ode_fp8 = None, False


def trainer_log_probs(model_dir, traj, steps):
    trainer = QWEN.load_denoiser(model_dir, dtype=torch.float32, device=torch.device("cpu")).eval()
    with torch.no_grad():
        scored = QWEN.score_trajectory(trainer, traj, steps, range(traj.group_size))
    return torch.stack([s.log_prob for s in scored], dim=1)


def test_ode_steps_leave_the_window_exact_and_cache_the_steps_after_it(diffusers_engine, aio, tiny_model_dir):
    req = request(sde_window=(0, 2))  # steps 0, 1 stochastic; 2, 3 the ODE
    full, cached = sample(diffusers_engine, aio, req, None), sample(diffusers_engine, aio, req, HUGE)
    # the window's transitions and the first ODE step (nothing cached yet) are the full computation's, bit for bit
    assert torch.equal(cached.latents[:, :4], full.latents[:, :4]) and torch.equal(cached.log_probs, full.log_probs)
    assert not torch.equal(cached.latents[:, 4], full.latents[:, 4])  # step 3 reused step 2's blocks
    assert cached.producer["ode_forwards"] == 2 and cached.producer["ode_forwards_cached"] == 1
    assert "ode_forwards" not in full.producer
    assert torch.equal(trainer_log_probs(tiny_model_dir, cached, range(2)), cached.log_probs[:, :2])


def test_ode_steps_cache_restarts_after_every_window_step(diffusers_engine, aio):
    """A window in the middle: the ODE step before it and the one after it are each the first of their run, so
    nothing is reused even at a threshold everything falls under."""
    req = request(sde_window=(1, 3))
    full, cached = sample(diffusers_engine, aio, req, None), sample(diffusers_engine, aio, req, HUGE)
    assert torch.equal(cached.latents, full.latents) and torch.equal(cached.log_probs, full.log_probs)
    assert cached.producer["ode_forwards"] == 2 and cached.producer["ode_forwards_cached"] == 0


def test_ode_steps_under_a_threshold_nothing_meets_change_nothing(diffusers_engine, aio):
    req = request(sde_window=(0, 1))
    full, cached = sample(diffusers_engine, aio, req, None), sample(diffusers_engine, aio, req, TINY)
    assert torch.equal(cached.latents, full.latents) and torch.equal(cached.images, full.images)
    assert cached.producer["ode_forwards"] == 3 and cached.producer["ode_forwards_cached"] == 0


@pytest.mark.slow
def test_ode_steps_keep_a_cache_per_cfg_forward(wan_engine, aio):
    """Wan runs its CFG branches as two forwards a step: each compares with its own last full residual, so at a
    threshold everything falls under the second ODE step's two forwards are cached and the first step's are not
    (one shared cache would have let the first step's second forward reuse the first forward's blocks)."""
    req = request(sde_window=(0, 2), num_frames=5, guidance_scale=3.0, negative_prompt=" ")
    full, cached = sample(wan_engine, aio, req, None), sample(wan_engine, aio, req, HUGE)
    assert cached.producer["ode_forwards"] == 4 and cached.producer["ode_forwards_cached"] == 2
    assert torch.equal(cached.latents[:, :4], full.latents[:, :4]) and torch.equal(cached.log_probs, full.log_probs)


def test_ode_steps_fp8_linear_matches_a_float64_reference():
    """The FP8 layer's output is the float64 product of its quantized operands (the GEMM accumulates in fp32), and
    within e4m3's rounding of the exact product; rows and channels of very different sizes keep their own scales."""
    from app.rollout.ode_steps import FP8_MAX, _quantize_weight, fp8_linear_forward, quantize

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    with torch.no_grad():
        layer.weight[:8] *= 1e3  # channels far larger than the rest: one scale for all would flush the small ones
    x = torch.randn(2, 5, 64) * torch.logspace(-3, 3, 5).view(1, 5, 1)
    _quantize_weight(layer)
    got = fp8_linear_forward(layer, x)
    qx, sx = quantize(x.reshape(-1, 64))
    assert qx.float().abs().amax(dim=-1).eq(FP8_MAX).all()  # each row's largest at FP8's max
    dequantized = (qx.double() * sx.double()) @ (layer._ode_fp8_weight.double() * layer._ode_fp8_scale.double().t()).t()
    reference = (dequantized + layer.bias.double()).reshape(2, 5, 48)
    assert got.shape == (2, 5, 48) and got.dtype == torch.float32
    assert torch.allclose(got.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().amax().item())
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    relative = ((got.double() - exact).norm(dim=-1) / exact.norm(dim=-1))
    assert relative.max() < 0.1 and relative.max() > 0  # e4m3 keeps 3 mantissa bits: a few per cent, never zero


def test_ode_steps_fp8_tensorwise_linear_matches_a_float64_reference():
    """With one scale an operand (`fp8_scaling: tensorwise`, fast accumulation asked) the layer's output is still the
    float64 product of its quantized operands and close to the exact one on even data; on rows and channels of very
    different sizes the one scale flushes the small ones, which rowwise keeps (why rowwise is the default)."""
    from app.rollout.ode_steps import _quantize_weight, fp8_linear_forward, quantize

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)
    _quantize_weight(layer, "tensorwise", fast_accum=True)
    assert layer._ode_fp8_scale.shape == () and layer._ode_fp8_fast_accum
    got = fp8_linear_forward(layer, x)
    qx, sx = quantize(x.reshape(-1, 64), rowwise=False)
    dequantized = (qx.double() * sx.double()) @ (layer._ode_fp8_weight.double() * layer._ode_fp8_scale.double()).t()
    reference = (dequantized + layer.bias.double()).reshape(2, 5, 48)
    assert torch.allclose(got.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().amax().item())
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert ((got.double() - exact).norm(dim=-1) / exact.norm(dim=-1)).max() < 0.1

    uneven, errors = x * torch.logspace(-3, 3, 5).view(1, 5, 1), {}
    exact = uneven.double() @ layer.weight.double().t()  # the product alone: the bias would hide a flushed row
    for scaling in ("rowwise", "tensorwise"):
        _quantize_weight(layer, scaling)
        product = fp8_linear_forward(layer, uneven).double() - layer.bias.double()
        errors[scaling] = ((product - exact).norm(dim=-1) / exact.norm(dim=-1)).max()
    assert errors["rowwise"] < 0.1 < errors["tensorwise"]


def test_ode_steps_fp8_scalings_keep_the_window_and_the_first_pass_exact(diffusers_engine, aio, tiny_model_dir):
    """Tensorwise FP8 with fast accumulation before the window: other ODE states than rowwise's, the trainer's
    recompute on them still exact; a change of the scaling remakes the FP8 weights, and back to rowwise samples
    rowwise's states bit for bit."""
    req = request(sde_window=(2, 4))
    rowwise = sample(diffusers_engine, aio, req, None, fp8=True)
    diffusers_engine.ode_fp8_scaling, diffusers_engine.ode_fp8_fast_accum = "tensorwise", True
    try:
        tensorwise = sample(diffusers_engine, aio, req, None, fp8=True)
    finally:
        diffusers_engine.ode_fp8_scaling, diffusers_engine.ode_fp8_fast_accum = "rowwise", False
    again = sample(diffusers_engine, aio, req, None, fp8=True)
    assert tensorwise.producer["ode_fp8_quantize_s"] > 0 and again.producer["ode_fp8_quantize_s"] > 0
    assert not torch.equal(tensorwise.latents[:, 1], rowwise.latents[:, 1])
    assert torch.equal(trainer_log_probs(tiny_model_dir, tensorwise, range(2, 4)), tensorwise.log_probs[:, 2:])
    assert torch.equal(again.latents, rowwise.latents)


def test_ode_steps_fp8_leave_the_window_exact(diffusers_engine, aio, tiny_model_dir):
    """FP8 on the ODE steps after the window: the window's transitions, its log-probs and the trainer's recompute are
    the full computation's bit for bit; the ODE steps' latents move; the layers are the plain modules again after."""
    req = request(sde_window=(0, 2))
    full, fp8 = sample(diffusers_engine, aio, req, None), sample(diffusers_engine, aio, req, None, fp8=True)
    assert torch.equal(fp8.latents[:, :3], full.latents[:, :3]) and torch.equal(fp8.log_probs, full.log_probs)
    assert not torch.equal(fp8.latents[:, 3], full.latents[:, 3])
    assert fp8.producer["ode_fp8_layers"] > 0 and "ode_fp8_layers" not in full.producer
    assert torch.equal(trainer_log_probs(tiny_model_dir, fp8, range(2)), fp8.log_probs[:, :2])
    module = diffusers_engine.trained_module()
    assert not any(getattr(m, "ode_fp8", False) for m in module.modules())  # every layer's switch off again
    again = sample(diffusers_engine, aio, req, None)
    assert torch.equal(again.latents, full.latents)


def test_ode_steps_fp8_before_the_window_keep_the_first_pass_exact(diffusers_engine, aio, tiny_model_dir):
    """An FP8 ODE step before the window changes the states the window starts from, so its log-probs are not the
    full run's; the trainer's recompute on the recorded states still equals them bit for bit (the first pass
    exact), with FP8 and First Block Cache together."""
    req = request(sde_window=(2, 4))  # steps 0, 1 the ODE, then the window
    full = sample(diffusers_engine, aio, req, None)
    both = sample(diffusers_engine, aio, req, HUGE, fp8=True)
    assert not torch.equal(both.log_probs[:, 2:], full.log_probs[:, 2:])
    assert both.producer["ode_forwards_cached"] == 1 and both.producer["ode_fp8_layers"] > 0
    assert torch.equal(trainer_log_probs(tiny_model_dir, both, range(2, 4)), both.log_probs[:, 2:])


@pytest.mark.parametrize("merge_lora", [None, "device"])
def test_ode_steps_fp8_weights_are_remade_only_when_the_weights_change(tiny_model_dir, aio, merge_lora):
    """The FP8 copy is made at the load and remade at the first ODE step of a group after the weights changed (an
    adapter folded into them, new base weights), never otherwise: such a group samples exactly what a copy made
    from the weights as they stand gives; a peft adapter beside the weights changes nothing to remake."""
    from diffusers import QwenImageTransformer2DModel

    from app.models.lora import LoraShape, random_lora
    from app.rollout.diffusers_engine import DiffusersEngine
    from app.rollout.ode_steps import OdeStepFp8

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    adapter = random_lora(transformer, version=1, rank=4, target_modules=["to_q", "img_mlp.net.2"], seed=3, scale=0.5)
    engine = DiffusersEngine(tiny_model_dir, lora=LoraShape(4, 4.0, ("to_q", "img_mlp.net.2")), merge_lora=merge_lora)
    engine.ode_fp8 = True
    req = request(sde_window=(0, 2))

    def remade_copy():  # the group again with a copy made now from the weights as they stand
        OdeStepFp8(engine.trained_module()).quantize()
        return aio(engine.generate(req))

    try:
        aio(engine.start())
        first, second = aio(engine.generate(req)), aio(engine.generate(req))
        assert first.producer["ode_fp8_quantize_s"] == 0 == second.producer["ode_fp8_quantize_s"]
        assert torch.equal(first.latents, second.latents)
        aio(engine.load_lora(adapter))
        swapped = aio(engine.generate(req))
        assert (swapped.producer["ode_fp8_quantize_s"] > 0) == (merge_lora is not None)
        assert torch.equal(swapped.latents, remade_copy().latents)
        to_q = transformer.transformer_blocks[0].attn.to_q.weight
        assert aio(engine.update_weights({"transformer_blocks.0.attn.to_q.weight": 1.5 * to_q})) == 1
        reloaded = aio(engine.generate(req))
        assert reloaded.producer["ode_fp8_quantize_s"] > 0
        assert torch.equal(reloaded.latents, remade_copy().latents)
        assert aio(engine.generate(req)).producer["ode_fp8_quantize_s"] == 0
    finally:
        aio(engine.close())


def test_ode_steps_config_refuses_what_it_cannot_do():
    base = ["rollout.engine=diffusers", "rollout.sde_window.size=2", "rollout.ode_steps.cache=first_block"]
    assert load("configs/tiny_cpu.yaml", base).rollout.ode_steps.threshold == 0.05
    for changes, message in (
            (["rollout.ode_steps.cache=teacache"], "rollout.ode_steps.cache='teacache': use one of"),
            (["rollout.ode_steps.threshold=0"], "rollout.ode_steps.threshold=0.0 must be > 0"),
            (["rollout.engine=vllm_omni"], "rollout.engine=vllm_omni does not: use rollout.engine=diffusers"),
            (["rollout.sde_window.size=0"], "every step is an SDE step"),
            (["rollout.ode_steps.cache=none", "rollout.ode_steps.precision=int4"],
             "rollout.ode_steps.precision='int4': use one of"),
            (["rollout.ode_steps.cache=none", "rollout.ode_steps.precision=fp8", "rollout.engine=vllm_omni"],
             "rollout.ode_steps.precision=fp8: the in-process diffusers engines"),
            (["rollout.ode_steps.precision=fp8", "rollout.ode_steps.fp8_scaling=blockwise"],
             "rollout.ode_steps.fp8_scaling='blockwise': use one of"),
            (["rollout.ode_steps.fp8_scaling=tensorwise"], "set rollout.ode_steps.precision=fp8 too"),
            (["rollout.ode_steps.fp8_fast_accum=true"], "set rollout.ode_steps.precision=fp8 too")):
        with pytest.raises(ConfigError, match=message):
            load("configs/tiny_cpu.yaml", base + changes)
    fp8 = load("configs/tiny_cpu.yaml", base + ["rollout.ode_steps.precision=fp8"])
    assert fp8.rollout.ode_steps.precision == "fp8" and fp8.rollout.ode_steps.fp8_scaling == "rowwise"
    tensorwise = load("configs/tiny_cpu.yaml", base + ["rollout.ode_steps.precision=fp8",
                                                       "rollout.ode_steps.fp8_scaling=tensorwise",
                                                       "rollout.ode_steps.fp8_fast_accum=true"])
    assert (tensorwise.rollout.ode_steps.fp8_scaling, tensorwise.rollout.ode_steps.fp8_fast_accum) == ("tensorwise",
                                                                                                      True)
    assert load("configs/tiny_cpu.yaml").rollout.ode_steps.cache == "none"  # off by default
    assert load("configs/tiny_cpu.yaml").rollout.ode_steps.precision == "model"


@pytest.mark.slow
def test_ode_steps_fp8_compiled_compiles_once(tiny_model_dir):
    """The compiled engine with FP8 ODE steps: the first group compiles both kinds of step, the next compiles
    nothing (each layer keeps one FP8 forward: compiled code guards on its identity) and repeats the first."""
    from deployments.rollout import make_engine

    config = load("configs/tiny_cpu.yaml", [f"model.path={tiny_model_dir}", "rollout.engine=diffusers",
                                            "model.compile.enabled=true", "train.old_logprob=trainer",
                                            "rollout.sde_window.size=2", "rollout.ode_steps.precision=fp8"])
    engine = make_engine(config.model, config.rollout)
    engine.load()
    req = request(sde_window=(0, 2))
    first, second = engine.sample(req), engine.sample(req)
    assert engine.compiled and first.producer["ode_fp8_layers"] > 0
    assert first.producer["compile_frames"] > 0 and second.producer["compile_frames_new"] == 0
    assert torch.equal(first.latents, second.latents)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Blocks(torch.nn.Module):
    """A transformer's shape as the FP8 switch and First Block Cache find it: `transformer_blocks`."""

    def __init__(self, count: int):
        super().__init__()
        torch.manual_seed(0)
        self.transformer_blocks = torch.nn.ModuleList(Mlp() for _ in range(count))

    def forward(self, x):
        for block in self.transformer_blocks:
            x = block(x)
        return x


def test_ode_steps_fp8_compiled_blocks_share_one_graph_each_way_in_any_thread():
    """Twelve compiled blocks (more than dynamo's default of 8 variants), sampled in another thread than the one
    that compiled them, as a replica does: the FP8 switch is one value every block's graph guards on, so the blocks
    share a graph with it on and one with it off (a forward swapped in per layer made a graph per block, and past
    the limit ran eager: seen on an H100). Off, the output is the full computation's bit for bit; on, the eager FP8
    layers'."""
    import threading

    from app.models.compile import compile_blocks, compile_counts
    from app.rollout.ode_steps import OdeStepFp8

    module, x = Blocks(12), torch.randn(2, 7, 32)
    fp8 = OdeStepFp8(module)
    fp8.quantize()  # as an engine's load does, before its blocks compile
    with torch.no_grad():
        full = module(x)
        fp8._switch(True)
        eager_fp8 = module(x)
        fp8._switch(False)
    compile_blocks(module.transformer_blocks)
    frames = compile_counts()["frames"]
    out = {}

    def sample():
        with torch.no_grad():
            for name, on in (("full", False), ("fp8", True), ("fp8_again", True), ("full_again", False)):
                fp8._switch(on)
                out[name] = module(x)

    thread = threading.Thread(target=sample)
    thread.start()
    thread.join()
    assert compile_counts()["frames"] - frames == 2  # one graph with the switch off, one with it on
    assert torch.equal(out["full_again"], out["full"])
    torch.testing.assert_close(out["full"], full, rtol=1e-5, atol=1e-5)  # inductor's fusions: not bit for bit eager
    torch.testing.assert_close(out["fp8"], eager_fp8, rtol=1e-5, atol=1e-5)
    assert torch.equal(out["fp8_again"], out["fp8"]) and not torch.equal(out["fp8"], full)
