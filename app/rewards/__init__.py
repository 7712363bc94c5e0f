"""Rewards: each scores a batch of images against their prompts; `build_reward` makes the weighted composite."""

from app.rewards.base import Reward, RewardScores
from app.rewards.composite import WeightedReward, build_reward

__all__ = ["Reward", "RewardScores", "WeightedReward", "build_reward"]
