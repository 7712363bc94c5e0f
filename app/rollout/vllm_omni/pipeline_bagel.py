"""vllm-omni's single-stage BAGEL pipeline with the FlowGRPO sampler, trajectory recording, groups of n, and our
LoRA of the generation expert.

Loaded by vllm-omni through `custom_pipeline_args={"pipeline_class": ...}` with the `bagel_single_stage` deploy
config. Per request it reads the request's `FlowGRPOArgs` (exchange.py: seed, sample_offset, noise_level,
sde_type, sde_window, lora_version) and then:

- builds the request's CFG contexts once (vllm-omni's own code: text, and for an edit the input image through the
  autoencoder and the ViT), recording what they were built from: the token ids the pipeline tokenized, and an
  edit's encoded input image and ViT pixels (`Trajectory.conditioning`, app/models/bagel/context.py);
- denoises the group's n samples over those contexts one after another (vllm-omni's BAGEL pipeline generates one
  image per request), each from its own generator (app/rollout/seeding.py), with `app.algo.sampling`'s recorder
  as BAGEL's scheduler (its loop calls `scheduler.step(v, t, x, dt)`);
- returns the n images, and the trajectory through the fields of exchange.py (latents [n, T+1, N, 64]; the
  conditioning as the trajectory's `conditioning`).

vllm-omni's `num_inference_steps` counts schedule points: T steps take T + 1. The autoencoder encodes an edit's
input image to its posterior mean (vllm-omni would sample it from the global RNG, so the same request would see a
different input each time). Requests without FlowGRPO arguments run the stock pipeline on the base model. BAGEL
runs in bf16 here (vllm-omni hard-codes it), so the trainer recomputes old log-probs (`train.old_logprob:
recompute`). The workarounds for the CPU and for tiny checkpoints live in app/platform/vllm_omni/bagel_cpu.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.models.bagel.pipeline_bagel import BagelPipeline, _resolve_bagel_image_geometry

from app.algo.sampling import TrajectoryRecorder
from app.algo.sde_window import noise_levels
from app.models.bagel.context import BOS, EOS
from app.models.bagel.flux_ae import TINY_AE_KEY
from app.models.bagel.model import initial_latents, patchify, schedule
from app.platform.vllm_omni import bagel_cpu
from app.platform.vllm_omni.cpu_ops import define_missing_ops
from app.platform.vllm_omni.warmup import WARMUP_REQUEST_SIDE, on_the_cpu_platform, shrink_warmup
from app.rollout.seeding import sample_generators
from app.rollout.vllm_omni.bagel_lora import GenerationExpertLora
from app.rollout.vllm_omni.exchange import FlowGRPOArgs, side_output
from app.types import LoraAdapter


def _declared_autoencoder(model_dir) -> dict | None:
    """The smaller autoencoder a tiny checkpoint declares (None: FLUX's own, as the real BAGEL has)."""
    return json.loads(Path(model_dir, "config.json").read_text()).get(TINY_AE_KEY)


define_missing_ops()  # before any BagelPipeline is built on the CPU (its MLPs bind vLLM's ops)


def _under_warmup_size(od_config) -> bool:
    """A BAGEL checkpoint whose latent grid holds less than the warm-up's 512 pixels (every tiny one, with the real
    autoencoder too): vllm-omni's own admission check would refuse its warm-up request."""
    if od_config.model_class_name != "BagelPipeline":
        return False
    latent_downsample, max_latent_size = _resolve_bagel_image_geometry(od_config)
    return latent_downsample * max_latent_size < WARMUP_REQUEST_SIDE


# imported in the engine process before its warm-up request: a small one on the CPU and for a tiny checkpoint
shrink_warmup(on_the_cpu_platform)
shrink_warmup(_under_warmup_size)

SCHEDULE_TOLERANCE = 1e-6  # vllm-omni's σ schedule (float32) against ours


def _prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else (prompt.get("prompt") or "")


def _strip_chat(text: str) -> str:
    """A prompt without the chat wrapping a thinker deploy's prompts carry (the pipeline strips it too)."""
    return text.removeprefix(BOS).removesuffix(EOS)


@dataclass
class _Conditioning:
    """What one request's contexts were built from, as the pipeline built them."""

    token_ids: dict[str, torch.Tensor] = field(default_factory=dict)  # prompt text → ids (bos … eos)
    edit_grid: tuple[int, int] | None = None
    edit_latent: torch.Tensor | None = None  # [z, h·p, w·p]
    edit_vit: torch.Tensor | None = None  # [3, H, W]


class _SDEScheduler:
    """BAGEL's scheduler hook for one sample: `step(v, t, x, dt)` with x, v [N, 64], taken and recorded by
    `app.algo.sampling`'s recorder (a batch of one)."""

    def __init__(self, sigmas: torch.Tensor, generator: torch.Generator, noise_levels: list[float], sde_type: str):
        self.recorder = TrajectoryRecorder(sigmas, noise_levels, sde_type=sde_type, generators=[generator])

    def step(self, v: torch.Tensor, t, x: torch.Tensor, dt, **_):
        rec = self.recorder
        i = rec.steps_taken
        sigma, sigma_next = float(rec.sigmas[i]), float(rec.sigmas[i + 1])
        if abs(float(t) - sigma) > SCHEDULE_TOLERANCE or abs(float(t) - float(dt) - sigma_next) > SCHEDULE_TOLERANCE:
            raise RuntimeError(f"vllm-omni's BAGEL schedule (t={float(t)}, dt={float(dt)}) is not the recorded one "
                               f"({sigma} → {sigma_next}) at step {i}")
        prev = rec.step(v[None], x[None])[0]
        return SimpleNamespace(prev_sample=prev, log_prob=rec.log_probs[-1])


class FlowGRPOBagelPipeline(BagelPipeline):
    supports_step_execution = False  # the step-wise path batches requests around our per-sample scheduler

    def __init__(self, *, od_config, prefix: str = ""):
        super().__init__(od_config=od_config, prefix=prefix)
        bagel_cpu.adapt_pipeline(self, autoencoder=_declared_autoencoder(od_config.model))  # a tiny one's geometry
        self.vae.reg.sample = False  # the posterior mean: an edit's input is the same every time (module doc)
        self.lora = GenerationExpertLora(self.language_model.model.layers)
        self._staged_loras: dict[int, tuple[dict, dict]] = {}  # filled by FlowGRPOWorkerExtension.stage_lora
        self._active_lora: tuple | None = None  # the staged entry being served (None: the base model)
        self._conditioning: _Conditioning | None = None
        self._record_context_inputs()

    # ---- recording what the contexts are built from ------------------------------------------------------------

    def _record_context_inputs(self) -> None:
        bagel, vae = self.bagel, self.vae
        prepare_prompts, prepare_vae_images = bagel.prepare_prompts, bagel.prepare_vae_images
        prepare_vit_images, encode = bagel.prepare_vit_images, vae.encode

        def recorded_prompts(*args, **kwargs):
            out = prepare_prompts(*args, **kwargs)
            if self._conditioning is not None:
                prompts = kwargs.get("prompts", args[2] if len(args) > 2 else None)
                self._conditioning.token_ids[prompts[0]] = out[0]["packed_text_ids"].clone().cpu()
            return out

        def recorded_vae_images(*args, **kwargs):
            out = prepare_vae_images(*args, **kwargs)
            if self._conditioning is not None:
                self._conditioning.edit_grid = tuple(int(s) for s in out[0]["patchified_vae_latent_shapes"][0])
            return out

        def recorded_encode(images):
            latent = encode(images)
            if self._conditioning is not None:
                self._conditioning.edit_latent = latent[0].detach().float().cpu()
            return latent

        def recorded_vit_images(*args, **kwargs):
            transforms = kwargs["transforms"]

            def recorded_transforms(image):
                pixels = transforms(image)
                if self._conditioning is not None:
                    self._conditioning.edit_vit = pixels.detach().float().cpu().clone()
                return pixels

            return prepare_vit_images(*args, **{**kwargs, "transforms": recorded_transforms})

        bagel.prepare_prompts, bagel.prepare_vae_images = recorded_prompts, recorded_vae_images
        bagel.prepare_vit_images, vae.encode = recorded_vit_images, recorded_encode

    def _record_thinker_contexts(self, prompt, prepared: dict) -> None:
        """A thinker stage prefilled the contexts and handed their KV over (vllm-omni's two-stage deploy): nothing
        was tokenized here, so the token ids the trainer rebuilds them from are taken now, by the tokenization the
        single stage runs, and checked against the KV's own lengths (a thinker that tokenized otherwise fails
        here, not in the trainer). Text to image only: a thinker builds an edit's image context itself."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise ValueError("a thinker stage's edit context cannot be recorded (its VAE latent is sampled): serve "
                             "edits with the single-stage deploy")
        texts = {"gen_context": _strip_chat(_prompt_text(prompt))}
        negative = _strip_chat(prompt.get("negative_prompt") or "") if isinstance(prompt, dict) else ""
        if negative:  # an empty negative prompt is the empty context: nothing to record
            texts["cfg_text_context"] = negative
        for context, text in texts.items():
            ids = self.bagel.prepare_prompts(curr_kvlens=[0], curr_rope=[0], prompts=[text], tokenizer=self.tokenizer,
                                             new_token_ids=self.new_token_ids)[0]["packed_text_ids"]  # recorded
            kv_len = int(prepared[context]["kv_lens"][0])
            if kv_len != len(ids):
                raise RuntimeError(f"the thinker's {context} holds {kv_len} tokens, its text {text!r} tokenizes to "
                                   f"{len(ids)} here: the trainer could not rebuild that context")

    def _conditioning_tensors(self, rec: _Conditioning, prompt, sampling) -> dict[str, torch.Tensor]:
        """The request's `Trajectory.conditioning` (app/models/bagel/context.py names)."""
        text = _strip_chat(_prompt_text(prompt))  # as the pipeline strips it
        negative = prompt.get("negative_prompt") if isinstance(prompt, dict) else None
        if negative is None:
            negative = (sampling.extra_args or {}).get("negative_prompt", "")
        negative = _strip_chat(negative)
        out = {"prompt_ids": rec.token_ids[text],
               "image_tokens": torch.tensor([self.new_token_ids["start_of_image"],
                                             self.new_token_ids["end_of_image"]])}
        if negative:
            out["negative_ids"] = rec.token_ids[negative]
        if rec.edit_latent is not None:
            h, w = rec.edit_grid
            p = self.bagel.latent_patch_size
            out.update(edit_latents=patchify(rec.edit_latent[:, :h * p, :w * p], p), edit_grid=torch.tensor([h, w]),
                       edit_vit=rec.edit_vit)
        return out

    # ---- LoRA ---------------------------------------------------------------------------------------------------

    def _use_lora(self, version: int) -> None:
        """Serve the staged adapter `version` (0: the base model). Re-staged tensors under a version already
        active (a reset to the base model starts the versions again) are picked up: staging makes a new entry."""
        staged = self._staged_loras.get(version) if version else None
        if version and staged is None:
            raise ValueError(f"LoRA version {version} is not staged in this engine (staged: "
                             f"{sorted(self._staged_loras)}): publish it first")
        if staged is self._active_lora:
            return
        adapter = None
        if staged is not None:
            tensors, config = staged
            adapter = LoraAdapter(tensors, rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                                  target_modules=list(config["target_modules"]), version=version)
        self.lora.activate(adapter, version)
        self._active_lora = staged

    # ---- sampling -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, req):
        if len(req.prompts) != 1:
            raise ValueError(f"BAGEL generates one request per forward, got {len(req.prompts)} (max_num_seqs: 1)")
        sampling, prompt = req.sampling_params, req.prompts[0]
        args = FlowGRPOArgs.of(sampling)
        self._use_lora(args.lora_version if args else 0)
        if args is None:
            return super().forward(req)
        rec = self._conditioning = _Conditioning()
        try:
            prepared = self._forward_single(prompt, sampling, prepare_only=True)
            if isinstance(prepared, dict) and sampling.past_key_values is not None:
                self._record_thinker_contexts(prompt, prepared)
        finally:
            self._conditioning = None
        if not isinstance(prepared, dict):
            raise ValueError("a FlowGRPO request must ask for an image (not text or think modes)")
        params, inputs = prepared["gen_params"], dict(prepared["generation_input"])
        sigmas = schedule(params.num_timesteps, params.timestep_shift)
        n = sampling.num_outputs_per_prompt if sampling.num_outputs_per_prompt > 0 else 1
        num_tokens = inputs["packed_init_noises"].shape[0]
        levels = noise_levels(args.noise_level, len(sigmas) - 1, args.sde_window)
        images, latents, log_probs = [], [], []
        for generator in sample_generators(args.seed, args.sample_offset, n):
            inputs["packed_init_noises"] = initial_latents([generator], num_tokens, device=self.device)[0]
            scheduler = _SDEScheduler(sigmas, generator, levels, args.sde_type)
            with torch.autocast(device_type=self.device.type, enabled=self.device.type != "cpu",
                                dtype=self.od_config.dtype):
                final, *_ = self.bagel.generate_image(
                    past_key_values=prepared["gen_context"]["past_key_values"],
                    cfg_text_past_key_values=prepared["cfg_text_context"]["past_key_values"],
                    cfg_img_past_key_values=prepared["cfg_img_context"]["past_key_values"],
                    num_timesteps=params.num_timesteps, timestep_shift=params.timestep_shift,
                    cfg_text_scale=params.cfg_text_scale, cfg_img_scale=params.cfg_img_scale,
                    cfg_interval=params.cfg_interval, cfg_renorm_min=params.cfg_renorm_min,
                    cfg_renorm_type=params.cfg_renorm_type, **inputs,
                    cfg_text_packed_position_ids=prepared["cfg_text_packed_position_ids"],
                    cfg_img_packed_position_ids=prepared["cfg_img_packed_position_ids"],
                    scheduler=scheduler)
            images.append(self._decode_image_from_latent(self.bagel, self.vae, final[0], prepared["image_shape"]))
            sample_latents, sample_log_probs = scheduler.recorder.result()  # a batch of one
            latents.append(sample_latents[0].cpu())
            log_probs.append(sample_log_probs[0].cpu())
        side = side_output(sigmas[:-1].clone(), sigmas,
                           {"conditioning": self._conditioning_tensors(rec, prompt, sampling)})
        trajectory = {"latents": torch.stack(latents), "log_probs": torch.stack(log_probs), "timesteps": side}
        return DiffusionOutput(output={"payload": {"image": images, "trajectory": trajectory},
                                       "metadata": {"trajectory": {"type": "denoising"}}})


__all__ = ["FlowGRPOBagelPipeline"]
