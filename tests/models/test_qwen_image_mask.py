"""Qwen-Image's text mask on the way to the transformer: a group is one prompt, so its mask is all ones and the
transformer gets none (as vllm-omni's transformer and diffusers' `encode_prompt` make it). Attention then runs
without a bias: the flash kernels on a GPU, and no dynamo guard on the text length's alignment (a masked CUDA
attention pads its bias to a multiple of 8, and a prompt of the other residue compiled the trainer again mid-run)."""

import torch

from app.models.qwen_image.model import group_velocity


def _velocity(transformer, mask, negative_mask, guidance_scale=4.0):
    embeds = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    return group_velocity(transformer, torch.tensor([1000.0, 500.0]), embeds, mask, embeds, negative_mask, batch=2,
                          height=32, width=32, guidance_scale=guidance_scale, device="cpu", dtype=torch.float32)


def test_an_all_ones_mask_is_dropped_and_a_padded_one_kept():
    seen = []

    def transformer(**kwargs):
        seen.append(kwargs["encoder_hidden_states_mask"])
        return (torch.ones_like(kwargs["hidden_states"]),)

    padded = torch.tensor([1, 1, 1, 0, 0])
    _velocity(transformer, torch.ones(5, dtype=torch.long), padded)(torch.zeros(2, 4, 16), 0)
    assert seen[0] is None  # the prompt: no padding
    assert torch.equal(seen[1], padded.expand(2, -1))  # the negative prompt's padding is still masked


def test_the_tiny_transformer_gives_the_same_velocity_without_the_mask(tiny_model_dir):
    from diffusers import QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer").eval()
    embeds = torch.randn(2, 5, transformer.config.joint_attention_dim, generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 16, transformer.config.in_channels, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        def run(mask):
            return transformer(hidden_states=x, timestep=torch.tensor([0.5, 0.5]), encoder_hidden_states=embeds,
                               encoder_hidden_states_mask=mask, img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0]

        torch.testing.assert_close(run(None), run(torch.ones(2, 5, dtype=torch.long)), rtol=1e-6, atol=1e-6)
