"""rapidocr's own PP-OCR networks on torch, so that a reward replica with a GPU reads text there.

rapidocr ships its detector, recogniser and angle classifier as ONNX files inside its wheel (no download), and
runs them with onnxruntime, whose GPU build for this stack's CUDA does not exist as a wheel here. onnx2torch turns
the same ONNX graphs, weights included, into torch modules after two rewrites it cannot do itself:

- `auto_pad: SAME_UPPER` (three 2x2 stride-1 layers of PP-OCRv6's stem): for stride 1 the padding does not depend
  on the input's size, so it becomes explicit `pads` (the extra row and column at the end, as SAME_UPPER puts it);
- weights held in `Constant` nodes (the angle classifier's older export) become initializers.

rapidocr keeps its pre- and post-processing (resizing, the DB box search, crops, CTC decoding) on the CPU; only the
networks move (`TorchSession` replaces the engine's onnxruntime session).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np


def _same_upper_pads(kernel: list[int], strides: list[int], dilations: list[int], node: str) -> list[int]:
    """ONNX `pads` (all begins, then all ends) equal to SAME_UPPER for stride 1: total d·(k − 1) per axis, the odd
    one at the end."""
    if any(s != 1 for s in strides):  # the padding would depend on the input's size: not needed by PP-OCR
        raise NotImplementedError(f"{node}: SAME_UPPER with strides {strides} (only stride 1 is rewritten)")
    totals = [d * (k - 1) for k, d in zip(kernel, dilations, strict=True)]
    return [t // 2 for t in totals] + [t - t // 2 for t in totals]


def torch_compatible(model):
    """The ONNX model rewritten as described in the module docstring (a copy; the argument is unchanged)."""
    import onnx
    from onnx import helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    kept = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Constant" and "value" in attrs and len(node.output) == 1:
            tensor = attrs["value"]
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
            continue
        if attrs.get("auto_pad") == b"SAME_UPPER":
            spatial = len(attrs["kernel_shape"])
            pads = _same_upper_pads(attrs["kernel_shape"], attrs.get("strides", [1] * spatial),
                                    attrs.get("dilations", [1] * spatial), node.name)
            for a in list(node.attribute):
                if a.name in ("auto_pad", "pads"):
                    node.attribute.remove(a)
            node.attribute.append(helper.make_attribute("pads", pads))
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    return model


def load_torch_network(path: str | Path):
    """The ONNX network at `path` as a torch module (eval mode, on the CPU)."""
    import onnx
    import onnx2torch

    # onnx2torch's Slice indexes with a list, which torch warns about at every new shape; the result is right
    warnings.filterwarnings("ignore", message="Using a non-tuple sequence for multidimensional indexing",
                            category=UserWarning)
    return onnx2torch.convert(torch_compatible(onnx.load(str(path)))).eval()


class TorchSession:
    """Stands in for rapidocr's onnxruntime session: the same call (a float32 NCHW array in, the network's first
    output out), run by a torch module on `device`. The dictionary lookups rapidocr makes at construction stay with
    the onnxruntime session it replaces (`original`). Safe to call from several threads: inference keeps no state."""

    def __init__(self, network, device, original):
        self.network, self.device, self.original = network, device, original

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self.network(torch.from_numpy(np.ascontiguousarray(batch)).to(self.device))
        if isinstance(out, (tuple, list)):
            out = out[0]
        return out.float().cpu().numpy()

    def __getattr__(self, name):  # have_key, get_character_list, ...: the original session's
        if name == "original":  # not set yet (a copy being built): no lookup through it
            raise AttributeError(name)
        return getattr(self.original, name)


def onnx_path(engine, stage) -> Path:
    """The ONNX file rapidocr loaded for `stage` (its Det/Cls/Rec config), found as rapidocr finds it."""
    from rapidocr.inference_engine.base import FileInfo, InferSession

    cfg = getattr(engine.cfg, stage)
    if cfg.get("model_path"):
        return Path(cfg.model_path)
    info = InferSession.get_model_url(FileInfo(engine_type=cfg.engine_type, ocr_version=cfg.ocr_version,
                                               task_type=cfg.task_type, lang_type=cfg.lang_type,
                                               model_type=cfg.model_type))
    return Path(engine.cfg.Global.model_root_dir) / Path(info["model_dir"]).name


def torch_networks(engine, device) -> dict[str, object]:
    """The engine's three networks as torch modules on `device`, by rapidocr's stage name (Det, Cls, Rec)."""
    return {stage: load_torch_network(onnx_path(engine, stage)).to(device) for stage in ("Det", "Cls", "Rec")}


def use_torch(engine, networks: dict[str, object], device) -> None:
    """Point a RapidOCR engine's three sessions at the torch `networks` (shared between engines)."""
    stages = {"Det": engine._load_det_model(), "Cls": engine._load_cls_model(), "Rec": engine._load_rec_model()}
    for stage, model in stages.items():
        model.session = TorchSession(networks[stage], device, original=model.session)
