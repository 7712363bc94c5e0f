"""What a checkpoint holds and how it is written and read back (no Ray here: Ray Train moves the folder).

    adapter/pytorch_lora_weights.safetensors   the LoRA, loadable by diffusers `load_lora_weights`
    optimizer.pt                               full (unsharded) optimizer state of the LoRA parameters
    trainer_state.json                         steps done, adapter version, data position, seed
    rng_rank<r>.pt                             each rank's torch RNG state

Saving is a collective under FSDP2 (the adapter and optimizer state are gathered); rank 0 writes the shared
files, every rank its RNG state, into the same folder name (Ray Train merges the ranks' folders).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from app.train.policy import Policy, load_adapter_tensors

STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done (the next step to run)
    adapter_version: int = 0  # version of the adapter the rollout replicas serve (0: base model)
    data_position: int = 0  # prompt groups drawn so far
    seed: int = 0


def save(directory: str | Path, *, policy: Policy, optimizer: torch.optim.Optimizer, state: TrainerState,
         rank: int, adapter: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a checkpoint; `adapter`: the full LoRA tensors if already gathered (else gathered here)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    adapter = policy.adapter_state() if adapter is None else adapter  # gathering is a collective
    optim_state = get_optimizer_state_dict(policy.transformer, optimizer,
                                           options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.save(torch.get_rng_state(), directory / f"rng_rank{rank}.pt")
    if rank == 0:
        policy.save_adapter(directory / "adapter", adapter)
        torch.save(optim_state, directory / "optimizer.pt")
        (directory / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
    return directory


@dataclass
class Restored:
    state: TrainerState
    adapter: dict[str, torch.Tensor]
    optimizer: dict
    rng: torch.Tensor | None


def load(directory: str | Path, *, rank: int) -> Restored:
    directory = Path(directory)
    state = TrainerState(**json.loads((directory / STATE_FILE).read_text()))
    rng_file = directory / f"rng_rank{rank}.pt"
    return Restored(state=state, adapter=load_adapter_tensors(directory / "adapter"),
                    optimizer=torch.load(directory / "optimizer.pt", weights_only=True),
                    rng=torch.load(rng_file, weights_only=True) if rng_file.exists() else None)


def restore_optimizer(policy: Policy, optimizer: torch.optim.Optimizer, optim_state: dict) -> None:
    """Load a full optimizer state into a (possibly sharded) optimizer; every rank passes the same state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(policy.transformer, optimizer, optim_state_dict=optim_state,
                             options=StateDictOptions(full_state_dict=True))
