"""The trained policy: it scores exactly the steps the vllm-omni rollout took, its reference is the base model,
its adapter round-trips through diffusers' LoRA loader, and FSDP2 over two Ray Train workers computes the same
update as one unsharded float64 process."""

import dataclasses
import sys

import pytest
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

from app.models.lora import random_lora
from app.models.qwen_image import model as qwen_image
from app.train.policy import Policy, load_adapter_tensors
from app.types import GenerationRequest

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
PARITY_TOL = 1e-5  # fp32 on CPU: the rollout's and the trainer's log-probs agree to this (in practice exactly)


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    return random_lora(transformer, version=1, rank=4, target_modules=TARGETS, seed=11, scale=0.5)


@pytest.fixture(scope="module")
def rollout(vllm_engine, aio, adapter):
    """A group sampled by the real vllm-omni engine with the adapter loaded (the engine is reset afterwards)."""
    served = dataclasses.replace(adapter, version=vllm_engine.lora_version + 1)
    aio(vllm_engine.load_lora(served))
    try:
        return aio(vllm_engine.generate(GenerationRequest('a sign that says "RL"', n=4, height=64, width=64,
                                                          num_inference_steps=3, noise_level=0.7, sde_type="sde",
                                                          seed=5)))
    finally:
        aio(vllm_engine.load_lora(None))


def make_policy(model_dir, adapter, **kwargs) -> Policy:
    return Policy.from_pretrained(model_dir, lora_rank=4, lora_alpha=4, target_modules=TARGETS,
                                  adapter_tensors=adapter.tensors, shard=False, **kwargs)


def test_policy_scores_the_rollout_steps_exactly(tiny_model_dir, adapter, rollout):
    assert rollout.lora_version >= 1
    policy = make_policy(tiny_model_dir, adapter)
    with torch.no_grad():
        outs = policy.score(rollout, range(rollout.num_inference_steps), samples=range(4))
    log_probs = torch.stack([o.log_prob for o in outs], dim=1)  # [4, T]
    diff = (log_probs - rollout.log_probs).abs().max().item()
    assert diff <= PARITY_TOL, diff
    fresh = Policy.from_pretrained(tiny_model_dir, lora_rank=4, lora_alpha=4, target_modules=TARGETS, shard=False)
    with torch.no_grad():  # a freshly initialised LoRA (B = 0) is the base model, not the rollout's adapter
        base = fresh.score(rollout, range(3), range(4))
    moved = [(a.prev_sample_mean - b.prev_sample_mean).abs().max().item() for a, b in zip(outs, base, strict=True)]
    assert max(moved) > 1e-3


def test_reference_is_the_base_model_and_the_adapter_comes_back(tiny_model_dir, adapter, rollout):
    policy = make_policy(tiny_model_dir, adapter)
    base = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    with torch.no_grad():
        (tuned,) = policy.score(rollout, [1], [0, 1])
        with policy.reference():
            (ref,) = policy.score(rollout, [1], [0, 1])
        (again,) = policy.score(rollout, [1], [0, 1])
        (plain,) = qwen_image.score_trajectory(base, rollout, [1], samples=[0, 1])
    assert torch.equal(ref.prev_sample_mean, plain.prev_sample_mean)
    assert (tuned.prev_sample_mean - ref.prev_sample_mean).abs().max() > 1e-3
    assert torch.equal(again.prev_sample_mean, tuned.prev_sample_mean)


def test_adapter_exports_and_loads_in_diffusers(tiny_model_dir, adapter, rollout, tmp_path):
    policy = make_policy(tiny_model_dir, adapter)
    exported = policy.export_adapter(version=7)
    assert exported.version == 7 and exported.rank == 4 and exported.target_modules == sorted(TARGETS)
    assert exported.tensors.keys() == adapter.tensors.keys()
    assert all(torch.equal(exported.tensors[k], adapter.tensors[k]) for k in adapter.tensors)
    assert not any("flowgrpo" in k or "base_layer" in k for k in exported.tensors)  # adapter tensors only
    travelling = policy.export_adapter(version=7, dtype=torch.bfloat16)  # cast before the copy to the host
    assert all(travelling.tensors[k].dtype == torch.bfloat16 for k in adapter.tensors)
    assert all(torch.equal(travelling.tensors[k], adapter.tensors[k].to(torch.bfloat16)) for k in adapter.tensors)

    policy.save_adapter(tmp_path)
    loaded = load_adapter_tensors(tmp_path)
    assert loaded.keys() == adapter.tensors.keys() and all(torch.equal(loaded[k], adapter.tensors[k]) for k in loaded)
    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir)
    pipe.load_lora_weights(str(tmp_path))  # what a diffusers user does with the checkpoint's adapter folder
    with torch.no_grad():
        (ours,) = policy.score(rollout, [2], [0, 1, 2, 3])
        (theirs,) = qwen_image.score_trajectory(pipe.transformer, rollout, [2], samples=[0, 1, 2, 3])
    assert (ours.prev_sample_mean - theirs.prev_sample_mean).abs().max() <= 1e-6


def surrogate(policy: Policy, traj, samples) -> torch.Tensor:
    """−mean(A·log π) over the samples and all steps: the on-policy FlowGRPO gradient with fixed advantages."""
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75], dtype=torch.float64)[samples]
    outs = policy.score(traj, range(traj.num_inference_steps), samples)
    log_prob = torch.stack([o.log_prob.double() for o in outs], dim=1)  # [B, T]
    return -(adv[:, None] * log_prob).mean()


def fsdp_update(cfg: dict) -> None:
    """One SGD step on two FSDP2 ranks, each with half of the group; rank 0 saves the exported adapter."""
    import ray.train

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    policy = Policy.from_pretrained(cfg["model"], lora_rank=4, lora_alpha=4, target_modules=TARGETS,
                                    adapter_tensors=cfg["adapter"])
    assert policy.sharded
    surrogate(policy, cfg["traj"], [2 * rank, 2 * rank + 1]).backward()  # FSDP2 averages the two halves
    torch.optim.SGD(policy.parameters(), lr=cfg["lr"]).step()
    tensors = policy.export_adapter(version=2).tensors  # a collective: both ranks call it
    travelling = policy.export_adapter(version=2, dtype=torch.bfloat16).tensors  # as it is published
    if rank == 0:
        torch.save({"tensors": tensors, "bf16": travelling}, cfg["out"])
    ray.train.report({})


@pytest.mark.slow
def test_fsdp2_update_on_two_workers_matches_an_unsharded_float64_step(ray_cluster, tiny_model_dir, adapter,
                                                                        rollout, tmp_path):
    import ray.cloudpickle
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    lr = 50.0  # one SGD step: large enough that the update dwarfs fp32 rounding of the weights
    trainer = TorchTrainer(
        fsdp_update, train_loop_config={"model": str(tiny_model_dir), "adapter": adapter.tensors, "traj": rollout,
                                        "lr": lr, "out": str(tmp_path / "sharded.pt")},
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=ray.train.RunConfig(name="fsdp", storage_path=str(tmp_path)))
    trainer.fit()
    saved = torch.load(tmp_path / "sharded.pt")
    sharded = saved["tensors"]
    assert all(torch.equal(saved["bf16"][k], sharded[k].to(torch.bfloat16)) for k in sharded)  # gathered alike

    reference = make_policy(tiny_model_dir, adapter, dtype=torch.float64)
    surrogate(reference, rollout, [0, 1, 2, 3]).backward()
    torch.optim.SGD(reference.parameters(), lr=lr).step()
    expected = reference.export_adapter(version=2).tensors
    for key, start in adapter.tensors.items():
        step_fsdp = sharded[key].double() - start.double()
        step_ref = expected[key] - start.double()
        scale = step_ref.abs().max().item()
        rounding = 4 * torch.finfo(torch.float32).eps * start.abs().max().item()  # the fp32 copy of the weight
        if ".lora_B." in key:
            assert scale > 1e3 * rounding, key  # the step moved the adapter measurably
        assert (step_fsdp - step_ref).abs().max().item() <= 1e-4 * scale + rounding, key


def test_one_rank_keeps_the_frozen_base_as_it_is_and_computes_what_sharding_it_computes(tiny_model_dir, adapter,
                                                                                      rollout, world_of_one):
    """A world of one (the single-GPU trainer): FSDP2 manages only the LoRA, so the forward reads the base weights
    where they are stored instead of a per-forward unsharded copy; the loss and every LoRA gradient are those of
    FSDP2 managing the base too (bf16 compute, as on the GPU), whether it frees a block's gathered weights after
    the forward or keeps them for the backward (`train.reshard_after_forward`)."""
    from torch.distributed.tensor import DTensor

    runs = {}
    for shard_frozen, reshard in ((False, True), (True, True), (True, False)):
        policy = Policy.from_pretrained(tiny_model_dir, lora_rank=4, lora_alpha=4, target_modules=TARGETS,
                                        adapter_tensors=adapter.tensors, dtype=torch.bfloat16, shard=True,
                                        shard_frozen=shard_frozen, reshard_after_forward=reshard)
        to_q = policy.transformer.transformer_blocks[0].attn.to_q
        used = []
        hook = to_q.base_layer.register_forward_pre_hook(lambda m, _, used=used: used.append(m.weight.data_ptr()))
        loss = surrogate(policy, rollout, [0, 1, 2, 3])
        # between forward and backward a block's weights are gathered only if it keeps them
        assert isinstance(to_q.base_layer.weight, DTensor) == (shard_frozen and reshard)
        loss.backward()
        hook.remove()
        stored = to_q.base_layer.weight
        assert isinstance(stored, DTensor) == shard_frozen
        assert all(isinstance(p, DTensor) for p in policy.parameters())  # the LoRA: FSDP2's either way
        local = stored.to_local() if isinstance(stored, DTensor) else stored
        assert (used[0] == local.data_ptr()) == (not shard_frozen)  # no copy when the base is left alone
        runs[shard_frozen, reshard] = (loss.detach(), {n: p.grad.full_tensor() for n, p in
                                                       policy.transformer.named_parameters() if p.grad is not None})
    loss_a, grads_a = runs[False, True]
    assert len(grads_a) > 0
    for loss_b, grads_b in (runs[True, True], runs[True, False]):
        assert torch.equal(loss_a, loss_b)
        assert grads_a.keys() == grads_b.keys()
        assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)

