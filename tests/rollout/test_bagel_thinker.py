"""BAGEL on vllm-omni's two-stage deploy (`rollout.thinker_stage`): a thinker stage prefills the prompt and hands its
KV to our DiT pipeline. The thinker runs on CUDA only (vLLM's AR worker; none on the CPU platform), so here: what
the engine sends it, and what the pipeline records from a thinker's contexts (their KV lengths stand in for the
thinker), against the ids the trainer rebuilds the contexts from. The GPU run: docs/perf/vllm_omni/README.md."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from app.config import ConfigError, load
from app.models.bagel.context import BOS, EOS, text_conditioning, tokenizer_of
from app.models.bagel.flux_ae import TINY_AE_KEY
from app.rollout.vllm_omni.engine import VllmOmniEngine
from app.types import GenerationRequest, RequestError

CONFIGS = "configs"


def _request(**fields) -> GenerationRequest:
    return GenerationRequest(**{"prompt": 'a sign "OPEN"', "height": 64, "width": 64, "num_inference_steps": 4,
                                "noise_level": 0.7, "sde_type": "sde", "n": 2, **fields})


def test_the_thinker_gets_the_chat_wrapped_prompt_and_an_image_modality():
    prompt = VllmOmniEngine._thinker_prompt(_request(guidance_scale=4.0, negative_prompt="blurry"))
    assert prompt == {"prompt": f'{BOS}a sign "OPEN"{EOS}', "modalities": ["image"],
                      "negative_prompt": f"{BOS}blurry{EOS}"}
    # an empty negative prompt is BAGEL's empty context: no companion request
    assert "negative_prompt" not in VllmOmniEngine._thinker_prompt(_request(guidance_scale=4.0, negative_prompt=""))
    with pytest.raises(RequestError, match="image=.*thinker_stage=false"):
        VllmOmniEngine._thinker_prompt(_request(image=torch.zeros(64, 64, 3, dtype=torch.uint8)))


def test_a_thinker_stage_is_bagels_on_vllm_omni_and_needs_cuda(tiny_bagel_dir, tmp_path):
    config = load(f"{CONFIGS}/tiny_bagel_cpu.yaml", ["rollout.engine=vllm_omni", "rollout.thinker_stage=true",
                                                      "train.old_logprob=recompute"])
    assert config.rollout.thinker_stage
    with pytest.raises(ConfigError, match="rollout.thinker_stage=false"):
        load(f"{CONFIGS}/tiny_cpu.yaml", ["rollout.thinker_stage=true"])
    with pytest.raises(ConfigError, match="rollout.thinker_stage=false"):
        load(f"{CONFIGS}/tiny_bagel_cpu.yaml", ["rollout.engine=bagel", "rollout.thinker_stage=true"])
    with pytest.raises(ValueError, match="tiny-bagel-full-ae"):  # the thinker's model cannot load its autoencoder
        VllmOmniEngine(tiny_bagel_dir, family="bagel", thinker_stage=True)
    if not torch.cuda.is_available():  # a checkpoint with the real autoencoder: its config.json is all that is read
        config_json = json.loads((tiny_bagel_dir / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config_json.items() if k != TINY_AE_KEY}))
        with pytest.raises(ValueError, match="CUDA only"):
            VllmOmniEngine(tmp_path, family="bagel", thinker_stage=True)


def _pipeline_stand_in(tokenizer):
    """What `_record_thinker_contexts` uses of our pipeline: vllm-omni's own tokenization of a context, recorded as
    the pipeline's wrapper records it."""
    from vllm_omni.diffusion.models.bagel.bagel_transformer import Bagel

    recorded = {}

    def prepare_prompts(**kwargs):
        out = Bagel.prepare_prompts(None, **kwargs)
        recorded[kwargs["prompts"][0]] = out[0]["packed_text_ids"]
        return out

    new_token_ids = {"bos_token_id": tokenizer.convert_tokens_to_ids(BOS),
                     "eos_token_id": tokenizer.convert_tokens_to_ids(EOS)}
    return SimpleNamespace(bagel=SimpleNamespace(prepare_prompts=prepare_prompts), tokenizer=tokenizer,
                           new_token_ids=new_token_ids), recorded


def test_a_thinkers_contexts_are_recorded_as_the_trainer_rebuilds_them(tiny_bagel_dir):
    from app.rollout.vllm_omni.pipeline_bagel import FlowGRPOBagelPipeline

    tokenizer = tokenizer_of(str(tiny_bagel_dir))
    expected = text_conditioning(tokenizer, 'a sign "OPEN"', "blurry")
    pipe, recorded = _pipeline_stand_in(tokenizer)
    prompt = {"prompt": f'{BOS}a sign "OPEN"{EOS}', "negative_prompt": f"{BOS}blurry{EOS}"}
    thinker = {"gen_context": {"kv_lens": [len(expected["prompt_ids"])]},  # the KV the thinker would hand over
               "cfg_text_context": {"kv_lens": [len(expected["negative_ids"])]}}
    FlowGRPOBagelPipeline._record_thinker_contexts(pipe, prompt, thinker)
    assert torch.equal(recorded['a sign "OPEN"'], expected["prompt_ids"])
    assert torch.equal(recorded["blurry"], expected["negative_ids"])

    thinker["gen_context"]["kv_lens"] = [len(expected["prompt_ids"]) + 2]  # a thinker that tokenized otherwise
    with pytest.raises(RuntimeError, match="could not rebuild"):
        FlowGRPOBagelPipeline._record_thinker_contexts(pipe, prompt, thinker)
    with pytest.raises(ValueError, match="single-stage"):
        FlowGRPOBagelPipeline._record_thinker_contexts(pipe, {**prompt, "multi_modal_data": {"img2img": 0}}, thinker)


@pytest.mark.slow
def test_the_thinkers_own_model_loads_the_checkpoint_with_the_real_autoencoder(tiny_bagel_full_ae_dir, tiny_bagel_dir):
    """vllm-omni's thinker is its own model (vLLM's AR BAGEL), which builds the autoencoder's encoder at the real
    checkpoint's geometry whatever config.json declares: the tiny autoencoder cannot load into it (the first GPU run
    failed so), the real one can; built and loaded here on the CPU, as its worker does on CUDA."""
    def load(checkpoint):
        return subprocess.run([sys.executable, str(Path(__file__).parent / "thinker_model_load.py"), str(checkpoint)],
                              capture_output=True, text=True, timeout=600)

    done = load(tiny_bagel_full_ae_dir)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
    refused = load(tiny_bagel_dir)
    assert refused.returncode != 0 and "Attempted to load weight" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.gpu  # vllm-omni's thinker (vLLM's AR worker) runs on CUDA only: `pytest -m gpu` on a GPU machine
def test_a_thinker_stage_samples_groups_the_trainer_rescores(tiny_bagel_full_ae_dir, vllm_engines, aio):
    """The two-stage deploy end to end: the thinker prefills, our DiT pipeline samples a group on its KV and records
    the ids the trainer rebuilds the contexts from (the single stage's), and the trainer's fp32 recompute is as
    close to vllm-omni's bf16 log-probs as the single stage's (test_vllm_omni_bagel.py's bound)."""
    from test_vllm_omni_bagel import RECOMPUTE_BOUND, request, trainer_log_probs

    engine = vllm_engines.get(tiny_bagel_full_ae_dir, family="bagel", thinker_stage=True)
    traj = aio(engine.generate(request(edit=False, cfg=True)))
    ours = text_conditioning(tokenizer_of(str(tiny_bagel_full_ae_dir)), traj.prompt, None)
    assert torch.equal(traj.conditioning["prompt_ids"], ours["prompt_ids"])
    assert traj.latents.shape == (2, 4, 16, 64) and torch.isfinite(traj.log_probs).all()
    gap = (trainer_log_probs(tiny_bagel_full_ae_dir, traj) - traj.log_probs).abs()
    print(f"thinker + DiT (vllm-omni bf16) against the trainer's fp32: max |Δ log-prob| {float(gap.max()):.2e}")
    assert 0 < gap.max() <= RECOMPUTE_BOUND
