"""The vllm-omni rollout engine: `AsyncOmni` with the FlowGRPO pipeline and worker extension, for Qwen-Image
(`FlowGRPOQwenImagePipeline`) and BAGEL (`FlowGRPOBagelPipeline`, the single-stage deploy config, bf16).

One request per prompt group (`num_outputs_per_prompt = n`, the batched path) by default; with
`batched_groups=False` a group is n concurrent requests of one image each (for comparison). Both produce the same
images for the same seed: every image's noise comes from its own generator (app/rollout/seeding.py).
Concurrent `generate` calls are fine: AsyncOmni queues them and batches up to `max_num_seqs` per forward (BAGEL:
one request per forward).

LoRA adapters arrive in memory (`stage_lora`, never files). Qwen-Image serves them through vllm-omni's LoRA
manager; BAGEL through the pipeline's own hooks on the generation expert (app/rollout/vllm_omni/bagel_lora.py),
selected per request by the version in `extra_args`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path

import numpy as np
import torch

from app.models.lora import PIPELINE_PREFIX, transformer_key
from app.rollout.seeding import draw_seed
from app.rollout.vllm_omni.bagel_lora import split_adapter
from app.rollout.vllm_omni.lora import to_vllm_omni
from app.rollout.vllm_omni.pipeline import EXTRA_ARGS_KEY
from app.types import GenerationRequest, LoraAdapter, Trajectory

# by name: vllm-omni imports them in its worker process (importing them here would import vllm-omni's models)
PIPELINE_CLASSES = {"qwen_image": "app.rollout.vllm_omni.pipeline.FlowGRPOQwenImagePipeline",
                    "bagel": "app.rollout.vllm_omni.pipeline_bagel.FlowGRPOBagelPipeline"}
WORKER_EXTENSION = "app.rollout.vllm_omni.worker.FlowGRPOWorkerExtension"
BAGEL_DEPLOY_CONFIG = "bagel_single_stage.yaml"  # one stage: the DiT builds every context itself


def _first_result(results):
    """collective_rpc answers per stage and per worker ([[value]]); one stage, one worker here."""
    while isinstance(results, (list, tuple)):
        results = results[0]
    return results


def _images_uint8(images) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in images]))


class VllmOmniEngine:
    kind = "vllm_omni"

    def __init__(self, model_path: str | os.PathLike, *, family: str = "qwen_image", dtype: str = "float32",
                 batched_groups: bool = True, max_num_seqs: int = 1, engine_kwargs: dict | None = None):
        if family not in PIPELINE_CLASSES:
            raise ValueError(f"family={family!r}: the vllm-omni engine serves {sorted(PIPELINE_CLASSES)}")
        self.model_path = str(Path(model_path).resolve())
        self.family = family
        # vllm-omni hard-codes bf16 inside BAGEL's attention and MLP: other dtypes fail there
        self.dtype = "bfloat16" if family == "bagel" else dtype
        self.batched_groups = batched_groups
        self.max_num_seqs = max_num_seqs
        self.engine_kwargs = dict(engine_kwargs or {})
        self._omni = None
        self._start_lock = asyncio.Lock()
        self._lora_version = 0
        self._lora_lock = asyncio.Lock()
        self._ids = itertools.count()
        self._served = 0
        self._errors = 0

    @property
    def lora_version(self) -> int:
        return self._lora_version

    async def start(self) -> None:
        async with self._start_lock:
            if self._omni is not None:
                return
            import vllm_omni
            from vllm_omni import AsyncOmni

            kwargs = {"max_num_seqs": self.max_num_seqs}
            if self.family == "bagel":  # its deploy config sets max_num_seqs: 1 (one request per forward)
                kwargs = {"deploy_config": str(Path(vllm_omni.__file__).parent / "deploy" / BAGEL_DEPLOY_CONFIG)}
            self._omni = AsyncOmni(model=self.model_path, dtype=self.dtype,
                                   custom_pipeline_args={"pipeline_class": PIPELINE_CLASSES[self.family]},
                                   worker_extension_cls=WORKER_EXTENSION, **kwargs, **self.engine_kwargs)

    def _sampling_params(self, request: GenerationRequest, seed: int, n: int, offset: int, version: int):
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams
        from vllm_omni.lora.request import LoRARequest

        flowgrpo = {"seed": seed, "sample_offset": offset, "noise_level": request.noise_level,
                    "sde_type": request.sde_type,
                    "sde_window": list(request.sde_window) if request.sde_window is not None else None}
        if self.family == "bagel":  # T steps are T + 1 schedule points; the pipeline applies the LoRA itself
            return OmniDiffusionSamplingParams(
                height=request.height, width=request.width, num_inference_steps=request.num_inference_steps + 1,
                num_outputs_per_prompt=n, seed=seed,
                extra_args={EXTRA_ARGS_KEY: {**flowgrpo, "lora_version": version},
                            "cfg_text_scale": request.guidance_scale, "cfg_img_scale": request.image_guidance_scale,
                            "cfg_interval": tuple(request.cfg_interval), "cfg_renorm_type": request.cfg_renorm,
                            "cfg_renorm_min": request.cfg_renorm_min, "timestep_shift": request.timestep_shift})
        lora = None
        if version > 0:  # the id is the version: staged in memory by the worker extension, never read from disk
            lora = LoRARequest(f"flowgrpo-v{version}", version, f"/in-memory/flowgrpo/v{version}")
        return OmniDiffusionSamplingParams(
            height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
            num_outputs_per_prompt=n, seed=seed, true_cfg_scale=request.guidance_scale, lora_request=lora,
            lora_scale=1.0, extra_args={EXTRA_ARGS_KEY: flowgrpo})

    async def _run(self, request: GenerationRequest, params, kind: str = "flowgrpo"):
        """The final output of one vllm-omni request for `request`'s prompt (and negative prompt under CFG)."""
        prompt = {"prompt": request.prompt}
        if request.do_cfg:  # BAGEL: "" is the empty context (upstream's text-unconditional branch)
            prompt["negative_prompt"] = request.negative_prompt
        if request.is_edit:
            from PIL import Image

            prompt["multi_modal_data"] = {"img2img": Image.fromarray(request.image.numpy())}
        final = None
        async for out in self._omni.generate(prompt, params, request_id=f"{kind}-{next(self._ids)}"):
            final = out
        if final is None or (kind == "flowgrpo" and final.trajectory_latents is None):
            raise RuntimeError(f"vllm-omni returned no {'trajectory' if final else 'output'} for {request.prompt!r}")
        return final

    async def generate(self, request: GenerationRequest) -> Trajectory:
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"expected a GenerationRequest, got {type(request).__name__}")
        await self.start()
        seed = request.seed if request.seed is not None else draw_seed()
        version = self._lora_version  # one adapter for the whole group, recorded with it
        started = time.perf_counter()
        try:
            if self.batched_groups:
                params = self._sampling_params(request, seed, request.n, request.sample_offset, version)
                outputs = [await self._run(request, params)]
            else:
                outputs = await asyncio.gather(*[
                    self._run(request, self._sampling_params(request, seed, 1, request.sample_offset + j, version))
                    for j in range(request.n)])
        except Exception:
            self._errors += 1
            raise
        self._served += 1
        side = outputs[0].trajectory_timesteps
        if self.family == "bagel":
            conditioning = {"family": "bagel", "conditioning": side["conditioning"]}
        else:
            conditioning = {"prompt_embeds": side["prompt_embeds"], "prompt_mask": side["prompt_mask"],
                            "negative_prompt_embeds": side.get("negative_prompt_embeds"),
                            "negative_prompt_mask": side.get("negative_prompt_mask")}
        return Trajectory.sampled(
            request, seed=seed, lora_version=version,
            images=torch.cat([_images_uint8(o.images) for o in outputs]),
            latents=torch.cat([o.trajectory_latents for o in outputs]),
            log_probs=torch.cat([o.trajectory_log_probs for o in outputs]),
            timesteps=side["timesteps"], sigmas=side["sigmas"], **conditioning,
            producer={"engine": self.kind, "pid": os.getpid(), "seconds": time.perf_counter() - started},
        )

    async def generate_plain(self, request: GenerationRequest) -> torch.Tensor:
        """Stock vllm-omni sampling (its scheduler's ODE step, no trajectory): uint8 [n, H, W, 3].

        The baseline for measuring what trajectory recording costs; the seed seeds vllm-omni's own generator.
        """
        await self.start()
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        params = OmniDiffusionSamplingParams(
            height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
            num_outputs_per_prompt=request.n, seed=request.seed if request.seed is not None else draw_seed(),
            true_cfg_scale=request.guidance_scale)
        return _images_uint8((await self._run(request, params, kind="plain")).images)

    async def load_lora(self, adapter: LoraAdapter | None) -> int:
        await self.start()
        async with self._lora_lock:
            if adapter is None:
                self._lora_version = 0
                return 0
            if adapter.version == self._lora_version:  # re-published (e.g. after a replica restart): served already
                return adapter.version
            if adapter.version < self._lora_version:
                raise ValueError(f"adapter version {adapter.version} is older than the served version "
                                 f"{self._lora_version}: publish a newer one, or None to reset to the base model")
            if self.family == "bagel":  # the pipeline's hooks take the trainer's names (checked here, not there)
                split_adapter(adapter)
                tensors = {transformer_key(k): v.detach().contiguous() for k, v in adapter.tensors.items()}
                peft_config = {"r": adapter.rank, "lora_alpha": adapter.alpha,
                               "target_modules": list(adapter.target_modules)}
            else:
                tensors, peft_config = to_vllm_omni(adapter)
            staged = _first_result(await self._omni.collective_rpc("stage_lora",
                                                                  args=(adapter.version, tensors, peft_config)))
            if staged != len(tensors):
                raise RuntimeError(f"the worker did not stage LoRA version {adapter.version}: {staged!r}")
            self._lora_version = adapter.version
            return adapter.version

    async def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        if self.family == "bagel":
            raise NotImplementedError("full-weight updates of vllm-omni's BAGEL are not served: train a LoRA "
                                      "(published with load_lora)")
        await self.start()
        items = [(PIPELINE_PREFIX + transformer_key(k), v) for k, v in named_tensors.items()]  # vllm-omni's names
        return int(_first_result(await self._omni.collective_rpc("update_weights", args=(items,))))

    async def transformer_checksum(self) -> float:
        await self.start()
        return float(_first_result(await self._omni.collective_rpc("transformer_checksum")))

    async def health(self) -> dict:
        return {"kind": self.kind, "family": self.family, "model": self.model_path, "started": self._omni is not None,
                "lora_version": self._lora_version, "served": self._served, "errors": self._errors,
                "batched_groups": self.batched_groups}

    async def close(self) -> None:
        if self._omni is not None:
            self._omni.shutdown()
            self._omni = None
