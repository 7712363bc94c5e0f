"""Z-Image's rotary embedding in real arithmetic (app/models/z_image/rope.py) against diffusers' complex one: the
same transformer output to the last bit, no complex table reaching the blocks, and the compiled path's switch."""

import pytest
import torch
from diffusers.models.transformers import transformer_z_image as z

from app.config import CompileConfig
from app.models.family import get_family
from app.models.z_image.rope import _real_rope_attention, use_real_rope


@pytest.fixture(autouse=True)
def diffusers_rope_restored():
    """Each test starts from diffusers' own rotation (a compiled test earlier in the process switches it), and the
    process gets back what it had."""
    saved = (z.ZSingleStreamAttnProcessor.__call__, z.RopeEmbedder.__call__)
    use_real_rope(False)
    yield
    z.ZSingleStreamAttnProcessor.__call__, z.RopeEmbedder.__call__ = saved


def real_rope_in_use() -> bool:
    return z.ZSingleStreamAttnProcessor.__call__ is _real_rope_attention


def test_a_z_image_transformer_with_the_real_rotation_gives_the_same_output(tiny_z_image_dir):
    model = z.ZImageTransformer2DModel.from_pretrained(tiny_z_image_dir, subfolder="transformer").eval()
    gen = torch.Generator().manual_seed(4)
    channels, text_dim = model.config.in_channels, model.config.cap_feat_dim
    inputs = dict(x=[torch.randn(channels, 1, 8, 8, generator=gen) for _ in range(2)], t=torch.tensor([0.5, 0.3]),
                  cap_feats=[torch.randn(5, text_dim, generator=gen), torch.randn(9, text_dim, generator=gen)],
                  return_dict=False)
    with torch.no_grad():
        complex_out = model(**inputs)[0]
        use_real_rope(True)
        use_real_rope(True)  # twice: still diffusers' table underneath, once
        assert real_rope_in_use()
        ids = torch.zeros(4, 3, dtype=torch.long)
        assert not model.rope_embedder(ids).is_complex()  # nothing complex reaches the blocks
        real_out = model(**inputs)[0]
        use_real_rope(False)
        assert model.rope_embedder(ids).is_complex()
    assert all(torch.equal(r, c) for r, c in zip(real_out, complex_out, strict=True))


def test_compiling_z_image_switches_the_rotation_as_the_section_says():
    family = get_family("z_image")
    family.prepare_compile(CompileConfig(enabled=True))
    assert real_rope_in_use()
    family.prepare_compile(CompileConfig(enabled=True, real_rope=False))
    assert not real_rope_in_use()
