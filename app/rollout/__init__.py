"""Rollout: the records passed between rollout, reward and trainer, and the engines that produce them."""
