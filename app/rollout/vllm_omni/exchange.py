"""What the vllm-omni engine (engine.py, in the replica's process) and our FlowGRPO pipelines (in vllm-omni's
worker process) exchange, in one public place.

Engine → pipeline: a request's `sampling_params.extra_args[EXTRA_ARGS_KEY]` holds its `FlowGRPOArgs`; a request
without it runs the stock pipeline.

Pipeline → engine: the request's output carries
    trajectory_latents    [n, T+1, L, C] fp32   x at every σ, as the denoiser saw it
    trajectory_log_probs  [n, T] fp32           log-prob of each taken step
    trajectory_timesteps  dict: "timesteps" [T], "sigmas" [T+1], and "fields": the family's conditioning as
                          `Trajectory` fields (Qwen-Image: prompt_embeds, prompt_mask, negative ones under CFG;
                          BAGEL: conditioning), so the engine builds the record without knowing the family;
                          and "worker": the worker process's state as the output left it (`worker_stats`)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

EXTRA_ARGS_KEY = "flowgrpo"


@dataclass(frozen=True)
class FlowGRPOArgs:
    """How one request's group is sampled (the sampling settings vllm-omni has no field for)."""

    seed: int  # seeds the whole group: image j of the group draws from generator (seed, sample_offset + j)
    sample_offset: int
    noise_level: float
    sde_type: str
    sde_window: tuple[int, int] | None  # steps outside it take the ODE step (app/algo/sde_window.py)
    lora_version: int = 0  # the adapter a pipeline that serves LoRAs itself applies (0: the base model)

    def extra_args(self) -> dict:
        args = asdict(self)
        args["sde_window"] = list(self.sde_window) if self.sde_window is not None else None
        return {EXTRA_ARGS_KEY: args}

    @classmethod
    def of(cls, sampling_params) -> FlowGRPOArgs | None:
        """The request's arguments (None: a plain request for the stock pipeline)."""
        args = (getattr(sampling_params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
        if args is None:
            return None
        window = args.get("sde_window")
        return cls(seed=int(args["seed"]), sample_offset=int(args["sample_offset"]),
                   noise_level=float(args["noise_level"]), sde_type=str(args["sde_type"]),
                   sde_window=None if window is None else (int(window[0]), int(window[1])),
                   lora_version=int(args.get("lora_version", 0)))

    def batch_key(self) -> tuple:
        """What requests batched into one forward must share."""
        return self.noise_level, self.sde_type, self.sde_window


def side_output(timesteps, sigmas, fields: dict) -> dict:
    """The `trajectory_timesteps` entry of an output (see the module doc)."""
    return {"timesteps": timesteps, "sigmas": sigmas, "fields": fields, "worker": worker_stats()}


def worker_stats() -> dict:
    """What the replica reports of the process the transformer runs in (the in-process engines read their own):
    dynamo's frames compiled so far (`compile_frames`: steady state means it stops growing) and the GPU memory
    peak (`gpu_peak_gib`, CUDA only)."""
    import torch

    from app.models.compile import compile_counts

    stats = {"compile_frames": compile_counts()["frames"]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return stats
