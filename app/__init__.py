"""ray-flowgrpo: FlowGRPO for diffusion image generators on Ray (library code).

Kept import-light on purpose: subpackages pull in torch, diffusers or vllm-omni only when used.
"""

__version__ = "0.1.0"
