"""Wan (Alibaba's open video DiT; Wan2.1-T2V-1.3B is the field's FlowGRPO / DanceGRPO test bed, Wan2.2-TI2V-5B its
larger sibling): a diffusers transformer (`WanTransformer3DModel`: 3D patches, self-attention over the video's
tokens, cross-attention to UMT5 states, adaLN) denoising video latents of Wan's causal 3D VAE. The family's face
(`FAMILY`), the first that generates videos (`video`: requests carry `num_frames`); its parts:

    model.py      schedule, video latents, the velocity (CFG as Wan computes it), re-scoring, decoding to frames
    flops.py      FLOPs of a transformer forward
    tiny.py       the deterministic tiny random checkpoint (tests, the CPU demo)
    real_size.py  random checkpoints of Wan2.1-T2V-1.3B's and Wan2.2-TI2V-5B's size, built on the GPU
"""

from __future__ import annotations

from pathlib import Path

from app.models.family import VLLM_OMNI, DiffusersFamily, Preset, VllmOmniRecipe, prompt_fields_checker

NAME = "wan"
# attention (self and cross) and the MLP of every block: what flow_grpo's and DanceGRPO's Wan recipes train
LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")


class Wan(DiffusersFamily):
    def prompt_checker(self, path):
        """A prompt may take as many UMT5 tokens as the pipelines keep (beyond them they cut it silently)."""
        from transformers import AutoTokenizer

        from app.models.wan.model import MAX_SEQUENCE_LENGTH

        tokenizer = AutoTokenizer.from_pretrained(Path(path) / "tokenizer")

        def problem(text: str) -> str | None:
            tokens = len(tokenizer(text).input_ids)
            if tokens <= MAX_SEQUENCE_LENGTH:
                return None
            return f"is {tokens} tokens; the limit is {MAX_SEQUENCE_LENGTH}, Wan's UMT5 length: shorten it"

        return prompt_fields_checker(problem)

    def frames_problem(self, num_frames):
        from app.models.wan.model import frames_problem

        return frames_problem(num_frames)

    def shard_units(self, denoiser):
        return list(denoiser.blocks), True

    def compiled_blocks(self, denoiser):
        return list(denoiser.blocks)

    def vllm_omni_guidance(self, request):
        from app.models.wan.model import MAX_SEQUENCE_LENGTH

        return {"guidance_scale": request.guidance_scale, "max_sequence_length": MAX_SEQUENCE_LENGTH,
                "num_frames": request.num_frames}, {}


FAMILY = Wan(
    name=NAME,
    transformer_class="WanTransformer3DModel",
    pipeline_class="WanPipeline",
    engines={VLLM_OMNI: "app.rollout.vllm_omni.engine.VllmOmniEngine",
             "diffusers": "app.rollout.wan_engine.WanEngine"},  # the parity oracle, on plain diffusers
    exact_engines=("diffusers",),
    cuda_graphs=False,
    embedded_guidance=False,
    lora_targets=LORA_TARGETS,
    adapter_format="WanPipeline.load_lora_weights(...) loads it",
    adapter_roots=("blocks", "condition_embedder", "patch_embedding", "proj_out"),
    checkpoint_files=("model_index.json", "transformer/config.json", "vae/config.json"),
    checkpoint_layout="a diffusers Wan folder",
    supports_edits=False,
    video=True,
    # vllm-omni 0.30 serves Wan (`wan2_2`): our FlowGRPO subclass of its pipeline records the SDE steps on Wan's
    # flow schedule in place of its UniPC
    vllm_omni=VllmOmniRecipe(pipeline_class="app.rollout.vllm_omni.pipeline_wan.FlowGRPOWanPipeline",
                             # its DiT's layers: an output projection that is no list, the MLP's as attributes
                             lora_renames=(("to_out.0", "to_out"), ("ffn.net.0", "ffn.net_0"),
                                           ("ffn.net.2", "ffn.net_2"))),
    presets={"tiny-wan": Preset("app.models.wan.tiny:build_tiny_wan",
                                "tiny random Wan (3D patches, self- and cross-attention, causal 3D VAE, UMT5): fp32, "
                                "<1 MB, CPU"),
             "wan2.1-t2v-1.3b": Preset("app.models.wan.real_size:build_random_wan_1_3b",
                                       "Wan2.1-T2V-1.3B's size (1.4B transformer, UMT5-XXL-wide encoder), random, "
                                       "bf16, built on the GPU (~3.5 GB)", "num_layers", 30,
                                       "transformer blocks (default and real: 30)"),
             "wan2.2-ti2v-5b": Preset("app.models.wan.real_size:build_random_wan_5b",
                                      "Wan2.2-TI2V-5B's size (5B transformer, its 16x VAE, UMT5-XXL-wide encoder), "
                                      "random, bf16, built on the GPU (~11 GB)", "num_layers", 30,
                                      "transformer blocks (default and real: 30)")},
    tiny_preset="tiny-wan",
)
