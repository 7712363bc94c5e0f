"""Z-Image (Tongyi's 6B single-stream DiT; Z-Image-Turbo samples in about 8 steps without CFG): a diffusers
transformer (`ZImageTransformer2DModel`: noise and context refiners, then single-stream blocks over image and
caption tokens) conditioned on the second-to-last hidden states of a Qwen3 text encoder at the chat-wrapped
prompt's tokens. The family's face (`FAMILY`); its parts:

    model.py      schedule, latents, the velocity (CFG as Z-Image computes it), re-scoring, decoding
    flops.py      FLOPs of a transformer forward
    tiny.py       the deterministic tiny random checkpoint (tests, the CPU demo)
    real_size.py  a random checkpoint of Z-Image's size (6.2B transformer), built on the GPU
"""

from __future__ import annotations

from pathlib import Path

from app.models.family import VLLM_OMNI, DiffusersFamily, Preset, VllmOmniRecipe, prompt_fields_checker

NAME = "z_image"
# the attention projections and the SwiGLU MLP of every block (main, noise and context refiners share the names):
# what the community's Z-Image LoRAs (DiffSynth-Studio, ai-toolkit) train
LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                "feed_forward.w2", "feed_forward.w3")


class ZImage(DiffusersFamily):
    def prompt_checker(self, path):
        """A prompt may take as many tokens as the pipelines keep of the chat-wrapped prompt (beyond them they cut
        it silently), counted as they count them."""
        from transformers import AutoTokenizer

        from app.models.z_image.model import MAX_SEQUENCE_LENGTH

        tokenizer = AutoTokenizer.from_pretrained(Path(path) / "tokenizer")

        def problem(text: str) -> str | None:
            wrapped = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=True)
            tokens = len(tokenizer(wrapped).input_ids)
            if tokens <= MAX_SEQUENCE_LENGTH:
                return None
            return (f"is {tokens} tokens in Z-Image's chat template; the limit is {MAX_SEQUENCE_LENGTH}, the text "
                    f"encoder's length: shorten it")

        return prompt_fields_checker(problem)

    def shard_units(self, denoiser):
        return [*denoiser.noise_refiner, *denoiser.context_refiner, *denoiser.layers], True

    def compiled_blocks(self, denoiser):
        return list(denoiser.layers)

    def prepare_compile(self, settings):
        from app.models.z_image.rope import use_real_rope

        use_real_rope(settings.real_rope)

    def vllm_omni_guidance(self, request):
        from app.models.z_image.model import MAX_SEQUENCE_LENGTH, default_sigmas

        # Z-Image's own scale g is ours minus one (app/models/z_image/model.py); the schedule diffusers' pipeline
        # builds (vllm-omni's default spacing differs from it)
        return {"guidance_scale": max(request.guidance_scale - 1, 0.0), "max_sequence_length": MAX_SEQUENCE_LENGTH,
                "sigmas": default_sigmas(request.num_inference_steps)}, {}


FAMILY = ZImage(
    name=NAME,
    transformer_class="ZImageTransformer2DModel",
    pipeline_class="ZImagePipeline",
    engines={VLLM_OMNI: "app.rollout.vllm_omni.engine.VllmOmniEngine",
             "diffusers": "app.rollout.z_image_engine.ZImageEngine"},  # the parity oracle, on plain diffusers
    exact_engines=("diffusers",),
    cuda_graphs=False,
    embedded_guidance=False,
    lora_targets=LORA_TARGETS,
    adapter_format="ZImagePipeline.load_lora_weights(...) loads it",
    adapter_roots=("layers", "noise_refiner", "context_refiner", "all_x_embedder", "all_final_layer", "cap_embedder",
                   "t_embedder"),
    checkpoint_files=("model_index.json", "transformer/config.json", "text_encoder/config.json"),
    checkpoint_layout="a diffusers Z-Image folder",
    supports_edits=False,
    video=False,
    vllm_omni=VllmOmniRecipe(pipeline_class="app.rollout.vllm_omni.pipeline_z_image.FlowGRPOZImagePipeline"),
    presets={"tiny-z-image": Preset("app.models.z_image.tiny:build_tiny_z_image",
                                    "tiny random Z-Image (refiners, single-stream blocks, Qwen3 text encoder): fp32, "
                                    "~2 MB, CPU"),
             "z-image": Preset("app.models.z_image.real_size:build_random_z_image",
                               "Z-Image's size (6.2B transformer, Qwen3-4B-wide text encoder), random, bf16, built on "
                               "the GPU (~13 GB)", "n_layers", 30, "single-stream blocks (default and real: 30)")},
    tiny_preset="tiny-z-image",
)
