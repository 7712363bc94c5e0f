"""Build vllm-omni's thinker model (`OmniBagelForConditionalGeneration`, vLLM's AR model of BAGEL) on the CPU and
load a checkpoint into it with vLLM's loader, as the thinker stage's worker does on CUDA (it cannot run here: no AR
worker on the CPU platform). Prints "loaded N" or fails with vLLM's error.
    python tests/rollout/thinker_model_load.py CHECKPOINT [DTYPE]"""

import sys

import torch
from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader import get_model_loader

from app.platform.vllm_omni.cpu_ops import define_missing_ops

define_missing_ops()  # this vLLM wheel has no CPU kernels; the model's MLPs bind one when built


def main(path: str, dtype: str = "float32") -> None:
    from vllm_omni.model_executor.models.bagel.bagel import OmniBagelForConditionalGeneration

    model_config = ModelConfig(model=path, trust_remote_code=True, dtype=dtype, enforce_eager=True)
    config = VllmConfig(model_config=model_config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:0")
        initialize_model_parallel(1, 1)
        with torch.device("cpu"):
            model = OmniBagelForConditionalGeneration(vllm_config=config)
        get_model_loader(config.load_config).load_weights(model, model_config)
    print("loaded", sum(p.numel() for p in model.parameters()))


if __name__ == "__main__":
    main(*sys.argv[1:])
