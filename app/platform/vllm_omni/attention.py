"""SDPA attention for vllm-omni on the CPU platform (see platform.py)."""

from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    def forward(self, query, key, value, attn_metadata=None):
        # vllm-omni dispatches on the platform name; its CUDA path is device-agnostic torch SDPA
        return self.forward_cuda(query, key, value, attn_metadata)


class CpuSDPABackend(SDPABackend):
    @staticmethod
    def get_impl_cls():
        return CpuSDPAImpl
