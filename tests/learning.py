"""FlowGRPO in one process, without Ray, from the project's parts (an in-process engine, the policy, the update
pass, a reward: JPEG compressibility unless told): the learning checks' loop. Each step samples `groups` prompt
groups, scores them, takes one update, and hands the new adapter to the engine. The loop around the same parts with
Ray is the job (tests/test_train_job*.py).

`staleness=k` samples step s with the adapter of step s − k (the base model for the first k steps), as the pipelined
job does with `train.max_staleness: k` (the next k steps' groups generate while one trains): the update then takes
its importance ratio against those older log-probs."""

from __future__ import annotations

import dataclasses

import torch

from app.algo.advantages import step_advantages
from app.config import RunConfig
from app.metrics import Stats
from app.prompt_sets import load_prompts
from app.rewards.jpeg import JpegCompressibilityReward
from app.train.policy import Policy
from app.train.prompts import group_request, step_prompts
from app.train.update import train_pass


def reward_curve(engine, model_dir, config: RunConfig, *, seed: int, lr: float, steps: int,
                 staleness: int = 0, stats: Stats | None = None, reward=None) -> list[float]:
    """Mean reward of each step's images (`reward`: anything with `score(images, prompts)`; default JPEG
    compressibility), training as `config` says (its model, rollout, train and data sections, the SDE window
    included; lr and steps as given; prompts in order). `stats` collects the update's metrics (e.g.
    `actor/ratio_dev_stale_max`)."""
    model, rollout = config.model, config.rollout
    train = dataclasses.replace(config.train, learning_rate=lr, seed=seed)
    policy = Policy.from_pretrained(model_dir, lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
                                    target_modules=model.lora_targets, family=str(model.family), shard=False,
                                    seed=seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=train.weight_decay)
    pool, curve = load_prompts(config.data.prompts), []
    reward = reward if reward is not None else JpegCompressibilityReward()
    adapters = {0: None}  # version -> the adapter exported after that many updates
    stats = stats if stats is not None else Stats()
    try:
        for step in range(steps):
            engine._load_lora(adapters[max(0, step - staleness)])
            trajs = [engine.sample(group_request(rollout, prompt, group, seed=seed, step=step))
                     for group, prompt in step_prompts(pool, step, train.groups_per_step, seed=seed, shuffle=False)]
            totals = {t.group_id: reward.score(t.images.numpy(), [t.prompt] * t.group_size) for t in trajs}
            advantages, _ = step_advantages(totals)
            curve.append(sum(sum(r) for r in totals.values()) / sum(t.group_size for t in trajs))
            train_pass(policy, optimizer, train, step=step, epoch=0, trajectories=trajs,
                       advantages=[advantages[t.group_id] for t in trajs], old=[t.log_probs for t in trajs],
                       stats=stats, mismatch=Stats(), policy_version=step)
            adapters[step + 1] = policy.export_adapter(version=step + 1)
            adapters.pop(step - staleness, None)  # sampled from for the last time this step
    finally:
        engine._load_lora(None)
    return curve


def gain(curve: list[float]) -> float:
    """Mean reward of the last 4 steps minus that of the first 4."""
    return sum(curve[-4:]) / 4 - sum(curve[:4]) / 4
