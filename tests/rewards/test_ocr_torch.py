"""The OCR networks on torch (app/rewards/ocr_torch.py): rapidocr's ONNX graphs converted, checked against
onnxruntime running the same files. On the CPU here; a reward replica with a GPU runs the same modules there."""

import numpy as np
import onnx
import pytest

from app.rewards.ocr import OcrReward
from app.rewards.ocr_torch import _same_upper_pads, onnx_path, torch_compatible, torch_networks, use_torch
from jobs.bench_ocr import sign_images
from tests.rewards.test_rewards import noise, render


@pytest.fixture(scope="module")
def engines():
    """Two one-engine OCR rewards: onnxruntime's, and the same engine with its networks on torch (CPU)."""
    ort, on_torch = OcrReward(device="cpu"), OcrReward(device="cpu")
    engine = on_torch._engines[0]
    use_torch(engine, torch_networks(engine, "cpu"), "cpu")
    return ort, on_torch


def test_same_upper_becomes_explicit_pads_for_stride_one():
    assert _same_upper_pads([2, 2], [1, 1], [1, 1], "n") == [0, 0, 1, 1]  # PP-OCRv6's stem: the extra at the end
    assert _same_upper_pads([3, 3], [1, 1], [1, 1], "n") == [1, 1, 1, 1]
    assert _same_upper_pads([2, 3], [1, 1], [2, 1], "n") == [1, 1, 1, 1]
    with pytest.raises(NotImplementedError, match="strides"):
        _same_upper_pads([3, 3], [2, 2], [1, 1], "Conv.9")


@pytest.mark.parametrize("stage", ["Det", "Cls", "Rec"])
def test_the_rewritten_graph_keeps_no_same_upper_and_no_weight_constants(engines, stage):
    path = onnx_path(engines[0]._engines[0], stage)
    before = onnx.load(str(path))
    after = torch_compatible(before)
    assert not any(a.s == b"SAME_UPPER" for n in after.graph.node for a in n.attribute if a.name == "auto_pad")
    assert not any(n.op_type == "Constant" for n in after.graph.node)
    assert len(before.graph.node) >= len(after.graph.node)  # the argument is left as it was
    assert any(a.s == b"SAME_UPPER" for n in before.graph.node for a in n.attribute) == (stage != "Cls")


def test_each_network_on_torch_gives_onnxruntimes_output(engines):
    """The detector's probability map, the angle classifier's and the recogniser's softmax, each on the input
    rapidocr prepares for it, against onnxruntime (fp32 both; only the order of float additions differs)."""
    ort, on_torch = (r._engines[0] for r in engines)
    image = sign_images(1, 512)[0][0]
    det_input = ort._load_det_model().get_preprocess()(image)
    rng = np.random.default_rng(0)
    inputs = {"Det": det_input, "Cls": rng.standard_normal((3, 3, 48, 192), dtype=np.float32),
              "Rec": rng.standard_normal((2, 3, 48, 250), dtype=np.float32)}  # an odd width, as crops give
    for stage, x in inputs.items():
        a = getattr(ort, f"_load_{stage.lower()}_model")().session(x)
        b = getattr(on_torch, f"_load_{stage.lower()}_model")().session(x)
        assert a.shape == b.shape
        assert np.abs(a - b).max() < 1e-4, stage


def test_torch_networks_read_the_same_text_and_score_the_same(engines):
    ort, on_torch = engines
    images, prompts = sign_images(6, 512)
    images = np.concatenate([images, np.stack([np.asarray(np.pad(render("OPEN 24H"), ((208, 208), (128, 128),
                                                                                       (0, 0)),
                                                                  constant_values=255)), noise((512, 512))])])
    prompts += ['a sign that says "OPEN 24H"', 'a sign that says "EXIT"']
    scores, texts = ort.score_and_read(images, prompts)
    assert on_torch.score_and_read(images, prompts) == (scores, texts)
    assert texts[1] == "OPEN 1 STORE" and texts[-1] == ""


def test_a_device_it_cannot_use_is_named():
    with pytest.raises(ValueError, match="device='tpu'"):
        OcrReward(device="tpu")


def test_a_process_without_a_gpu_reads_on_its_cpus():
    assert OcrReward().device == "cpu"  # the CPU machine; a replica given a GPU share defaults to "cuda"
