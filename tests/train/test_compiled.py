"""The compiled path on the tiny model (CPU, inductor): a compiled rollout engine samples groups, a compiled
policy trains on them with `train.old_logprob=trainer`, and

- the first pass's ratio is exactly 1 and the update equals the eager one's (to fp32 rounding), its log-probs a
  float64 reference's;
- nothing compiles again once the first groups have been seen: other prompts (text lengths), SDE windows, CFG,
  the first trained adapter reaching a replica that started on the base model, later versions, the base model
  again, groups one version old (dynamo's counters of this process, which holds both the engine and the policy);
- a new process pointed at the same cache folder compiles from the cache (a restarted worker, a replacement
  replica, a resumed run).

On a GPU, inductor's graph with gradients differs from its graph without them in the last bits (bf16); on the CPU
both agree here, so the exactness that matters there is checked on the GPU (tests/train/test_compiled_gpu.py).
"""

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch

from app.config import CompileConfig, RolloutConfig, TrainConfig
from app.metrics import Stats
from app.models.compile import compile_counts
from app.models.lora import LoraShape, random_lora
from app.rollout.diffusers_engine import DiffusersEngine
from app.train.policy import Policy
from app.train.update import make_optimizer, train_pass

pytestmark = pytest.mark.slow

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
ROLLOUT = RolloutConfig(group_size=4, height=64, width=64, num_inference_steps=4, guidance_scale=4.0)
TRAIN = TrainConfig(old_logprob="trainer", micro_batch_size=4, kl_beta=0.04, timestep_fraction=1.0, clip_range=1e-4,
                    learning_rate=1e-3)
FIRST = 'a sign that says "RL"'


def _adapter(model_dir, version: int, seed: int):
    from diffusers import QwenImageTransformer2DModel

    return random_lora(QwenImageTransformer2DModel.from_pretrained(model_dir, subfolder="transformer"),
                       version=version, rank=4, target_modules=TARGETS, seed=seed, scale=0.5)


def _policy(model_dir, adapter, compile=None, dtype=torch.float32) -> Policy:
    """Compiled: with gradient checkpointing (moved inside the compiled blocks), as the GPU recipes train."""
    return Policy.from_pretrained(model_dir, lora_rank=4, lora_alpha=4, target_modules=TARGETS, shard=False,
                                  adapter_tensors=adapter.tensors, compile=compile, dtype=dtype,
                                  gradient_checkpointing=compile is not None)


def _pass(policy, traj, train=TRAIN, step=0, policy_version=None):
    """One optimizer step on one group: (first-pass stats, mismatch stats, LoRA gradients). policy_version: the
    policy's adapter version (default: the group's, i.e. on-policy; one more: a group one version old)."""
    stats, mismatch = Stats(), Stats()
    optimizer = make_optimizer(policy, train)
    optimizer.step = lambda: None  # keep the weights: later passes score the same policy
    train_pass(policy, optimizer, train, step=step, epoch=0, trajectories=[traj],
               advantages=[torch.tensor([1.0, -0.5, 0.25, -0.75])], old=[traj.log_probs], stats=stats,
               mismatch=mismatch, policy_version=traj.lora_version if policy_version is None else policy_version)
    grads = [p.grad.detach().clone() for p in policy.parameters()]
    return stats.result(), mismatch.result(), grads


@pytest.fixture(scope="module")
def compiled(tiny_model_dir, tmp_path_factory, aio):
    """A compiled engine built as a run's replica is (its LoRA's shape from the model section: the zero adapter
    until one is published), a compiled policy holding adapter 1, the cache folder they share, adapter 1."""
    settings = CompileConfig(enabled=True, cache_dir=str(tmp_path_factory.mktemp("compile_cache")))
    adapter = _adapter(tiny_model_dir, 1, seed=11)
    engine = DiffusersEngine(tiny_model_dir, compile=settings, lora=LoraShape(4, 4.0, tuple(TARGETS)))
    aio(engine.start())
    yield engine, _policy(tiny_model_dir, adapter, compile=settings), settings, adapter
    aio(engine.close())


def test_compiled_first_pass_is_exact_and_the_update_is_the_eager_one(compiled, tiny_model_dir, aio):
    engine, policy, _, adapter = compiled
    assert engine.compiled and policy.compiled
    aio(engine.load_lora(adapter))
    traj = aio(engine.generate(ROLLOUT.request(FIRST, seed=5, group_id=0)))
    assert traj.lora_version == 1
    stats, mismatch, grads = _pass(policy, traj)
    assert stats["actor/ratio_dev_first_pass_max"] == 0.0  # exactly
    assert stats["actor/behaviour_weight_truncated"] == 0.0
    assert mismatch["rollout/logprob_mismatch_max"] < 1e-4  # logged: the rollout's graph is not the trainer's

    # the same step eager (no checkpointing), old log-probs from the rollout: the same update to fp32 rounding
    eager = _policy(tiny_model_dir, adapter)
    eager_stats, _, eager_grads = _pass(eager, traj, dataclasses.replace(TRAIN, old_logprob="rollout"))
    assert eager_stats["actor/ratio_dev_first_pass_max"] < 1e-4
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-6)

    # the compiled trainer's log-probs against an eager float64 transformer (the SDE math is fp32 in both)
    reference = _policy(tiny_model_dir, adapter, dtype=torch.float64)
    with torch.no_grad():
        ours = torch.stack([o.log_prob for o in policy.score(traj, range(4), range(4))], dim=1)
        exact = torch.stack([o.log_prob for o in reference.score(traj, range(4), range(4))], dim=1)
    torch.testing.assert_close(ours.double(), exact.double(), rtol=1e-4, atol=1e-5)


def test_nothing_compiles_again_after_the_first_groups(compiled, tiny_model_dir, aio):
    """A run's order of events: the replica starts on the base model, the first step trains on its groups, then
    trained adapters arrive (on the GPU the first one compiled a replica again), groups are scored one version old
    (pipelined), an evaluation of the base model comes between. Nothing compiles after the first step."""
    engine, policy, _, _ = compiled
    aio(engine.load_lora(None))  # as a replica starts (what an earlier test of this module loaded is dropped)
    # the first step: the base model's groups of two prompts of different lengths (the second makes the text
    # dimension dynamic), the policy trained on both
    for seed, prompt in enumerate([FIRST, 'a poster with the words "FLOW GRPO" in large letters']):
        _pass(policy, aio(engine.generate(ROLLOUT.request(prompt, seed=seed, group_id=seed))))
    before = compile_counts()
    # later steps: other prompts and lengths, SDE windows in other places, new adapter versions, other steps
    for version, (prompt, window) in enumerate([('a label reading "OK"', (0, 2)),
                                                ('a banner that says "REINFORCEMENT LEARNING"', (2, 4)),
                                                ("a red cube", None)], start=2):
        aio(engine.load_lora(_adapter(tiny_model_dir, version, seed=version)))
        traj = aio(engine.generate(ROLLOUT.request(prompt, seed=version, group_id=version, sde_window=window)))
        assert traj.lora_version == version
        stats, _, _ = _pass(policy, traj, step=version, policy_version=version + 1)  # one version old
        assert stats["actor/ratio_dev_first_pass_max"] == 0.0
    aio(engine.load_lora(None))  # the base model again (an evaluation's reference)
    assert aio(engine.generate(ROLLOUT.request(FIRST, seed=9, group_id=9))).lora_version == 0
    assert compile_counts() == before


def test_an_engine_that_merges_compiles_once_and_the_first_pass_stays_exact(compiled, tiny_model_dir, aio):
    """`rollout.merge_lora`: the adapter folded into a compiled engine's weights. A new version rewrites weights in
    place, which compiles nothing again; the compiled trainer's first pass on its groups is exactly 1 (old log-probs
    from the trainer) and the rollout's log-probs, from other roundings, are logged as the mismatch."""
    _, policy, settings, adapter = compiled
    engine = DiffusersEngine(tiny_model_dir, compile=settings, merge_lora="device")
    aio(engine.start())
    try:
        assert engine.compiled
        for seed, prompt in enumerate([FIRST, 'a poster with the words "FLOW GRPO" in large letters']):
            aio(engine.generate(ROLLOUT.request(prompt, seed=seed, group_id=seed)))  # the base model's first groups
        before = compile_counts()
        for version in (2, 3):
            aio(engine.load_lora(_adapter(tiny_model_dir, version, seed=version)))
            aio(engine.generate(ROLLOUT.request('a label reading "OK"', seed=version, group_id=version)))
        aio(engine.load_lora(adapter))
        traj = aio(engine.generate(ROLLOUT.request(FIRST, seed=5, group_id=0)))
        aio(engine.load_lora(None))
        aio(engine.generate(ROLLOUT.request(FIRST, seed=9, group_id=9)))
        assert compile_counts() == before
    finally:
        aio(engine.close())
    assert traj.lora_version == 1
    assert set(traj.producer["compile_cache"]) == {"fx_hits", "fx_misses", "aot_hits", "aot_misses", "fx_bypasses",
                                                   "aot_bypasses"}
    assert traj.producer["compile_cache"]["fx_hits"] + traj.producer["compile_cache"]["fx_misses"] >= 1
    stats, mismatch, _ = _pass(policy, traj)
    assert stats["actor/ratio_dev_first_pass_max"] == 0.0
    assert 0 < mismatch["rollout/logprob_mismatch_max"] < 1e-4


def test_lean_and_skipped_guards_train_and_score_as_full_guards(compiled, tiny_model_dir, aio):
    """`model.compile.guards: lean` drops the guards on module attributes a trainer never changes: the policy
    compiles graphs of its own, its first pass is exactly 1 and its gradients (the KL's reference forward, the
    adapter off, among them) are the full-guard policy's bit for bit, the adapter's switch still picks another
    graph, and later groups compile nothing. `skip` (lean's graphs; after the first step only the guards that tell
    them apart): the next group's pass and scores bit for bit those with every guard checked, the adapter's switch
    and grad mode still picking their graphs."""
    engine, policy, settings, adapter = compiled
    aio(engine.load_lora(adapter))
    traj = aio(engine.generate(ROLLOUT.request(FIRST, seed=21, group_id=0)))

    def scores(p, reference: bool) -> torch.Tensor:
        with torch.no_grad():
            if reference:
                with p.reference():
                    return torch.stack([o.log_prob for o in p.score(traj, range(4), range(4))], dim=1)
            return torch.stack([o.log_prob for o in p.score(traj, range(4), range(4))], dim=1)

    _, _, full_grads = _pass(policy, traj)
    full_reference = scores(policy, True)
    # dynamo keeps a function's graphs on its code, whichever torch.compile made them: without a reset the lean
    # policy would run the full policy's graphs (the engine compiles again at its next group: not used here)
    torch._dynamo.reset()
    lean = _policy(tiny_model_dir, adapter, compile=dataclasses.replace(settings, guards="lean"))
    before = compile_counts()
    stats, _, grads = _pass(lean, traj)
    assert compile_counts()["frames"] > before["frames"]  # its own graphs, made with the filter
    assert stats["actor/ratio_dev_first_pass_max"] == 0.0
    for g, f in zip(grads, full_grads, strict=True):
        assert torch.equal(g, f)
    assert torch.equal(scores(lean, True), full_reference)
    assert not torch.equal(scores(lean, True), scores(lean, False))  # the adapter's switch kept its guard
    other = aio(engine.generate(ROLLOUT.request('a banner that says "LEAN"', seed=22, group_id=1, sde_window=(1, 3))))
    before = compile_counts()
    checked, _, checked_grads = _pass(lean, other)
    assert checked["actor/ratio_dev_first_pass_max"] == 0.0
    assert compile_counts() == before
    checked_scores = (scores(lean, True), scores(lean, False))

    # `skip`, as a run after its first step (a process-wide stance: set for the trainer's calls alone here)
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        skipped, _, skipped_grads = _pass(lean, other)
        skipped_scores = (scores(lean, True), scores(lean, False))
    assert skipped["actor/ratio_dev_first_pass_max"] == 0.0
    assert compile_counts() == before
    for g, c in zip(skipped_grads, checked_grads, strict=True):
        assert torch.equal(g, c)
    for skip, check in zip(skipped_scores, checked_scores, strict=True):
        assert torch.equal(skip, check)


def test_a_new_process_compiles_from_the_shared_cache(tiny_model_dir, tmp_path):
    """A process samples a group with a compiled engine and trains a compiled policy on it; a second one, the same
    work given a copy of that cache folder at another path (a restarted worker, a replacement replica, a fresh
    machine the folder was carried to), takes every inductor graph and every AOTAutograd pair from the cache: hits
    and no misses (a compilation that restarts its analysis misses once more). Both are fresh interpreters: this
    test process has imported vllm, whose settings change inductor's cache keys."""
    script = f"""
import json, sys, torch
torch.set_num_threads(1)  # as the test processes: inductor's CPU kernels depend on the thread count
from app.config import CompileConfig
from app.models.compile import cache_counts
from tests.train.test_compiled import ROLLOUT, FIRST, _adapter, _pass, _policy
from app.rollout.diffusers_engine import DiffusersEngine
settings = CompileConfig(enabled=True, cache_dir=sys.argv[1])
adapter = _adapter({str(tiny_model_dir)!r}, 1, seed=11)
engine = DiffusersEngine({str(tiny_model_dir)!r}, compile=settings)
engine.load()
engine._load_lora(adapter)
traj = engine.sample(ROLLOUT.request(FIRST, seed=5, group_id=0))
stats, _, _ = _pass(_policy({str(tiny_model_dir)!r}, adapter, compile=settings), traj)
counts = cache_counts()
print(json.dumps({{"hit": counts["fx_hits"], "miss": counts["fx_misses"], "aot_hit": counts["aot_hits"],
                  "aot_miss": counts["aot_misses"], "bypass": counts["fx_bypasses"] + counts["aot_bypasses"],
                  "ratio": stats["actor/ratio_dev_first_pass_max"]}}))
"""
    results = []
    for cache in ("compile_cache", "carried/compile_cache"):
        if cache != "compile_cache":
            shutil.copytree(tmp_path / "compile_cache", tmp_path / cache)
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / cache)], capture_output=True, text=True,
                             timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = results
    assert cold["miss"] >= 3, cold  # engine forward; policy forward, backward, reference
    assert warm["hit"] >= cold["miss"] and warm["miss"] == 0, warm
    # every trained graph is cached, the checkpointed ones too (recomputed attention once made AOTAutograd or
    # inductor bypass their caches: saved by the checkpoint policy, app/models/compile.py)
    assert cold["aot_hit"] == 0 and warm["aot_hit"] >= max(cold["aot_miss"], 1) and warm["aot_miss"] == 0, (cold, warm)
    assert cold["bypass"] == warm["bypass"] == 0, (cold, warm)
    assert cold["ratio"] == warm["ratio"] == 0.0
