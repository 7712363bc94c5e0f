"""Where vllm-omni's SD3 transformer and diffusers' part ways in fp32 on CUDA (issue 51: the two engines' latents
agreed within 1e-5 on the CPU, not on an H100). Prints, for fp32 inputs of the tiny SD3's sizes on the GPU, the max
|difference| of each building block vllm-omni swaps in against the one diffusers runs: vllm's RMSNorm (its CUDA
kernel, and the native path) against diffusers' RMSNorm, and a fused q/k/v projection against three separate ones.

    python docs/perf/vllm_omni/sd3_kernels.py
"""

import json

import torch


def main() -> None:
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    device = torch.device("cuda")
    out = {}
    for head_dim in (8, 64):
        x = torch.randn(3, 4, 300, head_dim, device=device) * 3
        weight = torch.rand(head_dim, device=device) + 0.5
        ref = DiffusersRMSNorm(head_dim, eps=1e-6).to(device)
        ref.weight.data.copy_(weight)
        with set_current_vllm_config(VllmConfig()):
            norm = RMSNorm(head_dim, eps=1e-6).to(device)
        norm.weight.data.copy_(weight)
        expected = ref(x)
        x64 = x.double()
        exact = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double())
        flat = x.reshape(-1, head_dim)
        row = {"diffusers_vs_fp64": float((expected.double() - exact).abs().max()),
               "vllm_native_vs_diffusers": float((norm.forward_native(x) - expected).abs().max()),
               "vllm_cuda_vs_diffusers": float((norm.forward_cuda(flat.clone()).reshape(x.shape)
                                                - expected).abs().max()),
               "vllm_dispatched_cuda": norm._forward_method == norm.forward_cuda}
        out[f"rms_norm_head_dim_{head_dim}"] = row
    for width in (32, 1536):
        x = torch.randn(2, 333, width, device=device)
        w = torch.randn(3 * width, width, device=device) / width ** 0.5
        fused = x @ w.T
        separate = torch.cat([x @ part.T for part in w.chunk(3)], dim=-1)
        out[f"qkv_fused_vs_separate_width_{width}"] = float((fused - separate).abs().max())
    out["tf32"] = {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
