"""The BAGEL policy: it scores exactly the steps our BAGEL engine took (text to image and edits, with and without
an adapter and CFG), trains only the generation expert's LoRA, its reference is the base model, its adapter
round-trips as a peft folder, and FSDP2 over two Ray Train workers, one holding an edit group and the other a
text-to-image group, computes the same update as one unsharded float64 process."""

import dataclasses
import sys

import numpy as np
import pytest
import torch

from app.models.bagel import GENERATION_TARGETS
from app.models.bagel.model import BagelMoT
from app.models.lora import random_lora
from app.train.policy import Policy, load_adapter_tensors
from app.types import GenerationRequest

TARGETS = GENERATION_TARGETS
EDIT = torch.from_numpy((np.random.default_rng(1).random((64, 64, 3)) * 255).astype(np.uint8))
CFG = dict(guidance_scale=4.0, negative_prompt="", image_guidance_scale=1.5, cfg_interval=(0.4, 1.0))


@pytest.fixture(scope="module")
def adapter(tiny_bagel_dir):
    return random_lora(BagelMoT.from_checkpoint(tiny_bagel_dir), version=1, rank=4, target_modules=TARGETS, seed=3,
                       scale=0.5)


def sample(engine, aio, adapter, *, edit: bool, cfg: bool, lora: bool, negative: str = ""):
    """A group of 4 from our BAGEL engine (the adapter loaded for it when `lora`; the engine is reset after)."""
    extra = ({"image": EDIT} if edit else {}) | (CFG | {"negative_prompt": negative} if cfg else {})
    request = GenerationRequest('a sign that says "RL"', n=4, height=64, width=64, num_inference_steps=3,
                                noise_level=0.8, sde_type="sde", seed=9, **extra)
    if lora:
        aio(engine.load_lora(dataclasses.replace(adapter, version=engine.lora_version + 1)))
    try:
        return aio(engine.generate(request))
    finally:
        aio(engine.load_lora(None))


def make_policy(model_dir, adapter=None, **kwargs) -> Policy:
    return Policy.from_pretrained(model_dir, lora_rank=4, lora_alpha=4, target_modules=TARGETS, family="bagel",
                                  adapter_tensors=adapter.tensors if adapter else None, shard=False, **kwargs)


def log_probs(policy: Policy, traj) -> torch.Tensor:
    with torch.no_grad():
        outs = policy.score(traj, range(traj.num_inference_steps), range(traj.group_size))
    return torch.stack([o.log_prob for o in outs], dim=1)


@pytest.mark.parametrize("edit", [False, True], ids=["t2i", "edit"])
@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_policy_scores_the_engines_steps_exactly(bagel_engine, aio, tiny_bagel_dir, adapter, edit, cfg, lora):
    traj = sample(bagel_engine, aio, adapter, edit=edit, cfg=cfg, lora=lora)
    policy = make_policy(tiny_bagel_dir, adapter if lora else None)
    assert torch.equal(log_probs(policy, traj), traj.log_probs)  # fp32 on CPU: exactly the rollout's
    policy.sharded = True  # FSDP2's uniform passes (padding, a forward of its own per CFG branch): same numbers
    assert torch.equal(log_probs(policy, traj), traj.log_probs)


def test_a_negative_prompt_context_scores_exactly(bagel_engine, aio, tiny_bagel_dir, adapter):
    traj = sample(bagel_engine, aio, adapter, edit=True, cfg=True, lora=True, negative="blurry")
    assert "negative_ids" in traj.conditioning
    assert torch.equal(log_probs(make_policy(tiny_bagel_dir, adapter), traj), traj.log_probs)


def test_an_sde_window_edit_scores_exactly_with_log_probs_only_in_the_window(bagel_engine, aio, tiny_bagel_dir):
    request = GenerationRequest('a sign that says "RL"', n=2, height=64, width=64, num_inference_steps=3,
                                noise_level=0.8, sde_type="sde", seed=9, image=EDIT, sde_window=(2, 3), **CFG)
    traj = aio(bagel_engine.generate(request))
    assert traj.stochastic_steps == [2] and torch.equal(traj.log_probs[:, :2], torch.zeros(2, 2))
    assert torch.equal(log_probs(make_policy(tiny_bagel_dir), traj), traj.log_probs)


def test_only_the_generation_experts_lora_trains_and_the_reference_is_the_base(bagel_engine, aio, tiny_bagel_dir,
                                                                              adapter):
    traj = sample(bagel_engine, aio, adapter, edit=True, cfg=True, lora=False)
    policy = make_policy(tiny_bagel_dir, adapter)
    trainable = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "_moe_gen" in n for n in trainable)
    (out,) = policy.score(traj, [0], [0, 1])
    out.log_prob.sum().backward()
    grads = [p.grad for p in policy.parameters()]
    assert all(g is not None for g in grads) and max(g.abs().max().item() for g in grads) > 0
    with torch.no_grad(), policy.reference():
        ref = log_probs(policy, traj)
    assert torch.equal(ref, traj.log_probs)  # sampled by the base model: the reference scores it exactly
    assert (log_probs(policy, traj) - traj.log_probs).abs().max() > 1e-4  # the adapter moves it


def test_adapter_saves_as_a_peft_folder_and_loads_back(tiny_bagel_dir, adapter, tmp_path):
    from peft import LoraConfig

    policy = make_policy(tiny_bagel_dir, adapter)
    written = policy.save_adapter(tmp_path)
    assert written.name == "adapter_model.safetensors"
    config = LoraConfig.from_pretrained(tmp_path)
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 4, sorted(TARGETS))
    loaded = load_adapter_tensors(tmp_path)
    assert loaded.keys() == adapter.tensors.keys() and all(torch.equal(loaded[k], adapter.tensors[k]) for k in loaded)


def surrogate(policy: Policy, traj, samples) -> torch.Tensor:
    """−mean(A·log π) over the samples and all steps: the on-policy FlowGRPO gradient with fixed advantages."""
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75], dtype=torch.float64)[samples]
    outs = policy.score(traj, range(traj.num_inference_steps), samples)
    return -(adv[:, None] * torch.stack([o.log_prob.double() for o in outs], dim=1)).mean()


def fsdp_update(cfg: dict) -> None:
    """One SGD step on two FSDP2 ranks: rank 0 holds the edit group, rank 1 the text-to-image group (different
    numbers of context passes: the uniform passes keep the collectives in step)."""
    import ray.train

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    policy = Policy.from_pretrained(cfg["model"], lora_rank=4, lora_alpha=4, target_modules=TARGETS,
                                    adapter_tensors=cfg["adapter"], family="bagel")
    assert policy.sharded
    surrogate(policy, cfg["trajs"][rank], [0, 1, 2, 3]).backward()  # FSDP2 averages the two ranks' gradients
    torch.optim.SGD(policy.parameters(), lr=cfg["lr"]).step()
    tensors = policy.export_adapter(version=2).tensors
    if rank == 0:
        torch.save(tensors, cfg["out"])
    ray.train.report({})


@pytest.mark.slow
def test_fsdp2_update_with_an_edit_and_a_text_group_matches_an_unsharded_float64_step(
        ray_cluster, bagel_engine, aio, tiny_bagel_dir, adapter, tmp_path):
    import ray.cloudpickle
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    trajs = [sample(bagel_engine, aio, adapter, edit=True, cfg=True, lora=True),
             sample(bagel_engine, aio, adapter, edit=False, cfg=True, lora=True)]
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    lr = 50.0
    trainer = TorchTrainer(
        fsdp_update, train_loop_config={"model": str(tiny_bagel_dir), "adapter": adapter.tensors, "trajs": trajs,
                                        "lr": lr, "out": str(tmp_path / "sharded.pt")},
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=ray.train.RunConfig(name="fsdp_bagel", storage_path=str(tmp_path)))
    trainer.fit()
    sharded = torch.load(tmp_path / "sharded.pt")

    reference = make_policy(tiny_bagel_dir, adapter, dtype=torch.float64)
    ((surrogate(reference, trajs[0], [0, 1, 2, 3]) + surrogate(reference, trajs[1], [0, 1, 2, 3])) / 2).backward()
    torch.optim.SGD(reference.parameters(), lr=lr).step()
    expected = reference.export_adapter(version=2).tensors
    for key, start in adapter.tensors.items():
        step_fsdp = sharded[key].double() - start.double()
        step_ref = expected[key] - start.double()
        scale = step_ref.abs().max().item()
        rounding = 4 * torch.finfo(torch.float32).eps * start.abs().max().item()
        if ".lora_B." in key:
            assert scale > 1e3 * rounding, key
        assert (step_fsdp - step_ref).abs().max().item() <= 1e-4 * scale + rounding, key
