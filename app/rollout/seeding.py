"""Per-sample noise generators: image j of a group seeded `seed` draws all its noise (initial latent, then one
draw per SDE step) from its own generator, derived from (seed, j).

So a group is reproducible from its seed however it was batched: with other requests, as one request of n
images, or as n requests of one image (`GenerationRequest.sample_offset`). Group members differ because their
generators do.
"""

import numpy as np
import torch


def derived_seed(*keys: int) -> int:
    """A 63-bit seed mixed from `keys` by numpy's SeedSequence (distinct keys: no overlaps in practice); no keys: a
    fresh one from the OS."""
    return int(np.random.SeedSequence(list(keys) or None).generate_state(1, np.uint64)[0] >> np.uint64(1))


def sample_seed(seed: int, index: int) -> int:
    """The seed of image `index` of the group seeded `seed`."""
    return derived_seed(seed, index)


def sample_generators(seed: int, offset: int, n: int, device: str | torch.device = "cpu") -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(sample_seed(seed, offset + j)) for j in range(n)]


def draw_seed() -> int:
    """A fresh group seed when the request gave none (recorded in the Trajectory)."""
    return derived_seed()
