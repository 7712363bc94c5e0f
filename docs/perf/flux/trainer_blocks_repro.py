"""FLUX.1's trainer blocks on one GPU, in isolation: two double-stream and two single-stream blocks of FLUX.1-dev's
width (3072, 24 heads of 128), a peft LoRA r=64 on the recipe's targets, a micro-batch of 8 at 512² (128 T5 tokens,
1024 image tokens), FLUX's rotary positions, forward and backward as the trainer runs them (app.models.compile:
each block's forward compiled with dynamic shapes, selective checkpointing inside). The 2026-11-29 lease saw the
compiled trainer hit an illegal memory access in its first backward; a variant per process (such an error poisons
the process's CUDA context):

    python docs/perf/flux/trainer_blocks_repro.py VARIANT [--width 3072 --heads 24 --batch 8 --device cuda]

VARIANT: compiled | compiled-no-cudnn | compiled-no-checkpoint | eager | eager-no-cudnn"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from app.models.attention import use_sdpa_kernels  # noqa: E402
from app.models.compile import compile_blocks  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("variant")
p.add_argument("--width", type=int, default=3072)
p.add_argument("--heads", type=int, default=24)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--text", type=int, default=128)
p.add_argument("--grid", type=int, default=32)  # 512² → 32x32 packed tokens
p.add_argument("--device", default="cuda")
a = p.parse_args()

from diffusers.models.transformers.transformer_flux import (  # noqa: E402
    FluxPosEmbed, FluxSingleTransformerBlock, FluxTransformerBlock)
from peft import LoraConfig, inject_adapter_in_model  # noqa: E402

torch.manual_seed(0)
dev, dt = torch.device(a.device), torch.bfloat16
head = a.width // a.heads
model = torch.nn.Module()
model.doubles = torch.nn.ModuleList([FluxTransformerBlock(a.width, a.heads, head) for _ in range(2)])
model.singles = torch.nn.ModuleList([FluxSingleTransformerBlock(a.width, a.heads, head) for _ in range(2)])
model.requires_grad_(False)
targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
           "ff_context.net.2"]
model = inject_adapter_in_model(LoraConfig(r=64, lora_alpha=128, target_modules=targets), model)
for n, prm in model.named_parameters():
    if "lora_B" in n:  # a trained adapter, not peft's zero init: gradients reach every path
        torch.nn.init.normal_(prm, std=0.01)
model.to(dev, dt)
blocks = [*model.doubles, *model.singles]
if a.variant.startswith("compiled"):
    compile_blocks(blocks, checkpoint="no-checkpoint" not in a.variant)
if "no-cudnn" in a.variant:
    use_sdpa_kernels(["flash", "efficient", "math"])

axes = (16, 56, 56) if head == 128 else (head // 4, head // 8 * 3, head // 8 * 3)
ids = torch.zeros(a.grid, a.grid, 3)
ids[..., 1] += torch.arange(a.grid)[:, None]
ids[..., 2] += torch.arange(a.grid)[None, :]
ids = torch.cat([torch.zeros(a.text, 3), ids.reshape(-1, 3)]).to(dev)
rope = FluxPosEmbed(theta=10000, axes_dim=list(axes))(ids)

for it in range(3):
    t0 = time.perf_counter()
    x = torch.randn(a.batch, a.grid * a.grid, a.width, device=dev, dtype=dt, requires_grad=True)
    e = torch.randn(a.batch, a.text, a.width, device=dev, dtype=dt)
    temb = torch.randn(a.batch, a.width, device=dev, dtype=dt)
    h = x
    for blk in blocks:
        e, h = blk(hidden_states=h, encoder_hidden_states=e, temb=temb, image_rotary_emb=rope)
    loss = h.float().square().mean()
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    grad = sum(float(prm.grad.float().norm()) for prm in model.parameters() if prm.grad is not None)
    print(f"{a.variant} pass {it}: loss {float(loss):.4f} lora grad norm {grad:.4f} {time.perf_counter() - t0:.1f}s",
          flush=True)
    model.zero_grad()
print(f"{a.variant}: ok")
