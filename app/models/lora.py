"""peft LoRA on a diffusers transformer: attach an in-memory adapter, export one (adapter tensors only), read a saved
one and check that a family's replicas can serve it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from app.types import LoraAdapter

ADAPTER_NAME = "flowgrpo"
PEFT_PREFIX = "base_model.model."  # peft's wrapper prefix
PIPELINE_PREFIX = "transformer."  # a diffusers pipeline's component prefix (its LoRA files, full weights)


@dataclass(frozen=True)
class LoraShape:
    """What makes two adapters interchangeable in one module: rank, alpha and target modules."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @classmethod
    def of(cls, model) -> LoraShape:
        """The shape of a run config's model section (`model.lora_*`)."""
        return cls(int(model.lora_rank), float(model.lora_alpha), tuple(model.lora_targets))


def add_zero_lora(transformer, shape: LoraShape, adapter_name: str = ADAPTER_NAME) -> None:
    """Give `transformer` the peft adapter `adapter_name` of `shape` with B = 0 (peft's initialisation): the base
    model's outputs exactly, in the module structure every later adapter of that shape is copied into."""
    from peft import LoraConfig

    transformer.add_adapter(LoraConfig(r=shape.rank, lora_alpha=shape.alpha,
                                       target_modules=list(shape.target_modules)), adapter_name)


def transformer_key(key: str) -> str:
    """A tensor name relative to the transformer: without peft's or the pipeline's prefix, in whichever form the
    name arrived (every place that receives LoRA or weight names starts here)."""
    return key.removeprefix(PEFT_PREFIX).removeprefix(PIPELINE_PREFIX)


def attach_lora(transformer, adapter: LoraAdapter, adapter_name: str = ADAPTER_NAME, *, create: bool = True) -> None:
    """Load `adapter` into the transformer's peft adapter `adapter_name` (created when missing and `create`)."""
    from peft import set_peft_model_state_dict

    existing = getattr(transformer, "peft_config", {}) or {}
    if adapter_name not in existing:
        if not create:
            raise ValueError(f"the transformer has no adapter named {adapter_name!r}")
        add_zero_lora(transformer, LoraShape(adapter.rank, adapter.alpha, tuple(adapter.target_modules)),
                      adapter_name)
    tensors = {transformer_key(k): v for k, v in adapter.tensors.items()}
    result = set_peft_model_state_dict(transformer, tensors, adapter_name=adapter_name)
    if result.unexpected_keys:
        raise ValueError(f"LoRA tensors do not match the transformer: {result.unexpected_keys[:3]}")


def copy_into_lora(transformer, adapter: LoraAdapter, adapter_name: str = ADAPTER_NAME) -> bool:
    """Overwrite the existing peft adapter `adapter_name` with `adapter`'s tensors in one fused copy (no state-dict
    conversion and no copy per tensor, as `set_peft_model_state_dict` does: 0.025 s against 0.18 s at real size).
    False, with nothing changed, when the adapter does not have exactly those tensors (rank, targets):
    `attach_lora` then."""
    params = {name: p for name, p in transformer.named_parameters() if f".{adapter_name}." in name}
    targets = []
    for key, tensor in adapter.tensors.items():
        name = transformer_key(key)
        for part in (".lora_A.", ".lora_B."):  # peft names a parameter after its adapter
            name = name.replace(part, f"{part}{adapter_name}.")
        param = params.get(name)
        if param is None or param.shape != tensor.shape:
            return False
        targets.append((param, tensor))
    if len(targets) != len(params):
        return False
    with torch.no_grad():
        torch._foreach_copy_([p for p, _ in targets], [t for _, t in targets])
    return True


def export_lora(transformer, *, version: int, adapter_name: str = ADAPTER_NAME) -> LoraAdapter:
    """The adapter's tensors (detached CPU copies, peft/diffusers names) as a versioned `LoraAdapter`."""
    from peft import get_peft_model_state_dict

    config = transformer.peft_config[adapter_name]
    tensors = {k: v.detach().to("cpu", copy=True)
               for k, v in get_peft_model_state_dict(transformer, adapter_name=adapter_name).items()}
    return LoraAdapter(tensors, rank=config.r, alpha=config.lora_alpha, target_modules=sorted(config.target_modules),
                       version=version)


def targeted(module_name: str, target_modules) -> bool:
    """Whether a LoRA on `target_modules` (a list) adapts the module `module_name`: peft's rule, the name is a
    target or ends with "." and one."""
    return any(module_name == t or module_name.endswith("." + t) for t in target_modules)


def target_layers(module, target_modules) -> dict[str, torch.Tensor]:
    """{name: weight} of `module`'s linear layers that a LoRA on `target_modules` adapts, by peft's own matching
    rule, in module order (plain Linears, or peft's wrappers of them in a live engine)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(target_modules=list(target_modules))
    out = {}
    for name, layer in module.named_modules():
        weight = getattr(layer, "weight", None)  # a wrapper's is its base layer's
        linear = isinstance(layer, torch.nn.Linear) or hasattr(layer, "base_layer")
        if linear and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
                and check_target_module_exists(config, name):
            out[name] = weight
    return out


def random_lora(module, *, version: int, rank: int, target_modules: list[str], seed: int, scale: float = 1.0,
                alpha: float | None = None) -> LoraAdapter:
    """A non-trivial random adapter (A and B both random, B times `scale`) for tests and benchmarks, made from
    the shapes of `module`'s target layers (plain Linears, or peft's wrappers of them in a live engine) without
    touching the module: peft's add/delete would leave wrappers behind. The values are those peft gives with
    `init_lora_weights=False` (torch's Linear initialisation, in peft's order) under `seed`; alpha defaults to the
    rank."""
    import math

    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=target_modules)
    tensors = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, weight in target_layers(module, target_modules).items():
            a, b = torch.empty(rank, weight.shape[1]), torch.empty(weight.shape[0], rank)
            for t in (a, b):
                torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))
            tensors[f"{name}.lora_A.weight"] = a.to(weight.dtype)
            tensors[f"{name}.lora_B.weight"] = (b * scale).to(weight.dtype)
    if not tensors:
        raise ValueError(f"no linear layer of {type(module).__name__} matches target_modules={target_modules}")
    return LoraAdapter(tensors, rank=rank, alpha=config.lora_alpha, target_modules=sorted(target_modules),
                       version=version)


def read_adapter(path: str | Path, *, version: int) -> LoraAdapter:
    """A saved LoRA as a `LoraAdapter` of `version`: a peft adapter folder (`adapter_model.safetensors` +
    `adapter_config.json`), a diffusers LoRA folder or file (`pytorch_lora_weights.safetensors`, its metadata in
    the file), or a checkpoint folder of ours (its `adapter/`). Rank from the tensors; alpha and target modules from
    the metadata when there is some (alpha defaults to the rank, as diffusers does). A ValueError says what is
    wrong."""
    import json

    from safetensors import safe_open

    path = Path(path).expanduser()
    if path.is_dir() and (path / "adapter").is_dir():
        path = path / "adapter"
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        preferred = [f for f in files if f.name in ("adapter_model.safetensors", "pytorch_lora_weights.safetensors")]
        if len(preferred or files) != 1:
            raise ValueError(f"{path}: expected one LoRA weights file (adapter_model.safetensors or "
                             f"pytorch_lora_weights.safetensors); found {[f.name for f in files] or 'none'}")
        weights = (preferred or files)[0]
    elif path.is_file():
        weights = path
    else:
        raise ValueError(f"{path}: no such adapter folder or file")
    with safe_open(str(weights), "pt") as handle:
        header = handle.metadata() or {}
        tensors = {transformer_key(k): handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 (not a dict)
    meta = {}
    if "lora_adapter_metadata" in header:  # diffusers: {"transformer.r": ..., "transformer.lora_alpha": ...}
        meta = {k.removeprefix(PIPELINE_PREFIX): v for k, v in json.loads(header["lora_adapter_metadata"]).items()}
    elif (weights.parent / "adapter_config.json").is_file():  # peft
        meta = json.loads((weights.parent / "adapter_config.json").read_text())
    ranks = {t.shape[0] for k, t in tensors.items() if ".lora_A." in k}
    if len(ranks) != 1:
        raise ValueError(f"{weights}: not a LoRA in peft/diffusers naming (<module>.lora_A.weight / .lora_B.weight"
                         f"{'' if ranks else ', none found'}; ranks {sorted(ranks)})")
    rank = ranks.pop()
    targets = meta.get("target_modules") or sorted({lora_module(k).rsplit(".", 1)[-1] for k in tensors})
    return LoraAdapter(tensors, rank=rank, alpha=float(meta.get("lora_alpha") or rank),
                       target_modules=sorted(targets), version=version)


def lora_module(key: str) -> str:
    """The module a LoRA tensor belongs to: `a.b.lora_A.weight` -> `a.b`."""
    return key.split(".lora_A.")[0].split(".lora_B.")[0]


def adapter_problem(adapter: LoraAdapter, *, family, rank: int, targets: list[str]) -> str | None:
    """Why the rollout replicas of `family` built for a LoRA of `rank` on `targets` (the config's model section)
    cannot serve `adapter`, naming the setting to change; None when they can."""
    from app.models.family import FAMILY_NAMES, get_family

    modules = sorted({lora_module(k) for k in adapter.tensors})
    if foreign := [m for m in modules if m.split(".", 1)[0] not in family.adapter_roots]:
        owner = [name for name in FAMILY_NAMES
                 if all(m.split(".", 1)[0] in get_family(name).adapter_roots for m in modules)]
        of = f"a LoRA of model.family={owner[0]}" if owner else "not a LoRA of any known family"
        return (f"is {of}, not of model.family={family.name} (its module {foreign[0]!r} is not in "
                f"{family.name}'s {list(family.adapter_roots)}): evaluate it with a config of its family")
    if adapter.rank != rank:
        return f"has LoRA rank {adapter.rank}; the config's model.lora_rank={rank}: set model.lora_rank={adapter.rank}"
    untargeted = [m for m in modules if not targeted(m, targets)]
    missing = [t for t in targets if not any(targeted(m, [t]) for m in modules)]
    if untargeted or missing:
        what = (f"trains {untargeted[0]!r}, which model.lora_target_modules={targets} does not name" if untargeted
                else f"does not train {missing[0]!r}, which model.lora_target_modules={targets} names")
        return f"{what}: set model.lora_target_modules={list(adapter.target_modules)}"
    return None
