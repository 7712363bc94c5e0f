"""GenerationRequest validates at construction (before any engine is touched); Trajectory checks its shapes."""

import pytest
import torch

from app.rollout.seeding import sample_generators, sample_seed
from app.types import GenerationRequest, LoraAdapter, RequestError, Trajectory

SAMPLING = dict(n=2, height=64, width=64, num_inference_steps=4, noise_level=0.7, sde_type="sde")


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", -2), ("n", 10_000), ("n", 2.5),
    ("height", 100), ("width", 8), ("height", "64"),
    ("num_inference_steps", 1), ("num_inference_steps", 0),
    ("prompt", ""), ("prompt", "   "), ("prompt", None),
    ("noise_level", -0.1), ("noise_level", float("nan")),
    ("sde_type", "ddim"),
    ("guidance_scale", 0.5), ("seed", -1), ("sample_offset", -1),
])
def test_invalid_request_names_the_field(field, value):
    kwargs = dict(prompt="a red cube", **SAMPLING) | {field: value}
    with pytest.raises(RequestError, match=f"^{field}=") as error:
        GenerationRequest(**kwargs)
    assert error.value.field == field and isinstance(error.value, ValueError)  # callers that catch ValueError


def test_a_request_error_crosses_processes_whole():
    """Ray pickles a replica's exception to re-raise it at the caller: the field and value come back, not only
    the message."""
    import pickle

    with pytest.raises(RequestError) as error:
        GenerationRequest("a cat", **SAMPLING | {"height": 100})
    again = pickle.loads(pickle.dumps(error.value))
    assert (type(again), again.field, again.value, str(again)) == (RequestError, "height", 100, str(error.value))


def test_cfg_needs_a_negative_prompt():
    with pytest.raises(ValueError, match="negative_prompt"):
        GenerationRequest("a cat", guidance_scale=4.0, **SAMPLING)
    assert GenerationRequest("a cat", guidance_scale=4.0, negative_prompt=" ", **SAMPLING).do_cfg


def test_sample_seeds_are_deterministic_and_distinct():
    assert sample_seed(7, 0) == sample_seed(7, 0)
    assert len({sample_seed(7, j) for j in range(100)} | {sample_seed(8, j) for j in range(100)}) == 200
    a, b = sample_generators(7, 0, 2), sample_generators(7, 1, 1)
    assert torch.equal(torch.randn(3, generator=a[1]), torch.randn(3, generator=b[0]))


def _traj(**changes):
    n, steps, tokens, channels = 2, 3, 4, 8
    fields = dict(prompt="p", group_id=None, images=torch.zeros(n, 16, 16, 3, dtype=torch.uint8),
                  latents=torch.zeros(n, steps + 1, tokens, channels), log_probs=torch.zeros(n, steps),
                  timesteps=torch.zeros(steps), sigmas=torch.zeros(steps + 1), prompt_embeds=torch.zeros(5, 6),
                  prompt_mask=torch.ones(5),
                  noise_level=0.7, sde_type="sde", seed=0, lora_version=0, height=16, width=16)
    return Trajectory(**(fields | changes))


def test_trajectory_checks_its_shapes():
    assert _traj().group_size == 2 and _traj().num_inference_steps == 3
    with pytest.raises(ValueError, match="log_probs"):
        _traj(log_probs=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="negative_prompt_embeds"):
        _traj(guidance_scale=4.0)


def test_lora_adapter_validation():
    with pytest.raises(ValueError, match="version"):
        LoraAdapter({}, rank=4, alpha=4, target_modules=["to_q"], version=0)
    with pytest.raises(ValueError, match="lora_A"):
        LoraAdapter({"x.weight": torch.zeros(1)}, rank=4, alpha=4, target_modules=["to_q"], version=1)


def test_a_packed_adapter_unpacks_to_the_same_tensors():
    tensors = {"blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 6),
               "blocks.0.attn.to_q.lora_B.weight": torch.randn(6, 4),
               "blocks.1.attn.to_v.lora_A.weight": torch.randn(3, 5).to(torch.bfloat16)}  # 30 bytes: odd alignment
    adapter = LoraAdapter(tensors, rank=4, alpha=8, target_modules=["to_q", "to_v"], version=7)
    packed = adapter.packed()
    assert packed.buffer.dtype.name == "uint8" and packed.buffer.ndim == 1
    back = packed.unpack()
    assert (back.version, back.rank, back.alpha, back.target_modules) == (7, 4, 8, ["to_q", "to_v"])
    for name, tensor in tensors.items():
        assert back.tensors[name].dtype == tensor.dtype and torch.equal(back.tensors[name], tensor)
    # in the replicas' dtype: half the bytes of fp32, each value rounded as a cast would
    half = adapter.packed(torch.bfloat16)
    assert half.nbytes < packed.nbytes
    for name, tensor in half.unpack().tensors.items():
        assert torch.equal(tensor, tensors[name].to(torch.bfloat16))
    back.tensors[next(iter(tensors))].add_(1)  # the unpacked tensors are its own, not views of the buffer
    assert torch.equal(packed.unpack().tensors[next(iter(tensors))], tensors[next(iter(tensors))])


@pytest.mark.parametrize("field,value,why", [
    ("image", torch.zeros(32, 32, 3), "uint8"),
    ("image", torch.zeros(32, 32, dtype=torch.uint8), "uint8"),
    ("image", torch.zeros(8, 32, 3, dtype=torch.uint8), "at least 16x16"),
    ("image_guidance_scale", 0.5, ">= 1"),
    ("cfg_interval", (0.5, 0.4), "lo < hi"),
    ("cfg_interval", (0.0, 1.5), "lo < hi"),
    ("cfg_renorm", "per_pixel", "one of"),
    ("cfg_renorm_min", 2.0, "in \\[0, 1\\]"),
    ("timestep_shift", 0.0, "> 0"),
])
def test_invalid_bagel_settings_name_the_field(field, value, why):
    with pytest.raises(RequestError, match=f"^{field}=.*{why}") as error:
        GenerationRequest("a cat", **SAMPLING, **{field: value})
    assert error.value.field == field


@pytest.mark.parametrize("window", [(2, 2), (-1, 1), (0, 99), (0.5, 2), [1, 2, 3]])
def test_an_sde_window_must_lie_in_the_trajectory(window):
    with pytest.raises(ValueError, match="^sde_window=.*num_inference_steps"):
        GenerationRequest("a cat", **SAMPLING, sde_window=window)


def test_an_sde_window_sets_each_step_s_noise_level():
    request = GenerationRequest("a cat", **SAMPLING | {"num_inference_steps": 4}, sde_window=[1, 3])
    assert request.sde_window == (1, 3)  # a list (JSON, a config) arrives as a tuple
    assert request.step_noise_levels == [0.0, request.noise_level, request.noise_level, 0.0]


def test_an_edit_request_and_a_bagel_trajectory():
    image = torch.zeros(40, 24, 3, dtype=torch.uint8)
    assert GenerationRequest("make it blue", **SAMPLING, image=image).is_edit
    assert GenerationRequest("a cat", guidance_scale=4.0, negative_prompt="", **SAMPLING).do_cfg  # "" is allowed
    ids = torch.tensor([1, 2, 3])
    bagel = _traj(family="bagel", prompt_embeds=None, prompt_mask=None, conditioning={"prompt_ids": ids},
                  guidance_scale=4.0)
    assert "conditioning.prompt_ids" in bagel.tensors() and "prompt_embeds" not in bagel.tensors()
    with pytest.raises(ValueError, match="prompt_ids"):
        _traj(family="bagel", prompt_embeds=None, prompt_mask=None, conditioning={"edit_grid": ids})
    with pytest.raises(ValueError, match="must carry its conditioning"):  # neither form
        _traj(family="bagel", prompt_embeds=None, prompt_mask=None, conditioning={})


@pytest.mark.gpu
def test_a_packed_adapter_unpacks_onto_a_gpu_while_the_default_stream_is_busy():
    """The copy runs on a stream of its own (the replica's generation queues kernels on the default stream); the
    tensors are whole when `unpack` returns, and the default stream reads them as they are."""
    tensors = {"blocks.0.attn.to_q.lora_A.weight": torch.randn(64, 3072),
               "blocks.0.attn.to_q.lora_B.weight": torch.randn(3072, 64)}
    packed = LoraAdapter(tensors, rank=64, alpha=64, target_modules=["to_q"], version=3).packed()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):  # a queue of work on the default stream
        busy = busy @ busy / 4096**0.5
    back = packed.unpack("cuda")
    for name, tensor in tensors.items():
        assert back.tensors[name].is_cuda and torch.equal(back.tensors[name].cpu(), tensor)
    torch.cuda.synchronize()


def _video_traj() -> Trajectory:
    request = GenerationRequest("a cat walks", height=32, width=48, num_frames=5, num_inference_steps=3, n=2,
                                noise_level=0.7, sde_type="sde", guidance_scale=2.0, negative_prompt=" ")
    return Trajectory.sampled(
        request, seed=3, lora_version=1, family="wan",
        images=torch.randint(0, 256, (2, 5, 32, 48, 3), dtype=torch.uint8), latents=torch.randn(2, 4, 16, 2, 4, 6),
        log_probs=torch.randn(2, 3), timesteps=torch.rand(3), sigmas=torch.rand(4), prompt_embeds=torch.randn(7, 8),
        prompt_mask=torch.ones(7, dtype=torch.long), negative_prompt_embeds=torch.randn(7, 8),
        negative_prompt_mask=torch.ones(7, dtype=torch.long), conditioning={"expand_timesteps": torch.tensor(True)},
        producer={"replica": "r1"})


def test_a_video_trajectory_checks_its_frames_and_says_what_it_weighs():
    traj = _video_traj()
    assert traj.is_video and traj.nbytes == sum(t.nbytes for t in traj.tensors().values())
    with pytest.raises(ValueError, match=r"images \(2, 32, 48, 3\) torch.uint8 must be uint8 \[2, 5, 32, 48, 3\]"):
        Trajectory.sampled(GenerationRequest("a", height=32, width=48, num_frames=5, num_inference_steps=3, n=2,
                                             noise_level=0.7, sde_type="sde"), seed=0, lora_version=0,
                           images=torch.zeros(2, 32, 48, 3, dtype=torch.uint8), latents=traj.latents,
                           log_probs=traj.log_probs, timesteps=traj.timesteps, sigmas=traj.sigmas,
                           prompt_embeds=traj.prompt_embeds, prompt_mask=traj.prompt_mask)


def test_a_trajectory_pickles_its_tensors_out_of_band_and_comes_back_whole():
    """Pickle 5 (Ray's) carries every tensor byte as an out-of-band buffer: the pickle itself holds only the
    scalars, and the rebuilt trajectory equals the sent one, field for field."""
    import pickle

    traj = _video_traj()
    buffers = []
    raw = pickle.dumps(traj, protocol=5, buffer_callback=buffers.append)
    assert sum(b.raw().nbytes for b in buffers) == traj.nbytes and len(raw) < 2000
    back = pickle.loads(raw, buffers=buffers)
    for name, tensor in traj.tensors().items():
        assert torch.equal(back.tensors()[name], tensor) and back.tensors()[name].dtype == tensor.dtype, name
    assert (back.num_frames, back.producer, back.guidance_scale, back.seed) == (5, {"replica": "r1"}, 2.0, 3)
    bf16 = _traj(prompt_embeds=torch.randn(5, 6, dtype=torch.bfloat16))  # numpy has no bfloat16: torch pickles it
    assert torch.equal(pickle.loads(pickle.dumps(bf16, protocol=5)).prompt_embeds, bf16.prompt_embeds)
