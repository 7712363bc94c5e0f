"""cuDNN's SDPA backward against flash's (and fp32 math) at the shapes our trainers run, [B, H, S, D] bf16, the
[B, S, H, D] layout diffusers hands SDPA (transposed views). Prints the relative error of dq, dk, dv."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

def grads(q, k, v, go, backend):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out.backward(go)
    torch.cuda.synchronize()
    return [t.grad.float() for t in (q, k, v)]

for b, s, h in [(8, 1152, 24), (16, 1056, 30), (2, 1152, 24)]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for layout in ("bhsd", "bshd"):  # the gradient contiguous, or a transposed view as diffusers' permute hands it
        go = torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16)
        if layout == "bshd":
            go = go.transpose(1, 2).contiguous().transpose(1, 2)
        ref = grads(q, k, v, go, SDPBackend.FLASH_ATTENTION)
        try:
            got = grads(q, k, v, go, SDPBackend.CUDNN_ATTENTION)
            err = [float((g - r).norm() / r.norm()) for g, r in zip(got, ref)]
            print(f"B={b} S={s} H={h} grad {layout}: cudnn vs flash rel err dq {err[0]:.2e} dk {err[1]:.2e} "
                  f"dv {err[2]:.2e}", flush=True)
        except Exception as e:
            print(f"B={b} S={s} H={h} grad {layout}: cudnn failed: {str(e)[:120]}", flush=True)
            raise SystemExit
