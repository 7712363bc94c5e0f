"""BAGEL (BAGEL-7B-MoT): a Qwen2 Mixture-of-Transformers LLM whose generation expert denoises image latents over a
context of text (and, for an edit, the input image), 3-branch CFG, the FLUX autoencoder. The family's face
(`FAMILY`); its parts:

    model.py       the MoT in pure torch (upstream tensor names), contexts, velocity, CFG, schedule, sampling
    context.py     a group's conditioning (token ids, an edit's encoded image), its CFG contexts, re-scoring
    flux_ae.py     the FLUX autoencoder as a diffusers AutoencoderKL
    flops.py       FLOPs of a denoising forward
    tiny.py        the deterministic tiny random checkpoint (tests, the CPU demo)
    real_width.py  random BAGEL at BAGEL-7B-MoT's layer width, built on the GPU
"""

from __future__ import annotations

import json
from pathlib import Path

from app.models.family import VLLM_OMNI, FamilyBase, Preset, VllmOmniRecipe, prompt_fields_checker

NAME = "bagel"
IMAGE_POSITIONS = 3  # RoPE positions of image blocks: an edit's latents and ViT blocks, the generated image
PEFT_WEIGHTS = "adapter_model.safetensors"
# the generation expert's projections in every layer (upstream names of model.py): what a LoRA of BAGEL trains
GENERATION_TARGETS = ["q_proj_moe_gen", "k_proj_moe_gen", "v_proj_moe_gen", "o_proj_moe_gen", "mlp_moe_gen.gate_proj",
                      "mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj"]


class Bagel(FamilyBase):
    def load_denoiser(self, path, *, dtype, device):
        from app.models.bagel.model import BagelMoT
        from app.models.precision import exact_fp32

        exact_fp32(dtype)

        return BagelMoT.from_checkpoint(path, dtype=dtype, device=device)

    def denoiser_config(self, path):
        """`BagelMoT.config`'s keys, read from the checkpoint's config files (nothing loaded)."""
        config = json.loads((Path(path) / "config.json").read_text())
        llm = json.loads((Path(path) / "llm_config.json").read_text())
        return {**llm, "latent_patch_size": config["latent_patch_size"],
                "latent_channels": config["vae_config"]["z_channels"]}

    def denoiser_skeleton(self, path):
        from app.models.bagel.model import BagelMoT

        return BagelMoT.skeleton(path)

    def shard_units(self, denoiser):
        # the decoder layers only: the rest (embeddings, timestep and latent projections, the ViT) is frozen and
        # used outside `forward` (the context and velocity methods), where a sharded root would not be gathered;
        # it stays whole on every rank, and the LoRA (all inside the layers) is sharded with them
        return list(denoiser.language_model.model.layers), False

    def compiled_blocks(self, denoiser):
        return list(denoiser.language_model.model.layers)

    def score_trajectory(self, denoiser, traj, steps, samples, *, flow_grpo_compat=False, uniform=False):
        from app.models.bagel.context import score_trajectory

        return score_trajectory(denoiser, traj, steps, samples, flow_grpo_compat=flow_grpo_compat, uniform=uniform)

    def shaped_trajectory(self, path, request, config, generator):
        """A text-to-image group shaped as the rollout returns it, random values (`jobs.bench_train_step`)."""
        from app.models.bagel.context import shaped_trajectory

        return shaped_trajectory(path, request, config, generator)

    def forward_flops(self, config, traj):
        from app.models.bagel.flops import trajectory_forward_flops

        return trajectory_forward_flops(config, traj)

    def prompt_checker(self, path):
        """A prompt must fit the LLM's context (max_position_embeddings positions, shared with the image blocks),
        counted in BAGEL's prompt ids (bos + text + eos)."""
        from app.models.bagel.context import token_ids, tokenizer_of

        tokenizer = tokenizer_of(str(path))
        limit = json.loads((Path(path) / "llm_config.json").read_text())["max_position_embeddings"] - IMAGE_POSITIONS

        def problem(text: str) -> str | None:
            tokens = int(token_ids(tokenizer, text).numel())
            return f"is {tokens} tokens of BAGEL's LLM; the limit is {limit}: shorten it" if tokens > limit else None

        return prompt_fields_checker(problem)

    def save_adapter(self, directory, tensors, *, rank, alpha, target_modules) -> Path:
        """A peft adapter folder (`adapter_model.safetensors` + `adapter_config.json`, module names of
        `ema.safetensors`)."""
        from peft import LoraConfig
        from safetensors.torch import save_file

        directory = Path(directory)
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted(target_modules)).save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / PEFT_WEIGHTS))
        return directory / PEFT_WEIGHTS

    def vllm_omni_guidance(self, request):
        return {}, {"cfg_text_scale": request.guidance_scale, "cfg_img_scale": request.image_guidance_scale,
                    "cfg_interval": tuple(request.cfg_interval), "cfg_renorm_type": request.cfg_renorm,
                    "cfg_renorm_min": request.cfg_renorm_min, "timestep_shift": request.timestep_shift}


FAMILY = Bagel(
    name=NAME,
    engines={VLLM_OMNI: "app.rollout.vllm_omni.engine.VllmOmniEngine",
             "bagel": "app.rollout.bagel_engine.BagelEngine"},  # our pure-torch model: the fp32 parity oracle
    exact_engines=("bagel",),  # vllm-omni hard-codes bf16 in BAGEL's attention and MLP
    cuda_graphs=False,  # the context's keys and values, returned by the layers, live across the step's forwards
    embedded_guidance=False,
    lora_targets=tuple(GENERATION_TARGETS),
    adapter_format="a peft adapter folder of BAGEL's module names",
    adapter_roots=("language_model",),
    checkpoint_files=("config.json", "llm_config.json", "ema.safetensors", "ae.safetensors"),
    checkpoint_layout="a BAGEL-7B-MoT folder",
    supports_edits=True,
    video=False,
    vllm_omni=VllmOmniRecipe(pipeline_class="app.rollout.vllm_omni.pipeline_bagel.FlowGRPOBagelPipeline",
                             deploy_config="bagel_single_stage.yaml",  # one stage: the DiT builds every context
                             thinker_deploy_config="bagel.yaml",  # the thinker prefills, its KV handed to the DiT
                             dtype="bfloat16", extra_schedule_points=1, lora_delivery="pipeline_hooks",
                             weight_updates=False),
    presets={"tiny-bagel": Preset("app.models.bagel.tiny:build_tiny_bagel", "the BAGEL-7B-MoT layout (upstream "
                                  "file and tensor names) at a tiny size, fp32, ~17 MB, CPU"),
             "tiny-bagel-full-ae": Preset("app.models.bagel.tiny:build_tiny_bagel_full_ae", "the tiny BAGEL with "
                                          "the real 84M-parameter autoencoder: what vllm-omni's thinker stage loads "
                                          "(CUDA)"),
             "bagel-real-width": Preset("app.models.bagel.real_width:build_real_width_bagel", "BAGEL-7B-MoT's LLM "
                                        "width (3584, both experts), random, bf16, built on the GPU", "layers", 4,
                                        "decoder layers (default 4, real: 28)")},
    tiny_preset="tiny-bagel",
)
