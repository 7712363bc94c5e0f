"""Stable Diffusion 3 (SD3.5-Medium, the field's FlowGRPO test bed): a diffusers MMDiT (`SD3Transformer2DModel`,
dual attention in its first blocks) conditioned on CLIP-L, CLIP-G and T5 text states plus the CLIPs' pooled
embedding, CFG, unpacked 16-channel latents, a fixed-shift flow-matching schedule. The family's face (`FAMILY`);
its parts:

    model.py      schedule, initial noise, the velocity with CFG, re-scoring a stored trajectory, decoding
    flops.py      FLOPs of a transformer forward
    tiny.py       the deterministic tiny random checkpoint (tests, the CPU demo), tokenizers trained locally
    real_size.py  a random checkpoint of SD3.5-Medium's size (2.2B transformer), built on the GPU
"""

from __future__ import annotations

from pathlib import Path

from app.models.family import VLLM_OMNI, DiffusersFamily, Preset, VllmOmniRecipe, t5_prompt_checker

NAME = "sd3"
# flow_grpo's SD3 LoRA targets: the joint attention's projections of both streams (not the dual blocks' second,
# image-only attention, `attn2`, nor the MLPs)
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out")


class SD3(DiffusersFamily):
    def prompt_checker(self, path):
        from app.models.sd3.model import T5_MAX_LENGTH

        return t5_prompt_checker(Path(path) / "tokenizer_3", T5_MAX_LENGTH, "SD3")

    def vllm_omni_guidance(self, request):
        from app.models.sd3.model import T5_MAX_LENGTH

        return {"guidance_scale": request.guidance_scale, "max_sequence_length": T5_MAX_LENGTH}, {}


FAMILY = SD3(
    name=NAME,
    transformer_class="SD3Transformer2DModel",
    pipeline_class="StableDiffusion3Pipeline",
    engines={VLLM_OMNI: "app.rollout.vllm_omni.engine.VllmOmniEngine",
             "diffusers": "app.rollout.sd3_engine.SD3Engine"},  # the parity oracle, on plain diffusers
    exact_engines=(VLLM_OMNI, "diffusers"),
    cuda_graphs=True,
    embedded_guidance=False,
    lora_targets=LORA_TARGETS,
    adapter_format="StableDiffusion3Pipeline.load_lora_weights(...) loads it",
    adapter_roots=("transformer_blocks", "pos_embed", "time_text_embed", "context_embedder", "norm_out", "proj_out"),
    checkpoint_files=("model_index.json", "transformer/config.json", "text_encoder_3/config.json"),
    checkpoint_layout="a diffusers Stable Diffusion 3 folder",
    supports_edits=False,
    video=False,
    vllm_omni=VllmOmniRecipe(pipeline_class="app.rollout.vllm_omni.pipeline_sd3.FlowGRPOSD3Pipeline"),
    presets={"tiny-sd3": Preset("app.models.sd3.tiny:build_tiny_sd3",
                                "tiny random SD3 (dual attention, CLIP-L, CLIP-G, T5): fp32, ~1.2 MB, CPU"),
             "sd35-medium": Preset("app.models.sd3.real_size:build_random_sd35_medium",
                                   "SD3.5-Medium's size (2.2B transformer, real-width text encoders), random, bf16, "
                                   "built on the GPU (~20 GB)", "num_layers", 24,
                                   "transformer blocks (default and real: 24)")},
    tiny_preset="tiny-sd3",
)
