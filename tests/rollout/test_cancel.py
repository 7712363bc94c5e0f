"""A group whose caller gives up (an HTTP client that disconnected: Serve cancels the replica's call) stops at its
next denoising step in the in-process engines, or before it starts when it still waits its turn, so the replica's
next group starts at once instead of after a group nobody waits for. Measured with the tiny Qwen-Image on plain
diffusers: the denoiser forwards each group made, in order, by their batch size."""

import asyncio
import time

import pytest

from app.types import GenerationRequest

HEAVY_STEPS = 64


def request(n: int, steps: int, side: int, seed: int) -> GenerationRequest:
    return GenerationRequest('a sign that says "STOP"', n=n, height=side, width=side, num_inference_steps=steps,
                             noise_level=0.7, sde_type="sde", seed=seed)


@pytest.fixture
def forwards(diffusers_engine):
    """(time, batch size) of every denoiser forward while the test runs."""
    seen = []
    handle = diffusers_engine.trained_module().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((time.perf_counter(), kwargs["hidden_states"].shape[0])),
        with_kwargs=True)
    yield seen
    handle.remove()


async def heavy_then_light(engine, forwards: list, cancel: bool) -> tuple[float, asyncio.Task]:
    """A heavy group (8 images, 64 steps), then a light one (1 image, 2 steps) asked while it runs; the heavy one
    cancelled first if `cancel`. Seconds from the light one's request to its answer, and the heavy task."""
    heavy = asyncio.create_task(engine.generate(request(8, HEAVY_STEPS, 128, seed=1)))
    while sum(size == 8 for _, size in forwards) < 2:  # the heavy group is denoising
        await asyncio.sleep(0.001)
    if cancel:
        heavy.cancel()
    asked = time.perf_counter()
    await engine.generate(request(1, 2, 64, seed=2))
    return time.perf_counter() - asked, heavy


def test_a_cancelled_group_stops_at_its_next_step_and_the_next_group_starts(diffusers_engine, forwards, aio):
    before = (aio(diffusers_engine.health()))["cancelled"]
    waited, heavy = aio(heavy_then_light(diffusers_engine, forwards, cancel=True))
    assert heavy.cancelled()
    sizes = [size for _, size in forwards]
    first_light = sizes.index(1)
    assert 2 <= sizes[:first_light].count(8) < HEAVY_STEPS  # stopped midway...
    assert 8 not in sizes[first_light:]  # ... for good: no heavy step after the light group started
    assert aio(diffusers_engine.health())["cancelled"] == before + 1
    forwards.clear()
    waited_uncancelled, heavy = aio(heavy_then_light(diffusers_engine, forwards, cancel=False))
    assert [size for _, size in forwards].count(8) == HEAVY_STEPS and heavy.done() and not heavy.cancelled()
    print(f"the next group's answer after its request: {waited:.2f} s with the first group cancelled, "
          f"{waited_uncancelled:.2f} s behind it uncancelled")


def test_a_cancelled_group_that_waits_its_turn_never_runs(diffusers_engine, forwards, aio):
    async def run():
        first = asyncio.create_task(diffusers_engine.generate(request(8, HEAVY_STEPS, 128, seed=3)))
        while sum(size == 8 for _, size in forwards) < 2:  # the first group is denoising, the second waits
            await asyncio.sleep(0.001)
        waiting = asyncio.create_task(diffusers_engine.generate(request(4, 4, 64, seed=4)))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await first
        await diffusers_engine.generate(request(1, 2, 64, seed=5))  # after it: the engine serves on

    aio(run())
    sizes = [size for _, size in forwards]
    assert sizes.count(8) == HEAVY_STEPS and 4 not in sizes and sizes[-2:] == [1, 1]
