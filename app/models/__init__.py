"""Model families: how each encodes prompts, packs latents and runs its transformer for training."""
