"""Typed Serve app builders: `serve run serve_config.yaml` names `deployments.builders:build_app` with `args:`;
the trainer builds the same application from its run config (`app_args_from_config`).

One application, four deployments behind Serve's load balancer: `Rollout` (the engine replicas), `Reward`
(the composite reward, `@serve.batch`ed), `Adapters` (the published LoRA, where every rollout replica finds it;
`adapters.py`), `Api` (the HTTP ingress). Resources per replica come from the args.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from ray import serve
from ray.serve import Application

from app.console import replica_env
from app.rewards.ocr import DETECT_MIN_SIDE
from deployments.adapters import AdapterStore
from deployments.api import ApiIngress, ApiLimits, GenerationDefaults
from deployments.api import app as fastapi_app
from deployments.reward import RewardScorer
from deployments.rollout import RolloutReplica

APP_NAME = "flowgrpo"
# replicas share few cores: one torch/OpenMP thread each (oversubscription made a 0.04 s generation take 1.8 s)
_SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                      "HF_HUB_OFFLINE": "1"}


class FlowGRPOAppArgs(BaseModel):
    """Arguments of the Serve application (the `args:` of serve_config.yaml)."""

    model_path: str = Field(description="diffusers-layout checkpoint folder")
    build_tiny: bool = Field(False, description="build the deterministic tiny checkpoint at model_path if absent")
    engine: Literal["vllm_omni", "diffusers"] = "vllm_omni"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    rollout_replicas: int = Field(1, ge=1)
    rollout_num_cpus: float = Field(1.0, gt=0)
    rollout_num_gpus: float = Field(0.0, ge=0)
    # concurrent groups a replica accepts; vllm-omni queues and batches them (max_num_seqs per forward)
    rollout_max_ongoing_requests: int = Field(4, ge=1)
    max_num_seqs: int = Field(1, ge=1)
    batched_groups: bool = True
    torch_threads: int = Field(1, ge=1)
    # replicas' log level (Serve and vllm); "WARNING" also drops Serve's per-request access log
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    reward_weights: dict[str, float] = Field(default_factory=lambda: {"ocr": 1.0})
    # the OCR detector enlarges images whose shorter side is below this (RapidOCR's 736); lower it for small images
    ocr_detect_min_side: int = Field(DETECT_MIN_SIDE, ge=32)
    reward_replicas: int = Field(1, ge=1)
    reward_num_cpus: float = Field(1.0, gt=0)
    reward_max_batch_size: int = Field(8, ge=1)
    api_num_cpus: float = Field(0.25, gt=0)
    limits: ApiLimits = Field(default_factory=ApiLimits)
    defaults: GenerationDefaults = Field(default_factory=GenerationDefaults)


class _ServedRollout(RolloutReplica):
    async def __init__(self, *args, **kwargs):  # Ray actors may have an async constructor: start the engine now
        RolloutReplica.__init__(self, *args, **kwargs)
        await self.start()


class _ServedReward(RewardScorer):
    def __init__(self, weights: dict[str, float], options: dict[str, dict], max_batch_size: int, torch_threads: int,
                 log_level: str):
        super().__init__(weights, options=options, torch_threads=torch_threads, log_level=log_level)
        self._score_one.set_max_batch_size(max_batch_size)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.02)
    async def _score_one(self, batches: list[tuple]) -> list:  # concurrent groups scored in one call
        return await self.score_batch(batches)


def build_app(args: FlowGRPOAppArgs) -> Application:
    """Rollout + reward + HTTP ingress, as one Serve application."""
    if isinstance(args, dict):
        args = FlowGRPOAppArgs(**args)
    # replicas do not share the caller's working directory: hand them an absolute path
    args = args.model_copy(update={"model_path": str(Path(args.model_path).expanduser().resolve())})
    if args.build_tiny:
        from app.models.tiny import build_tiny_qwen_image

        build_tiny_qwen_image(args.model_path)  # here, once, before any replica starts
    env = {"env_vars": {**_SINGLE_THREAD_ENV, **replica_env(args.log_level)}}
    logging_config = {"log_level": args.log_level, "enable_access_log": args.log_level in ("DEBUG", "INFO")}
    # one replica, no resources to speak of; many small concurrent reads when replicas start or resync
    adapters = serve.deployment(AdapterStore, name="Adapters", num_replicas=1, max_ongoing_requests=64,
                                logging_config=logging_config, ray_actor_options={"num_cpus": 0}).bind()
    rollout = serve.deployment(
        _ServedRollout, name="Rollout", num_replicas=args.rollout_replicas,
        max_ongoing_requests=args.rollout_max_ongoing_requests, health_check_period_s=30,
        health_check_timeout_s=60, logging_config=logging_config,
        ray_actor_options={"num_cpus": args.rollout_num_cpus, "num_gpus": args.rollout_num_gpus,
                           "runtime_env": env},
    ).bind(args.model_path, adapters=adapters, engine=args.engine, dtype=args.dtype, batched_groups=args.batched_groups,
           max_num_seqs=args.max_num_seqs, torch_threads=args.torch_threads)
    reward = serve.deployment(
        _ServedReward, name="Reward", num_replicas=args.reward_replicas,
        max_ongoing_requests=4 * args.reward_max_batch_size, logging_config=logging_config,
        ray_actor_options={"num_cpus": args.reward_num_cpus, "runtime_env": env},
    ).bind(args.reward_weights, {"ocr": {"detect_min_side": args.ocr_detect_min_side}}, args.reward_max_batch_size,
           args.torch_threads, args.log_level)
    ingress = serve.deployment(serve.ingress(fastapi_app)(ApiIngress), name="Api", logging_config=logging_config,
                               ray_actor_options={"num_cpus": args.api_num_cpus})
    return ingress.bind(rollout, reward, args.limits, args.defaults, adapters)


def app_args_from_config(config, *, log_level: str = "INFO") -> FlowGRPOAppArgs:
    """The application a training run deploys, from its RunConfig."""
    m, r, w = config.model, config.rollout, config.reward
    return FlowGRPOAppArgs(
        model_path=m.path, build_tiny=m.build_tiny, dtype=m.dtype, engine=r.engine, rollout_replicas=r.num_replicas,
        rollout_num_cpus=r.replica_num_cpus, rollout_num_gpus=r.replica_num_gpus,
        rollout_max_ongoing_requests=r.max_ongoing_requests, batched_groups=r.batched_groups,
        reward_weights=dict(w.weights), ocr_detect_min_side=w.ocr_detect_min_side, reward_replicas=w.num_replicas,
        reward_num_cpus=w.replica_num_cpus, log_level=log_level,
        defaults=GenerationDefaults(size=f"{r.width}x{r.height}", num_inference_steps=r.num_inference_steps,
                                    noise_level=r.noise_level, sde_type=r.sde_type, guidance=r.guidance_scale,
                                    negative_prompt=r.negative_prompt),
        limits=ApiLimits(max_n=max(16, r.group_size), max_side=max(1024, r.height, r.width),
                         max_steps=max(50, r.num_inference_steps)))
