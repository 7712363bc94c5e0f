"""Qwen-Image's rotary embedding in real arithmetic (app/models/qwen_image/rope.py) against diffusers' complex one
and an independent float64 rotation; what the compiled path switches."""

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage as qwen

from app.config import CompileConfig
from app.models.family import get_family
from app.models.qwen_image.rope import apply_rope_real, use_real_rope


@pytest.fixture(autouse=True)
def diffusers_rope_restored():
    """Each test starts from diffusers' own rotation (a compiled test earlier in the process switches it), and the
    process gets back what it had."""
    saved = dict(qwen.ROPE_PER_DEVICE)
    forwards = {cls: cls.forward for cls in (qwen.QwenEmbedRope, qwen.QwenEmbedLayer3DRope)}
    use_real_rope(False)
    yield
    qwen.ROPE_PER_DEVICE.clear()
    qwen.ROPE_PER_DEVICE.update(saved)
    for cls, forward in forwards.items():
        cls.forward = forward


def real_rope_in_use() -> bool:
    return qwen.ROPE_PER_DEVICE.get("cuda") is apply_rope_real and hasattr(qwen.QwenEmbedRope.forward,
                                                                          "complex_forward")


def tables():
    """Qwen-Image's own frequency tables (axes 16/56/56, head dim 128): a 32x32-patch image and 77 text tokens."""
    rope = qwen.QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
    return rope([(1, 32, 32)], device=torch.device("cpu"), max_txt_seq_len=77)


def rotate_float64(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Each pair (x[2k], x[2k+1]) rotated by the angle of freqs[s, k], in float64, written out by hand."""
    angle = torch.atan2(freqs.imag.double(), freqs.real.double())[:, None]  # [S, 1, D/2]
    magnitude = freqs.abs().double()[:, None]
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    c, d = magnitude * torch.cos(angle), magnitude * torch.sin(angle)
    out = torch.empty_like(x, dtype=torch.float64)
    out[..., 0::2], out[..., 1::2] = a * c - b * d, a * d + b * c
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_rotation_is_diffusers_complex_one_to_the_last_bit(dtype):
    for freqs in tables():
        x = torch.randn(2, freqs.shape[0], 24, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
        real = apply_rope_real(x, freqs)
        assert real.dtype == dtype
        assert torch.equal(real, qwen.apply_rotary_emb_qwen(x, freqs, use_real=False))
        assert torch.equal(apply_rope_real(x, torch.view_as_real(freqs)), real)  # the table as the blocks get it


def test_real_rotation_against_float64():
    for freqs in tables():
        x = torch.randn(2, freqs.shape[0], 4, 128, generator=torch.Generator().manual_seed(1))
        exact = rotate_float64(x, freqs)
        error = (apply_rope_real(x, freqs).double() - exact).abs().max().item()
        assert error <= 4 * torch.finfo(torch.float32).eps * exact.abs().max().item()
        assert not torch.equal(exact.float(), x)  # it rotates


def test_its_gradient_is_the_complex_ones():
    freqs = tables()[0]
    x = torch.randn(1, freqs.shape[0], 2, 128, generator=torch.Generator().manual_seed(2), requires_grad=True)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    (complex_grad,) = torch.autograd.grad(qwen.apply_rotary_emb_qwen(x, freqs, use_real=False), x, g)
    (real_grad,) = torch.autograd.grad(apply_rope_real(x, freqs), x, g)
    assert torch.equal(real_grad, complex_grad)


def test_a_transformer_with_the_real_rotation_gives_the_same_output(tiny_model_dir):
    model = qwen.QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer").eval()
    gen = torch.Generator().manual_seed(4)
    inputs = dict(hidden_states=torch.randn(2, 16, model.config.in_channels, generator=gen),
                  encoder_hidden_states=torch.randn(2, 7, model.config.joint_attention_dim, generator=gen),
                  encoder_hidden_states_mask=torch.ones(2, 7, dtype=torch.long), timestep=torch.tensor([0.5, 0.5]),
                  img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)
    with torch.no_grad():
        use_real_rope(False)
        complex_out = model(**inputs)[0]
        use_real_rope(True)
        use_real_rope(True)  # twice: still one layer of conversion
        assert real_rope_in_use()
        tables = model.pos_embed([(1, 4, 4)], max_txt_seq_len=7, device=torch.device("cpu"))
        assert not any(t.is_complex() for t in tables)  # nothing complex reaches the blocks
        real_out = model(**inputs)[0]
        use_real_rope(False)
        assert all(t.is_complex() for t in model.pos_embed([(1, 4, 4)], max_txt_seq_len=7,
                                                           device=torch.device("cpu")))
    assert torch.equal(real_out, complex_out)


def test_compiling_qwen_image_switches_the_rotation_as_the_section_says():
    family = get_family("qwen_image")
    family.prepare_compile(CompileConfig(enabled=True))
    assert real_rope_in_use() and qwen.ROPE_PER_DEVICE["cpu"] is apply_rope_real
    family.prepare_compile(CompileConfig(enabled=True, real_rope=False))
    assert not real_rope_in_use() and "cpu" not in qwen.ROPE_PER_DEVICE
    get_family("sd3").prepare_compile(CompileConfig(enabled=True))  # other families: nothing to switch
    assert not real_rope_in_use()
