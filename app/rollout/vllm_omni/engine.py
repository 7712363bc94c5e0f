"""The vllm-omni rollout engine: `AsyncOmni` with the family's FlowGRPO pipeline and our worker extension, as the
family's `VllmOmniRecipe` says (app/models/family.py: Qwen-Image's `FlowGRPOQwenImagePipeline`; BAGEL's
`FlowGRPOBagelPipeline`, the single-stage deploy config, bf16).

One request per prompt group (`num_outputs_per_prompt = n`, the batched path) by default; with
`batched_groups=False` a group is n concurrent requests of one image each (for comparison). Both produce the same
images for the same seed: every image's noise comes from its own generator (app/rollout/seeding.py).
Concurrent `generate` calls are fine: AsyncOmni queues them and batches up to `max_num_seqs` per forward (BAGEL:
one request per forward).

LoRA adapters arrive in memory (`stage_lora`, never files), served through vllm-omni's LoRA manager (Qwen-Image,
SD3) or the pipeline's own hooks (BAGEL's generation expert, app/rollout/vllm_omni/bagel_lora.py), selected per
request by the version in its FlowGRPO arguments; or, with `merge_lora`, folded into the weights (merge.py). The
group after a publication tells its engine-side seconds (`producer["adapter_swap_s"]`: the staging, vLLM's own
load then running inside that group; or the fold). What engine and pipeline exchange: exchange.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from app.metrics import BusyClock
from app.models.bagel.flux_ae import TINY_AE_KEY
from app.models.family import get_family
from app.models.lora import PIPELINE_PREFIX, transformer_key
from app.models.lora_merge import adapter_layers
from app.rollout.seeding import draw_seed
from app.rollout.vllm_omni.exchange import FlowGRPOArgs
from app.rollout.vllm_omni.lora import BASE_LORA_ID, LORA_DELIVERIES, zero_lora
from app.types import GenerationRequest, LoraAdapter, RequestError, Trajectory

WORKER_EXTENSION = "app.rollout.vllm_omni.worker.FlowGRPOWorkerExtension"
THINKER_DIT_STAGE = 1  # in a thinker deploy (BAGEL's bagel.yaml): stage 0 the thinker, stage 1 the DiT
FP32_ATTENTION = {"default": {"backend": "TORCH_SDPA"}}  # vllm-omni's attention config for fp32 on CUDA


class WorkerError(RuntimeError):
    """A worker method reached through `collective_rpc` raised (vllm-omni answers with the error's text)."""


def _first_result(results):
    """collective_rpc answers per stage and per worker ([[value]]); one stage, one worker here. A method that raised
    in the worker comes back as {"supported": False, "error": text}: raised here, with that text."""
    while isinstance(results, (list, tuple)):
        results = results[0]
    if isinstance(results, dict) and results.get("supported") is False:
        raise WorkerError(f"vllm-omni's worker: {results.get('error')}")
    return results


class _SwapGate:
    """Groups in flight against a swap of the weights: a merging engine changes them only between groups (a swap
    waits for the groups running, and groups arriving meanwhile wait for the swap)."""

    def __init__(self):
        self._changed = asyncio.Condition()
        self._running = 0
        self._swapping = False

    @contextlib.asynccontextmanager
    async def group(self):
        async with self._changed:
            await self._changed.wait_for(lambda: not self._swapping)
            self._running += 1
        try:
            yield
        finally:
            async with self._changed:
                self._running -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def swap(self):  # one at a time: the engine's LoRA lock is held
        async with self._changed:
            self._swapping = True
            await self._changed.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            async with self._changed:
                self._swapping = False
                self._changed.notify_all()


def _images_uint8(images) -> torch.Tensor:
    """uint8 [n, H, W, 3] of an output's PIL images, or [n, F, H, W, 3] of its videos (float frames in [0, 1] in
    arrays of [n, F, H, W, 3], rounded as the diffusers engine rounds them)."""
    if images and isinstance(images[0], np.ndarray):
        frames = np.concatenate([np.asarray(v, dtype=np.float32) for v in images])
        return torch.from_numpy((np.clip(frames, 0, 1) * 255).round().astype(np.uint8))
    return torch.from_numpy(np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in images]))


def _declares_a_small_autoencoder(model_dir: str) -> bool:
    config = Path(model_dir, "config.json")
    return config.is_file() and TINY_AE_KEY in json.loads(config.read_text())


class VllmOmniEngine:
    kind = "vllm_omni"

    def __init__(self, model_path: str | os.PathLike, *, family: str = "qwen_image", dtype: str = "float32",
                 batched_groups: bool = True, max_num_seqs: int = 1, engine_kwargs: dict | None = None,
                 compile=None, merge_lora: bool = False, lora_targets: tuple[str, ...] = (),
                 thinker_stage: bool = False, lora_rank: int = 0, lora_alpha: float = 0.0,
                 zero_adapter_for_base: bool | None = None):
        """compile: a `model.compile` section. On CUDA vllm-omni compiles the transformer's blocks itself unless
        told `enforce_eager`, which follows the section; its CPU platform runs eager either way. merge_lora: fold
        each published adapter into the weights (merge.py) instead of serving it through vLLM's LoRA layers; the
        weights then change between groups, never during one; lora_targets: the run's adapters' target modules,
        whose base weights a merging engine starts reading at its start (the first fold then waits for nothing);
        thinker_stage: the family's two-stage deploy (BAGEL: a thinker prefills the prompt, the DiT denoises on its
        KV; text to image, CUDA only), our pipeline and worker extension in the DiT stage. lora_rank, lora_alpha:
        the run's adapters' (with lora_targets). zero_adapter_for_base: serve the base model (version 0) through a
        zero adapter of the run's shape (lora.py `zero_lora`) where adapters go through vLLM's LoRA layers, so that
        the graphs compiled at the first step are those of every later step (None: when compiled)."""
        self.model_path = str(Path(model_path).resolve())
        self.family = family
        self.face = get_family(family)  # looked up once: every request asks it for its guidance fields
        self.recipe = self.face.vllm_omni
        self.dtype = self.recipe.dtype or dtype  # a dtype vllm-omni hard-codes for the family wins
        self.batched_groups = batched_groups
        self.max_num_seqs = max_num_seqs
        if merge_lora and self.recipe.lora_delivery != "vllm_manager":
            raise ValueError(f"merge_lora: vllm-omni's {family} pipeline applies its adapter with its own hooks; "
                             "serve it unmerged (rollout.merge_lora=false)")
        self.merge_lora = merge_lora
        self.lora_targets = tuple(lora_targets)
        if thinker_stage and not self.recipe.thinker_deploy_config:
            raise ValueError(f"thinker_stage: vllm-omni serves {family} without a thinker stage")
        if thinker_stage and _declares_a_small_autoencoder(self.model_path):
            raise ValueError(f"thinker_stage: {self.model_path} declares a smaller autoencoder than BAGEL's "
                             f"({TINY_AE_KEY} in config.json); vllm-omni's thinker builds the real one whatever the "
                             "checkpoint declares and cannot load it: build the tiny checkpoint with `jobs."
                             "make_tiny_models --preset tiny-bagel-full-ae`, or use rollout.thinker_stage=false")
        if thinker_stage and not torch.cuda.is_available():
            raise ValueError("thinker_stage: vllm-omni runs a thinker (vLLM's AR worker) on CUDA only; on this "
                             "machine use rollout.thinker_stage=false (the DiT builds every context itself)")
        self.thinker_stage = thinker_stage
        self._swaps = _SwapGate()
        self._swap_s = None  # the last publication's engine-side seconds, told by the next group (adapter_swap_s)
        self.engine_kwargs = dict(engine_kwargs or {})
        enabled = compile is not None and compile.enabled
        if torch.cuda.is_available():
            self.engine_kwargs.setdefault("enforce_eager", not enabled)
            chosen = self.engine_kwargs.get("diffusion_attention_backend") or os.environ.get(
                "DIFFUSION_ATTENTION_BACKEND")
            if str(self.dtype) == "float32" and not chosen:
                # vllm-omni's default attention on Hopper is FlashAttention 3, which takes fp16/bf16/fp8 only: an
                # fp32 model (the tiny checkpoints, parity runs) attends through torch's SDPA, which takes fp32
                self.engine_kwargs.setdefault("diffusion_attention_config", FP32_ATTENTION)
        self.compiled = enabled and torch.cuda.is_available()
        # (rank, alpha) of the zero adapter staged at start for version 0 under BASE_LORA_ID (None: version 0 runs
        # without vLLM's LoRA layers); built and staged in start(), where the worker keeps it
        self._zero_base = None
        zero_adapter_for_base = self.compiled if zero_adapter_for_base is None else zero_adapter_for_base
        if (zero_adapter_for_base and lora_rank > 0 and self.lora_targets and not merge_lora and not thinker_stage
                and self.recipe.lora_delivery == "vllm_manager"):
            self._zero_base = (lora_rank, lora_alpha or lora_rank)
        self._omni = None
        self._start_lock = asyncio.Lock()
        self._lora_version = 0
        self._lora_lock = asyncio.Lock()
        self._ids = itertools.count()
        self._busy = BusyClock()  # concurrent groups queue in vllm-omni: each is charged its share of the time
        self._compile_frames = 0  # the worker's frames compiled, as the last group reported them
        self._served = 0
        self._errors = 0

    @classmethod
    def from_config(cls, model, rollout) -> VllmOmniEngine:
        """The engine of a run config's model and rollout sections."""
        return cls(model.path, family=model.family, dtype=model.dtype, batched_groups=rollout.batched_groups,
                   max_num_seqs=rollout.max_num_seqs, compile=model.compile, merge_lora=rollout.merge_lora,
                   lora_targets=tuple(model.lora_targets), thinker_stage=rollout.thinker_stage,
                   lora_rank=model.lora_rank, lora_alpha=model.lora_alpha)

    @property
    def merged_base_on(self) -> str | None:
        """Where a merging engine keeps the adapted layers' base weights (as the in-process engines say it)."""
        return "host" if self.merge_lora else None

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
            deploy = self.recipe.thinker_deploy_config if self.thinker_stage else self.recipe.deploy_config
            if deploy:  # it sets max_num_seqs itself (BAGEL's: one request per forward)
                kwargs = {"deploy_config": str(Path(vllm_omni.__file__).parent / "deploy" / deploy)}
            # our extension in the DiT's stage; beside a thinker in that stage only (vLLM's AR worker has its own
            # update_weights)
            extension = f"stage_{THINKER_DIT_STAGE}_" if self.thinker_stage else ""
            kwargs[f"{extension}worker_extension_cls"] = WORKER_EXTENSION
            # the pipeline by name: vllm-omni imports it in its worker process (a DiT stage's only)
            self._omni = AsyncOmni(model=self.model_path, dtype=self.dtype,
                                   custom_pipeline_args={"pipeline_class": self.recipe.pipeline_class},
                                   **kwargs, **self.engine_kwargs)
            if self.merge_lora and self.lora_targets:
                await self._rpc("keep_lora_base", list(self.lora_targets))
            if self._zero_base is not None:  # served for version 0 (see __init__)
                rank, alpha = self._zero_base
                zero = zero_lora(self.model_path, rank=rank, alpha=alpha, target_modules=self.lora_targets,
                                 dtype=getattr(torch, str(self.dtype)))
                if zero is None:  # no layer of the checkpoint is a target: nothing to hold the graphs to
                    self._zero_base = None
                else:
                    tensors, peft_config = LORA_DELIVERIES[self.recipe.lora_delivery](zero, self.recipe)
                    await self._rpc("stage_lora", BASE_LORA_ID, tensors, peft_config)

    async def _rpc(self, method: str, *args):
        """One of our worker methods (worker.py) in the stage that holds the DiT; its answer, or WorkerError."""
        stages = [THINKER_DIT_STAGE] if self.thinker_stage else None
        return _first_result(await self._omni.collective_rpc(method, args=args, stage_ids=stages))

    def _sampling_params(self, request: GenerationRequest, seed: int, n: int, offset: int, version: int):
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams
        from vllm_omni.lora.request import LoRARequest

        flowgrpo = FlowGRPOArgs(seed=seed, sample_offset=offset, noise_level=request.noise_level,
                                sde_type=request.sde_type, sde_window=request.sde_window, lora_version=version)
        guidance, extra = self.face.vllm_omni_guidance(request)
        lora = {}
        if self.recipe.lora_delivery == "vllm_manager" and version > 0 and not self.merge_lora:
            # the id is the version: staged in memory by the worker extension, never read from disk
            lora = {"lora_request": LoRARequest(f"flowgrpo-v{version}", version, f"/in-memory/flowgrpo/v{version}"),
                    "lora_scale": 1.0}
        elif version == 0 and self._zero_base is not None:  # the base model through the zero adapter
            lora = {"lora_request": LoRARequest("flowgrpo-base", BASE_LORA_ID, "/in-memory/flowgrpo/base"),
                    "lora_scale": 1.0}
        return OmniDiffusionSamplingParams(
            height=request.height, width=request.width,
            num_inference_steps=request.num_inference_steps + self.recipe.extra_schedule_points,
            num_outputs_per_prompt=n, seed=seed, **guidance, **lora, extra_args={**flowgrpo.extra_args(), **extra})

    async def _run(self, request: GenerationRequest, params, kind: str = "flowgrpo"):
        """The final output of one vllm-omni request for `request`'s prompt (and negative prompt under CFG)."""
        if self.thinker_stage:
            stream = self._omni.generate(self._thinker_prompt(request), request_id=f"{kind}-{next(self._ids)}",
                                         sampling_params_list=self._stage_params(params), output_modalities=["image"])
        else:
            prompt = {"prompt": request.prompt}
            if request.do_cfg:  # BAGEL: "" is the empty context (upstream's text-unconditional branch)
                prompt["negative_prompt"] = request.negative_prompt
            if request.is_edit:
                from PIL import Image

                prompt["multi_modal_data"] = {"img2img": Image.fromarray(request.image.numpy())}
            stream = self._omni.generate(prompt, params, request_id=f"{kind}-{next(self._ids)}")
        final = None
        async for out in stream:
            final = out
        if final is None or (kind == "flowgrpo" and final.trajectory_latents is None):
            raise RuntimeError(f"vllm-omni returned no {'trajectory' if final else 'output'} for {request.prompt!r}")
        return final

    @staticmethod
    def _thinker_prompt(request: GenerationRequest) -> dict:
        """The prompt as a thinker deploy takes it: the chat wrapping its tokenizer turns into BAGEL's bos and eos
        (the ids the DiT's own tokenization gives), `modalities: ["image"]` for its CFG companions; a negative
        prompt is sent as it is, so it comes wrapped (an empty one: no companion, the empty context, as upstream)."""
        from app.models.bagel.context import BOS, EOS

        if request.is_edit:
            raise RequestError("image", "an input image", "a thinker stage builds an edit's image context itself "
                               "(a sampled VAE latent, its own resize, no LoRA) and the trainer cannot rebuild it: "
                               "send text-to-image requests, or serve with rollout.thinker_stage=false")
        prompt = {"prompt": f"{BOS}{request.prompt}{EOS}", "modalities": ["image"]}
        if request.do_cfg and request.negative_prompt:
            prompt["negative_prompt"] = f"{BOS}{request.negative_prompt}{EOS}"
        return prompt

    def _stage_params(self, params) -> list:
        """Every stage's sampling parameters: the deploy's own for the thinker (it stops after its prefill), ours
        for the DiT."""
        stages = list(self._omni.default_sampling_params_list)
        stages[THINKER_DIT_STAGE] = params
        return stages

    async def generate(self, request: GenerationRequest) -> Trajectory:
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"expected a GenerationRequest, got {type(request).__name__}")
        if (problem := self.face.request_problem(request)) is not None:  # frames: videos or images
            raise RequestError(problem[0], getattr(request, problem[0]), problem[1])
        await self.start()
        seed = request.seed if request.seed is not None else draw_seed()
        busy = self._busy.enter()
        try:
            async with self._swaps.group() if self.merge_lora else contextlib.nullcontext():
                version = self._lora_version  # one adapter for the whole group, recorded with it
                if self.batched_groups:
                    params = self._sampling_params(request, seed, request.n, request.sample_offset, version)
                    outputs = [await self._run(request, params)]
                else:
                    outputs = await asyncio.gather(*[
                        self._run(request, self._sampling_params(request, seed, 1, request.sample_offset + j,
                                                                 version))
                        for j in range(request.n)])
        except Exception:
            self._errors += 1
            raise
        finally:
            seconds = self._busy.leave(busy)
        self._served += 1
        swap, self._swap_s = self._swap_s, None
        side = outputs[0].trajectory_timesteps  # exchange.py: the family's conditioning as Trajectory fields
        producer = {"engine": self.kind, "pid": os.getpid(), "seconds": seconds,
                    **({"adapter_swap_s": swap} if swap is not None else {})}
        stats = side.get("worker", {})
        if "compile_frames" in stats and self.compiled:  # the frames new since the group before (0: steady)
            frames = max(self._compile_frames, int(stats["compile_frames"]))
            producer.update(compile_frames=frames, compile_frames_new=frames - self._compile_frames)
            self._compile_frames = frames
        if "gpu_peak_gib" in stats:
            producer["gpu_peak_gib"] = float(stats["gpu_peak_gib"])
        return Trajectory.sampled(
            request, seed=seed, lora_version=version,
            images=torch.cat([_images_uint8(o.images) for o in outputs]),
            latents=torch.cat([o.trajectory_latents for o in outputs]),
            log_probs=torch.cat([o.trajectory_log_probs for o in outputs]),
            timesteps=side["timesteps"], sigmas=side["sigmas"], family=self.family, **side["fields"],
            producer=producer,
        )

    async def generate_plain(self, request: GenerationRequest) -> torch.Tensor:
        """Stock vllm-omni sampling (its scheduler's ODE step, no trajectory): uint8 [n, H, W, 3] ([n, F, H, W, 3]).

        The baseline for measuring what trajectory recording costs; the seed seeds vllm-omni's own generator.
        """
        await self.start()
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        video = {"num_frames": request.num_frames, "guidance_scale": request.guidance_scale} if request.is_video else {}
        params = OmniDiffusionSamplingParams(
            height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
            num_outputs_per_prompt=request.n, seed=request.seed if request.seed is not None else draw_seed(),
            true_cfg_scale=request.guidance_scale, **video)
        return _images_uint8((await self._run(request, params, kind="plain")).images)

    async def load_lora(self, adapter: LoraAdapter | None) -> int:
        await self.start()
        async with self._lora_lock:
            if adapter is not None and adapter.version == self._lora_version:  # re-published (a replica restart)
                return adapter.version
            if adapter is not None and adapter.version < self._lora_version:
                raise ValueError(f"adapter version {adapter.version} is older than the served version "
                                 f"{self._lora_version}: publish a newer one, or None to reset to the base model")
            if self.merge_lora:
                return await self._merge(adapter)
            if adapter is None:
                self._lora_version = 0
                return 0
            began = time.perf_counter()
            tensors, peft_config = LORA_DELIVERIES[self.recipe.lora_delivery](adapter, self.recipe)
            staged = await self._rpc("stage_lora", adapter.version, tensors, peft_config)
            if staged != len(tensors):
                raise RuntimeError(f"the worker did not stage LoRA version {adapter.version}: {staged!r}")
            self._swap_s = time.perf_counter() - began  # staged; vLLM loads it inside the next group
            self._lora_version = adapter.version
            return adapter.version

    async def _merge(self, adapter: LoraAdapter | None) -> int:
        """load_lora of a merging engine (under its lock): the adapter folded into the weights once the groups in
        flight are done (new ones wait), or the base model again (None)."""
        layers = adapter_layers(adapter) if adapter is not None else {}
        scale = adapter.alpha / adapter.rank if adapter is not None else 0.0
        async with self._swaps.swap():
            began = time.perf_counter()
            merged = await self._rpc("merge_lora", layers, scale)
            if merged != len(layers):
                raise RuntimeError(f"the worker folded {merged!r} of the adapter's {len(layers)} layers")
            self._swap_s = time.perf_counter() - began
            self._lora_version = adapter.version if adapter is not None else 0
        return self._lora_version

    async def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        if self.merge_lora:
            raise NotImplementedError("a merging vllm-omni engine serves LoRA adapters (folded into the weights "
                                      "from the checkpoint's); full-weight updates need rollout.merge_lora=false")
        if not self.recipe.weight_updates:
            raise NotImplementedError(f"full-weight updates of vllm-omni's {self.family} are not served: train a "
                                      "LoRA (published with load_lora)")
        await self.start()
        items = [(PIPELINE_PREFIX + transformer_key(k), v) for k, v in named_tensors.items()]  # vllm-omni's names
        return int(await self._rpc("update_weights", items))

    async def transformer_checksum(self) -> float:
        await self.start()
        return float(await self._rpc("transformer_checksum"))

    async def health(self) -> dict:
        return {"kind": self.kind, "family": self.family, "model": self.model_path, "started": self._omni is not None,
                "lora_version": self._lora_version, "lora_merged": self.merge_lora, "served": self._served,
                "errors": self._errors,
                "batched_groups": self.batched_groups}

    async def close(self) -> None:
        if self._omni is not None:
            self._omni.shutdown()
            self._omni = None
