"""Serve app builders: `serve run serve_config.yaml` names `deployments.builders:build_app`, whose `args:` are
the run config's `model`, `rollout` and `reward` sections plus a `serve` section (`app.config.AppConfig`); a
training run builds the same application from its own config (`RunConfig.app()`). The sections are bound whole to
the deployments, so a setting is added in one place, `app/config.py`.

One application, four deployments behind Serve's load balancer: `Rollout` (the engine replicas), `Reward`
(the composite reward, `@serve.batch`ed), `Adapters` (the published LoRA, where every rollout replica finds it;
`adapters.py`), `Api` (the HTTP ingress); and `Judge` where `reward.weights` names `vlm_judge` (the judge's model,
which the reward replicas ask: `judge.py`). Resources per replica come from the sections.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from ray import serve
from ray.serve import Application

from app.config import AppConfig, LogLevel, RewardConfig, load_app
from app.console import replica_env
from app.faults import ENV as CRASH_ENV  # tests only: crash points reach the replicas of an existing cluster
from deployments.adapters import AdapterStore
from deployments.api import ApiIngress
from deployments.api import app as fastapi_app
from deployments.auth import digest, load_keys
from deployments.judge import JudgeScorer
from deployments.reward import RewardScorer
from deployments.rollout import RolloutReplica

APP_NAME = "flowgrpo"
INGRESS_MAX_ONGOING = 1024  # HTTP requests one ingress replica holds at once (each only awaits a replica)
# replicas share few cores: one torch/OpenMP thread each (oversubscription made a 0.04 s generation take 1.8 s)
_SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                      "HF_HUB_OFFLINE": "1"}


class _ServedRollout(RolloutReplica):
    async def __init__(self, *args, **kwargs):  # Ray actors may have an async constructor: start the engine now
        RolloutReplica.__init__(self, *args, **kwargs)
        await self.start()


class _ServedReward(RewardScorer):
    def __init__(self, reward: RewardConfig, *, torch_threads: int, log_level: str, judge=None):
        super().__init__(reward, torch_threads=torch_threads, log_level=log_level, judge=judge)
        self._score_one.set_max_batch_size(reward.max_batch_size)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.02)
    async def _score_one(self, batches: list[tuple]) -> list:  # concurrent groups scored in one call
        return await self.score_batch(batches)


class _ServedJudge(JudgeScorer):
    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.02)
    async def _score_one(self, batches: list[tuple]) -> list:  # concurrent groups read in one pass
        return await self.score_batch(batches)


def _resolved(args: Mapping | AppConfig) -> tuple[AppConfig, dict]:
    """The application's sections as its replicas get them (the model path absolute: replicas do not share the
    caller's working directory) and the environment variables they start with."""
    config = load_app(args)
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, path=str(Path(config.model.path).expanduser().resolve())))
    log_level = str(config.serve.log_level or LogLevel.INFO)
    env = {**_SINGLE_THREAD_ENV, **replica_env(log_level),
           **({CRASH_ENV: os.environ[CRASH_ENV]} if CRASH_ENV in os.environ else {})}
    return config, env


def app_fingerprint(args: Mapping | AppConfig) -> str:
    """What the application's replicas are built from, hashed: its sections and their environment. A running
    application with the fingerprint of a new one serves exactly what deploying the new one would start (a job
    reuses it instead of reloading every model, `jobs.train.deploy_serve_app`)."""
    return _digest(*_resolved(args))


def _digest(config: AppConfig, env: dict) -> str:
    text = json.dumps({"app": dataclasses.asdict(config), "env": env}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_app(args: Mapping | AppConfig) -> Application:
    """Rollout + reward + adapter store + HTTP ingress, as one Serve application. `args`: an `AppConfig`, or
    serve_config.yaml's `args:` mapping (validated like a run config: a bad key or value names itself)."""
    config, env_vars = _resolved(args)
    model, rollout, reward, settings = config.model, config.rollout, config.reward, config.serve
    if model.build_tiny:
        from app.models.family import get_family

        get_family(model.family).build_tiny(model.path, seed=model.tiny_seed)  # here, once, before any replica starts
    log_level = str(settings.log_level or LogLevel.INFO)
    env = {"env_vars": env_vars}
    logging_config = {"log_level": log_level, "enable_access_log": log_level in ("DEBUG", "INFO")}
    # one replica, no resources to speak of; many small concurrent reads when replicas start or resync, and every
    # pipelined trainer rank waiting for the next version (`wait_for`) while it trains
    adapters = serve.deployment(AdapterStore, name="Adapters", num_replicas=1, max_ongoing_requests=1024,
                                logging_config=logging_config,
                                ray_actor_options={"num_cpus": 0}).bind(fingerprint=_digest(config, env_vars))
    rollout_app = serve.deployment(
        _ServedRollout, name="Rollout", num_replicas=rollout.num_replicas,
        max_ongoing_requests=rollout.max_ongoing_requests, max_queued_requests=settings.max_queued_requests,
        health_check_period_s=30,
        health_check_timeout_s=60, logging_config=logging_config,
        ray_actor_options={"num_cpus": rollout.replica_num_cpus, "num_gpus": rollout.replica_num_gpus,
                           "runtime_env": env,
                           **({"resources": dict(rollout.replica_resources)} if rollout.replica_resources else {})},
    ).bind(model, rollout, adapters=adapters, torch_threads=settings.replica_torch_threads)
    judge = None
    if "vlm_judge" in reward.weights:  # the judge's model loads in its own replicas, which the reward replicas ask
        section = reward.vlm_judge
        judge = serve.deployment(
            _ServedJudge, name="Judge", num_replicas=section.num_replicas, max_ongoing_requests=16,
            logging_config=logging_config,
            ray_actor_options={"num_cpus": section.replica_num_cpus, "num_gpus": section.replica_num_gpus,
                               "runtime_env": env},
        ).bind(section, torch_threads=settings.replica_torch_threads)
    reward_app = serve.deployment(
        _ServedReward, name="Reward", num_replicas=reward.num_replicas,
        max_ongoing_requests=4 * reward.max_batch_size, max_queued_requests=settings.max_queued_requests,
        logging_config=logging_config,
        ray_actor_options={"num_cpus": reward.replica_num_cpus, "num_gpus": reward.replica_num_gpus,
                           "runtime_env": env},
    ).bind(reward, torch_threads=settings.replica_torch_threads, log_level=log_level, judge=judge)
    # the ingress only awaits the replicas: it takes every request in, so that the bound on the rollout and reward
    # queues (serve.max_queued_requests) answers a flood with 503s instead of a queue at Serve's proxy
    ingress = serve.deployment(serve.ingress(fastapi_app)(ApiIngress), name="Api", logging_config=logging_config,
                               max_ongoing_requests=INGRESS_MAX_ONGOING,
                               ray_actor_options={"num_cpus": settings.api_num_cpus})
    key_digests = [digest(key) for key in load_keys(settings)]  # read here, where `serve run` runs
    return ingress.bind(rollout_app, reward_app, adapters, sampling=rollout, limits=settings, family=model.family,
                        key_digests=key_digests)
