"""Qwen-Image: a diffusers MMDiT (`QwenImageTransformer2DModel`) conditioned on Qwen2.5-VL text states, true CFG,
2x2-packed latents, a resolution-shifted flow-matching schedule. The family's face (`FAMILY`); its parts:

    model.py      schedule, packing, the velocity with true CFG, re-scoring a stored trajectory, decoding
    flops.py      FLOPs of a transformer forward
    tiny.py       the deterministic tiny random checkpoint (tests, the CPU demo)
    real_size.py  a random checkpoint of the real size (20.4B transformer), built on the GPU
"""

from __future__ import annotations

from pathlib import Path

from app.models.family import VLLM_OMNI, DiffusersFamily, Preset, VllmOmniRecipe, prompt_fields_checker

NAME = "qwen_image"
TEXT_TOKEN_LIMIT = 1024  # the pipelines' tokenizer_max_length: prompt tokens after the template's own


class QwenImage(DiffusersFamily):
    def prompt_checker(self, path):
        """A prompt may take TEXT_TOKEN_LIMIT tokens, counted as the pipelines count them: the tokens Qwen's chat
        template around the prompt adds are not the prompt's."""
        from transformers import Qwen2Tokenizer

        from app.models.builds import QWEN_IMAGE_TEMPLATE

        tokenizer = Qwen2Tokenizer.from_pretrained(Path(path) / "tokenizer")
        template = len(tokenizer(QWEN_IMAGE_TEMPLATE.format("")).input_ids)

        def problem(text: str) -> str | None:
            tokens = len(tokenizer(QWEN_IMAGE_TEMPLATE.format(text)).input_ids) - template
            if tokens <= TEXT_TOKEN_LIMIT:
                return None
            return f"is {tokens} tokens under Qwen-Image's prompt template; the limit is {TEXT_TOKEN_LIMIT}: shorten it"

        return prompt_fields_checker(problem)

    def prepare_compile(self, settings):
        from app.models.qwen_image.rope import use_real_rope

        use_real_rope(settings.real_rope)

    def vllm_omni_guidance(self, request):
        return {"true_cfg_scale": request.guidance_scale}, {}


FAMILY = QwenImage(
    name=NAME,
    transformer_class="QwenImageTransformer2DModel",
    pipeline_class="QwenImagePipeline",
    engines={VLLM_OMNI: "app.rollout.vllm_omni.engine.VllmOmniEngine",
             "diffusers": "app.rollout.diffusers_engine.DiffusersEngine"},  # the parity oracle, on plain diffusers
    exact_engines=(VLLM_OMNI, "diffusers"),
    cuda_graphs=True,
    embedded_guidance=False,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
    adapter_format="QwenImagePipeline.load_lora_weights(...) loads it",
    adapter_roots=("transformer_blocks", "img_in", "txt_in", "txt_norm", "time_text_embed", "norm_out", "proj_out"),
    checkpoint_files=("model_index.json",),
    checkpoint_layout="a diffusers Qwen-Image folder",
    supports_edits=False,
    video=False,
    vllm_omni=VllmOmniRecipe(pipeline_class="app.rollout.vllm_omni.pipeline_qwen_image.FlowGRPOQwenImagePipeline",
                             lora_renames=(("to_out.0", "to_out"),)),  # vllm-omni's output projection is no list
    presets={"tiny": Preset("app.models.qwen_image.tiny:build_tiny_qwen_image",
                            "tiny random Qwen-Image: fp32, ~3.5 MB, CPU"),
             "qwen-image-full": Preset("app.models.qwen_image.real_size:build_full_random_qwen_image",
                                       "Qwen-Image's real size (20.4B transformer), random, bf16, built on the GPU "
                                       "(~42 GB)", "num_layers", 60, "transformer blocks (default and real: 60)")},
    tiny_preset="tiny",
)
