"""Which prompts each training step uses, and the rollout request of each prompt group.

The order is a pure function of (seed, step): a seeded permutation per pass over the prompts, so the data
position of a run is just the number of groups drawn so far, and a resumed run sees exactly the prompts the
uninterrupted run would have seen. The prompt sets themselves: `app.prompt_sets`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from app.prompt_sets import EditPrompt, Prompt
from app.rollout.seeding import derived_seed

if TYPE_CHECKING:
    from app.config import RolloutConfig
    from app.types import GenerationRequest


def step_prompts(prompts: list[Prompt], step: int, groups_per_step: int, *, seed: int,
                 shuffle: bool = True) -> list[tuple[int, Prompt]]:
    """The (global group index, prompt) pairs of one optimizer step, over all workers.

    Group g is the g-th prompt drawn since the start of the run; pass e = g // len(prompts) visits the prompts in
    a permutation seeded by (seed, e) (in file order without shuffle).
    """
    out = []
    for g in range(step * groups_per_step, (step + 1) * groups_per_step):
        epoch, position = divmod(g, len(prompts))
        order = (np.random.default_rng([seed, epoch]).permutation(len(prompts)) if shuffle
                 else np.arange(len(prompts)))
        out.append((g, prompts[int(order[position])]))
    return out


def group_seed(seed: int, group: int) -> int:
    """The rollout seed of global group `group` (63-bit, SeedSequence-mixed, distinct per group)."""
    return derived_seed(seed, group, 0x5EED)


def group_request(rollout: RolloutConfig, prompt: Prompt, group: int, *, seed: int, step: int = 0,
                  lora_version: int | None = None) -> GenerationRequest:
    """The request for global group `group` of a run seeded `seed`, trained at step `step`: sampled as the
    rollout section says (its SDE window placed for this group and step), seeded per group, and asking for adapter
    `lora_version` (an edit prompt's request carries its image)."""
    import torch

    edit = {"image": torch.from_numpy(prompt.image)} if isinstance(prompt, EditPrompt) else {}
    window = rollout.sde_window.window(rollout.num_inference_steps, seed=seed, group=group, step=step)
    return rollout.request(str(prompt), seed=group_seed(seed, group), group_id=group, lora_version=lora_version,
                           sde_window=window, **edit)
