"""The pure-torch BAGEL: strict loading, Mixture-of-Transformers routing (text through the understanding expert,
latents through the generation expert, a LoRA of the generation expert never touching the context), the velocity
against an independent float64 re-computation, and CFG and the schedule against hand-worked numbers."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from app.models.bagel.model import GENERATION_TARGETS, BagelMoT, Context, combine_cfg, schedule

GRID = (4, 4)  # a 64x64 image: 4x4 latent tokens of 2x2 patches


@pytest.fixture(scope="module")
def bagel_dir(tiny_bagel_dir):
    return tiny_bagel_dir


@pytest.fixture(scope="module")
def tokens(bagel_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bagel_dir)
    ids = tokenizer.convert_tokens_to_ids
    prompt = [ids("<|im_start|>"), *tokenizer('a sign that says "OPEN"').input_ids, ids("<|im_end|>")]
    return torch.tensor(prompt), (ids("<|vision_start|>"), ids("<|vision_end|>"))


def same_keys(a: Context, b: Context, tokens: slice = slice(None)) -> bool:
    """Whether two contexts hold the same keys in every layer (over `tokens` of the sequence)."""
    return all(torch.equal(x[0][:, :, tokens], y[0][:, :, tokens]) for x, y in zip(a.layers, b.layers, strict=True))


def inputs(batch: int = 2, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, GRID[0] * GRID[1], 64, generator=generator), torch.tensor([0.9, 0.35][:batch])


def test_checkpoint_loads_strictly_with_upstream_names(bagel_dir):
    model = BagelMoT.from_checkpoint(bagel_dir)
    state = load_file(str(bagel_dir / "ema.safetensors"))
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    names = {name for name, _ in model.named_modules()}
    for target in GENERATION_TARGETS:
        assert any(name.endswith(target) for name in names), target


def test_text_runs_through_the_understanding_expert_and_latents_through_the_generation_expert(bagel_dir, tokens):
    prompt, marks = tokens
    latents, t = inputs()
    base = BagelMoT.from_checkpoint(bagel_dir)
    with torch.no_grad():
        context = base.prefill_text(prompt)
        v = base.velocity(latents, t, context, GRID, marks)
    for name, moves_context in (("mlp.down_proj", True), ("mlp_moe_gen.down_proj", False),
                                ("self_attn.k_proj", True), ("self_attn.k_proj_moe_gen", False)):
        changed = BagelMoT.from_checkpoint(bagel_dir)
        layer = changed.language_model.model.layers[0]
        module = layer.get_submodule(name)
        with torch.no_grad():
            module.weight.add_(0.5)
            new_context = changed.prefill_text(prompt)
            new_v = changed.velocity(latents, t, new_context, GRID, marks)
        assert (not same_keys(context, new_context)) == moves_context, name
        assert (new_v - v).abs().max() > 1e-4, name  # the image attends to the context, and is the gen tokens


def test_a_lora_of_the_generation_expert_moves_the_velocity_not_the_context(bagel_dir, tokens):
    from peft import LoraConfig

    prompt, marks = tokens
    latents, t = inputs()
    model = BagelMoT.from_checkpoint(bagel_dir)
    with torch.no_grad():
        context = model.prefill_text(prompt)
        base = model.velocity(latents, t, context, GRID, marks)
    torch.manual_seed(1)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=GENERATION_TARGETS, init_lora_weights=False),
                      "gen")
    wrapped = [name for name, m in model.named_modules() if hasattr(m, "lora_A")]
    assert len(wrapped) == len(GENERATION_TARGETS) * model.config.num_hidden_layers
    assert all("moe_gen" in name for name in wrapped)
    with torch.no_grad():
        tuned_context = model.prefill_text(prompt)
        tuned = model.velocity(latents, t, tuned_context, GRID, marks)
        model.disable_adapters()
        again = model.velocity(latents, t, context, GRID, marks)
    assert same_keys(context, tuned_context)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(context.layers, tuned_context.layers, strict=True))
    assert (tuned - base).abs().max() > 1e-3
    assert torch.equal(again, base)


def _reference_velocity(w: dict, config: dict, prompt, latents, t, marks, grid, edit_image=None) -> torch.Tensor:
    """BAGEL's velocity written out as plain float64 tensor algebra from the checkpoint's tensors: one packed
    sequence of blocks (an edit's clean image at t = 0, the prompt, the noisy image) with an attention mask (a block
    sees every earlier block; text is causal within its block, an image is not), rather than the model's
    block-by-block prefill with a cache."""
    llm = config["llm_config"]
    hidden, heads, kv_heads = llm["hidden_size"], llm["num_attention_heads"], llm["num_key_value_heads"]
    d, eps = hidden // heads, llm["rms_norm_eps"]
    w = {k: v.double() for k, v in w.items()}

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    def linear(x, name, bias=True):
        y = x @ w[f"{name}.weight"].T
        return y + w[f"{name}.bias"] if bias else y

    def image_block(tokens, time):
        half = 128
        angles = time * torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
        temb = linear(torch.nn.functional.silu(linear(torch.cat([angles.cos(), angles.sin()]),
                                                      "time_embedder.mlp.0")), "time_embedder.mlp.2")
        side = config["max_latent_size"]
        pos_ids = [r * side + c for r in range(grid[0]) for c in range(grid[1])]
        image = linear(tokens.double(), "vae2llm") + temb + w["latent_pos_embed.pos_embed"][pos_ids]
        return torch.cat([embed[marks[0]][None], image, embed[marks[1]][None]])

    embed = w["language_model.model.embed_tokens.weight"]
    blocks = []  # (embeddings, is text, RoPE positions)
    position = 0
    if edit_image is not None:
        blocks.append((image_block(edit_image, torch.tensor(0.0, dtype=torch.float64)), False, None))
    for b, (x_b, is_text, _) in enumerate(blocks):
        blocks[b] = (x_b, is_text, torch.full((x_b.shape[0],), float(position)))
        position += 1
    if prompt.numel():
        blocks.append((embed[prompt], True, torch.arange(position, position + prompt.shape[0]).double()))
        position += prompt.shape[0]
    query = image_block(latents, t)
    blocks.append((query, False, torch.full((query.shape[0],), float(position))))
    x = torch.cat([b[0] for b in blocks])
    positions = torch.cat([b[2] for b in blocks])
    block_of = torch.cat([torch.full((b[0].shape[0],), i) for i, b in enumerate(blocks)])
    text = torch.cat([torch.full((b[0].shape[0],), b[1]) for b in blocks])
    index = torch.arange(x.shape[0])
    allowed = (block_of[None, :] < block_of[:, None]) | ((block_of[None, :] == block_of[:, None])
                                                         & (~text[:, None] | (index[None, :] <= index[:, None])))
    gen = torch.zeros(x.shape[0], dtype=torch.bool)
    start = 0
    for b_x, is_text, _ in blocks:
        if not is_text:
            gen[start + 1:start + b_x.shape[0] - 1] = True
        start += b_x.shape[0]
    n = latents.shape[0]
    inv = 1.0 / llm["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def expert(rows, name_und, name_gen, fn):
        return torch.where(gen[:, None], fn(rows, name_gen), fn(rows, name_und))

    def rotate(v):
        return v * cos[:, None] + torch.cat([-v[..., d // 2:], v[..., :d // 2]], -1) * sin[:, None]

    def norm(r, name):
        return rms(r, w[f"{name}.weight"])

    def projection(r, name):
        return linear(r, name, bias=not name.split(".")[-1].startswith("o_proj"))

    def mlp(r, name):
        return linear(torch.nn.functional.silu(linear(r, f"{name}.gate_proj", False))
                      * linear(r, f"{name}.up_proj", False), f"{name}.down_proj", False)

    for i in range(llm["num_hidden_layers"]):
        pre = f"language_model.model.layers.{i}."
        h = expert(x, pre + "input_layernorm", pre + "input_layernorm_moe_gen", norm)
        qkv = {}
        for proj, count in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            name = f"{pre}self_attn.{proj}_proj"
            y = expert(h, name, name + "_moe_gen", projection).view(-1, count, d)
            if proj != "v":
                y = torch.where(gen[:, None, None], rms(y, w[f"{pre}self_attn.{proj}_norm_moe_gen.weight"]),
                                rms(y, w[f"{pre}self_attn.{proj}_norm.weight"]))
                y = rotate(y)
            qkv[proj] = y.repeat_interleave(heads // count, dim=1) if count != heads else y
        scores = torch.einsum("qhd,khd->hqk", qkv["q"], qkv["k"]) / math.sqrt(d)
        scores = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", scores, qkv["v"]).reshape(-1, hidden)
        x = x + expert(attn, pre + "self_attn.o_proj", pre + "self_attn.o_proj_moe_gen", projection)
        h = expert(x, pre + "post_attention_layernorm", pre + "post_attention_layernorm_moe_gen", norm)
        x = x + expert(h, pre + "mlp", pre + "mlp_moe_gen", mlp)
    out = rms(x[-n - 1:-1], w["language_model.model.norm_moe_gen.weight"])
    return linear(out, "llm2vae")


def test_velocity_equals_an_independent_float64_computation(bagel_dir, tokens):
    prompt, marks = tokens
    latents, t = inputs(batch=2)
    model = BagelMoT.from_checkpoint(bagel_dir, dtype=torch.float64)
    with torch.no_grad():
        v = model.velocity(latents.double(), t.double(), model.prefill_text(prompt), GRID, marks)
    config = json.loads((bagel_dir / "config.json").read_text())
    weights = load_file(str(bagel_dir / "ema.safetensors"))
    for b in range(2):
        expected = _reference_velocity(weights, config, prompt, latents[b], t[b].double(), marks, GRID)
        torch.testing.assert_close(v[b], expected, rtol=1e-10, atol=1e-10)


def test_the_empty_context_puts_the_image_at_position_zero(bagel_dir, tokens):
    _, marks = tokens
    latents, t = inputs(batch=1)
    model = BagelMoT.from_checkpoint(bagel_dir, dtype=torch.float64)
    with torch.no_grad():
        v = model.velocity(latents.double(), t.double(), Context.empty(), GRID, marks)
    config = json.loads((bagel_dir / "config.json").read_text())
    no_prompt = torch.tensor([], dtype=torch.long)
    expected = _reference_velocity(load_file(str(bagel_dir / "ema.safetensors")), config, no_prompt, latents[0],
                                   t[0].double(), marks, GRID)
    torch.testing.assert_close(v[0], expected, rtol=1e-10, atol=1e-10)


def test_an_edit_context_equals_the_float64_computation(bagel_dir, tokens):
    """An edit's context: the input image's clean latents (t = 0, generation expert, one position), then the
    prompt after it (causal, seeing the image), then the noisy image queried at the next position."""
    prompt, marks = tokens
    latents, t = inputs(batch=1)
    edit = torch.randn(16, 64, generator=torch.Generator().manual_seed(9))
    model = BagelMoT.from_checkpoint(bagel_dir, dtype=torch.float64)
    with torch.no_grad():
        context = model.extend_with_image(None, edit[None].double(), GRID, marks)
        assert context.position == 1 and context.layers[0][0].shape[2] == 18
        context = model.prefill_text(prompt, context)
        assert context.position == 1 + prompt.shape[0]
        v = model.velocity(latents.double(), t.double(), context, GRID, marks)
    config = json.loads((bagel_dir / "config.json").read_text())
    expected = _reference_velocity(load_file(str(bagel_dir / "ema.safetensors")), config, prompt, latents[0],
                                   t[0].double(), marks, GRID, edit_image=edit)
    torch.testing.assert_close(v[0], expected, rtol=1e-10, atol=1e-10)


def test_patchify_round_trip_and_layout():
    from app.models.bagel.model import patchify, unpatchify

    latent = torch.arange(16 * 4 * 6, dtype=torch.float32).reshape(16, 4, 6)  # C=16, a 2x3 grid of 2x2 patches
    tokens = patchify(latent)
    assert tokens.shape == (6, 64)
    # token 1 is the patch at row 0, column 1; its first 16 values are the channels of pixel (0, 2)
    assert torch.equal(tokens[1, :16], latent[:, 0, 2]) and torch.equal(tokens[1, 16:32], latent[:, 0, 3])
    assert torch.equal(tokens[3, 32:48], latent[:, 3, 0])  # row 1, column 0: pixel (3, 0) is its third
    assert torch.equal(unpatchify(tokens, (2, 3)), latent)


def test_cfg_combination_hand_worked():
    v, v_text = torch.tensor([[[3.0, 4.0]]]), torch.tensor([[[0.0, 0.0]]])
    # text CFG 2: 0 + 2·(3, 4) = (6, 8), norm 10 > ‖v‖ = 5 → scaled by 0.5 back to (3, 4)
    assert torch.allclose(combine_cfg(v, v_text, None, text_scale=2.0, img_scale=1.0), v)
    # no renormalisation needed when the guided velocity is shorter: (3, 4) + 0.5·((3, 4) − (3, 4)) stays
    shorter = combine_cfg(v, torch.tensor([[[1.0, 1.0]]]), None, text_scale=0.5, img_scale=1.0)
    assert torch.allclose(shorter, torch.tensor([[[2.0, 2.5]]]))  # (1,1) + 0.5·(2,3); norm 3.2 < 5: scale 1
    # image CFG 1.5 after text CFG 2: (1, 0) + 1.5·((6, 8) − (1, 0)) = (8.5, 12), norm √216.25 → ×5/14.7054
    both = combine_cfg(v, v_text, torch.tensor([[[1.0, 0.0]]]), text_scale=2.0, img_scale=1.5)
    assert torch.allclose(both, torch.tensor([[[8.5, 12.0]]]) * 5 / math.sqrt(216.25))
    # renorm_min bounds the shrinking: scale max(0.5, 0.8) = 0.8
    assert torch.allclose(combine_cfg(v, v_text, None, text_scale=2.0, img_scale=1.0, renorm_min=0.8),
                          torch.tensor([[[4.8, 6.4]]]))


def test_cfg_global_norm_is_per_sample_and_channel_norm_per_token():
    v = torch.tensor([[[3.0, 4.0], [0.0, 1.0]], [[1.0, 0.0], [0.0, 0.0]]])  # two samples of two tokens
    zero = torch.zeros_like(v)
    guided = combine_cfg(v, zero, None, text_scale=2.0, img_scale=1.0)  # 2v, each sample scaled back by 1/2
    assert torch.allclose(guided, v)
    lopsided = torch.tensor([[[3.0, 4.0], [0.0, 1.0]]])
    text = torch.tensor([[[0.0, 0.0], [0.0, 2.0]]])  # guided: (6, 8) and (0, 0)
    per_sample = combine_cfg(lopsided, text, None, text_scale=2.0, img_scale=1.0, renorm="global")
    assert torch.allclose(per_sample, torch.tensor([[[6.0, 8.0], [0.0, 0.0]]]) * math.sqrt(26.0) / 10.0)
    per_token = combine_cfg(lopsided, text, None, text_scale=2.0, img_scale=1.0, renorm="channel")
    assert torch.allclose(per_token, torch.tensor([[[3.0, 4.0], [0.0, 0.0]]]))
    with pytest.raises(ValueError, match="renorm"):
        combine_cfg(v, zero, None, text_scale=2.0, img_scale=1.0, renorm="none")


def test_schedule_shift_hand_worked():
    sigmas = schedule(6, 3.0)  # σ = 1, .8, .6, .4, .2, 0 → 3σ / (1 + 2σ)
    expected = torch.tensor([1.0, 2.4 / 2.6, 1.8 / 2.2, 1.2 / 1.8, 0.6 / 1.4, 0.0])
    torch.testing.assert_close(sigmas, expected)
    torch.testing.assert_close(schedule(3, 1.0), torch.tensor([1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="at least 2"):
        schedule(1, 3.0)


def _sample_and_rescore(model, contexts, guidance, marks, *, n=3, steps=5, noise_level=0.8, seed=7):
    from app.algo.sampling import score_steps
    from app.models.bagel.model import group_velocity, sample_group
    from app.rollout.seeding import sample_generators

    sigmas = schedule(steps + 1, 3.0)
    with torch.no_grad():
        latents, log_probs = sample_group(model, contexts, guidance, generators=sample_generators(seed, 0, n),
                                          grid=GRID, image_tokens=marks, sigmas=sigmas,
                                          noise_levels=[noise_level] * steps)
        velocity = group_velocity(model, contexts, guidance, sigmas=sigmas, grid=GRID, image_tokens=marks)
        scored = score_steps(velocity, latents, range(steps), sigmas, [noise_level] * steps, sde_type="sde")
    return latents, log_probs, torch.stack([o.log_prob for o in scored], dim=1)


@pytest.mark.parametrize("cfg", ["none", "empty-negative", "negative-prompt"])
@pytest.mark.parametrize("lora", [False, True])
def test_rescoring_a_sampled_group_gives_exactly_its_log_probs(bagel_dir, tokens, cfg, lora):
    """fp32 on the CPU, the same module sampling and scoring: the trainer-side recompute is the rollout, bit for
    bit (with the generation-expert LoRA and with CFG inside its interval, outside it plain)."""
    from peft import LoraConfig

    from app.models.bagel.model import Contexts, Guidance

    prompt, marks = tokens
    model = BagelMoT.from_checkpoint(bagel_dir)
    if lora:
        torch.manual_seed(2)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=GENERATION_TARGETS, init_lora_weights=False))
    with torch.no_grad():
        full = model.prefill_text(prompt)
        negative = model.prefill_text(prompt[:3])
    contexts = {"none": Contexts(full), "empty-negative": Contexts(full, Context.empty()),
                "negative-prompt": Contexts(full, negative)}[cfg]
    guidance = Guidance() if cfg == "none" else Guidance(text_scale=4.0, interval=(0.4, 1.0))
    latents, sampled, rescored = _sample_and_rescore(model, contexts, guidance, marks)
    assert latents.shape == (3, 6, 16, 64) and torch.isfinite(sampled).all()
    assert torch.equal(rescored, sampled)


def test_cfg_changes_only_the_steps_inside_its_interval(bagel_dir, tokens):
    from app.models.bagel.model import Contexts, Guidance, guided_velocity

    prompt, marks = tokens
    model = BagelMoT.from_checkpoint(bagel_dir)
    latents, _ = inputs(batch=2)
    with torch.no_grad():
        contexts = Contexts(model.prefill_text(prompt), Context.empty())
        for sigma, inside in ((0.95, True), (0.4, False), (0.41, True), (0.2, False)):
            plain = guided_velocity(model, latents, sigma, contexts, Guidance(), GRID, marks)
            guided = guided_velocity(model, latents, sigma, contexts, Guidance(text_scale=4.0), GRID, marks)
            assert (not torch.equal(plain, guided)) == inside, sigma


def test_each_sample_starts_from_its_own_noise_whatever_the_group(bagel_dir, tokens):
    from app.models.bagel.model import Contexts, Guidance, initial_latents
    from app.rollout.seeding import sample_generators

    prompt, marks = tokens
    whole = initial_latents(sample_generators(7, 0, 3), 16)
    alone = initial_latents(sample_generators(7, 1, 1), 16)
    assert torch.equal(whole[1:2], alone)
    model = BagelMoT.from_checkpoint(bagel_dir)
    with torch.no_grad():
        contexts = Contexts(model.prefill_text(prompt))
    latents, log_probs, _ = _sample_and_rescore(model, contexts, Guidance(), marks, n=3)
    # sample 1 drawn alone follows the same trajectory (to fp32 rounding of a batch of another size)
    from app.models.bagel.model import sample_group

    with torch.no_grad():
        one, one_lp = sample_group(model, contexts, Guidance(), generators=sample_generators(7, 1, 1), grid=GRID,
                                   image_tokens=marks, sigmas=schedule(6, 3.0), noise_levels=[0.8] * 5)
    torch.testing.assert_close(one[0], latents[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(one_lp[0], log_probs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # vllm-omni's import
def test_vit_tokens_equal_vllm_omni_navit_and_the_block_runs_through_the_understanding_expert(bagel_dir, tokens):
    """An edit input's ViT tokens: ours (patches through SigLIP's patch projection, its encoder, the connector and
    the position table) against vllm-omni's own NaViT wrapper on the same weights; then the ViT block in a context:
    one RoPE position, N + 2 keys, and a generation-expert LoRA never touches it."""
    from peft import LoraConfig
    from vllm_omni.diffusion.models.bagel.bagel_transformer import patchify as vllm_patchify
    from vllm_omni.diffusion.models.bagel.pipeline_bagel import SiglipNaViTWrapper

    prompt, marks = tokens
    model = BagelMoT.from_checkpoint(bagel_dir)
    image = torch.rand(3, 42, 56, generator=torch.Generator().manual_seed(4)) * 2 - 1  # a 3x4 grid of 14 px patches
    side = model.config.vit_max_num_patch_per_side
    pos_ids = (torch.arange(3)[:, None] * side + torch.arange(4)[None, :]).flatten()
    with torch.no_grad():
        ours = model.vit_embeddings(image)
        wrapper = SiglipNaViTWrapper(model.vit_model["vision_model"])
        theirs = wrapper(vllm_patchify(image, 14), pos_ids, torch.tensor([0, 12], dtype=torch.int32), 12)
        theirs = model.connector(theirs) + model.vit_pos_embed.pos_embed[pos_ids]
    assert ours.shape == (12, model.config.hidden_size)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    latent = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        context = model.extend_with_vit(model.extend_with_image(None, latent, GRID, marks), image, marks)
        assert context.position == 2 and context.layers[0][0].shape[2] == (16 + 2) + (12 + 2)
        context = model.prefill_text(prompt, context)
    assert context.position == 2 + prompt.shape[0]
    torch.manual_seed(3)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=GENERATION_TARGETS, init_lora_weights=False))
    with torch.no_grad():
        image_block = model.extend_with_image(None, latent, GRID, marks)
        tuned = model.prefill_text(prompt, model.extend_with_vit(image_block, image, marks))
    # the VAE block runs the generation expert (moved by the LoRA); the ViT and text keys after it move only
    # through attending to it, so compare the ViT block alone on an unchanged prefix
    with torch.no_grad():
        vit_alone = model.extend_with_vit(None, image, marks)
        model.disable_adapters()
        vit_base = model.extend_with_vit(None, image, marks)
    assert same_keys(vit_alone, vit_base)
    assert not same_keys(tuned, context, slice(0, 18))
