"""FLUX.1 (FLUX.1-dev, the field's most trained open model): a diffusers transformer (`FluxTransformer2DModel`:
double-stream MMDiT blocks, then single-stream blocks) conditioned on T5 text states and CLIP-L's pooled
embedding, guidance-distilled (the guidance scale is an input embedding: one forward a step, no CFG branch), 2x2
packed latents, a schedule shifted by image size. The family's face (`FAMILY`); its parts:

    model.py      schedule, packing, the velocity (embedded guidance, optional true CFG), re-scoring, decoding
    flops.py      FLOPs of a transformer forward
    tiny.py       the deterministic tiny random checkpoint (tests, the CPU demo)
    real_size.py  a random checkpoint of FLUX.1-dev's size (11.9B transformer), built on the GPU
"""

from __future__ import annotations

from pathlib import Path

from app.models.family import VLLM_OMNI, DiffusersFamily, Preset, VllmOmniRecipe, t5_prompt_checker

NAME = "flux"
# flow_grpo's FLUX targets (train_flux.py): the attention projections of both streams in the double blocks (and
# the single blocks' q, k, v, which share the names) and the double blocks' MLPs of both streams
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2")


class Flux(DiffusersFamily):
    def prompt_checker(self, path):
        from app.models.flux.model import T5_MAX_LENGTH

        return t5_prompt_checker(Path(path) / "tokenizer_2", T5_MAX_LENGTH, "FLUX")

    def shard_units(self, denoiser):
        return [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks], True

    def compiled_blocks(self, denoiser):
        return [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]

    def vllm_omni_guidance(self, request):
        from app.models.flux.model import T5_MAX_LENGTH

        return {"guidance_scale": request.embedded_guidance_scale, "true_cfg_scale": request.guidance_scale,
                "max_sequence_length": T5_MAX_LENGTH}, {}


FAMILY = Flux(
    name=NAME,
    transformer_class="FluxTransformer2DModel",
    pipeline_class="FluxPipeline",
    engines={VLLM_OMNI: "app.rollout.vllm_omni.engine.VllmOmniEngine",
             "diffusers": "app.rollout.flux_engine.FluxEngine"},  # the parity oracle, on plain diffusers
    exact_engines=(VLLM_OMNI, "diffusers"),
    cuda_graphs=False,
    embedded_guidance=True,
    lora_targets=LORA_TARGETS,
    adapter_format="FluxPipeline.load_lora_weights(...) loads it",
    adapter_roots=("transformer_blocks", "single_transformer_blocks", "x_embedder", "context_embedder",
                   "time_text_embed", "norm_out", "proj_out"),
    checkpoint_files=("model_index.json", "transformer/config.json", "text_encoder_2/config.json"),
    checkpoint_layout="a diffusers FLUX.1 folder",
    supports_edits=False,
    video=False,
    vllm_omni=VllmOmniRecipe(pipeline_class="app.rollout.vllm_omni.pipeline_flux.FlowGRPOFluxPipeline"),
    presets={"tiny-flux": Preset("app.models.flux.tiny:build_tiny_flux",
                                 "tiny random FLUX.1 (double and single blocks, guidance embedding, CLIP-L, T5): "
                                 "fp32, ~1.2 MB, CPU"),
             "flux1-dev": Preset("app.models.flux.real_size:build_random_flux1_dev",
                                 "FLUX.1-dev's size (11.9B transformer, real-width text encoders), random, bf16, built "
                                 "on the GPU (~25 GB)", "num_single_layers", 38,
                                 "single-stream blocks after the 19 double ones (default and real: 38)")},
    tiny_preset="tiny-flux",
)
