"""Every registered model family wears the whole face (app/models/family.py), and nothing outside app/models/
branches on a family's name."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from app.models.family import FAMILY_NAMES, VLLM_OMNI, FamilyBase, ModelFamily, all_engines, get_family

ROOT = Path(__file__).resolve().parents[1]
FACE = [f.name for f in dataclasses.fields(FamilyBase)] + [
    name for name, value in vars(ModelFamily).items() if inspect.isfunction(value)]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_family_declares_the_whole_face(name):
    family = get_family(name)
    assert isinstance(family, FamilyBase) and family.name == name
    missing = [attr for attr in FACE if not hasattr(family, attr)]
    assert not missing, f"{name} lacks {missing}"
    for method in (m for m, v in vars(ModelFamily).items() if inspect.isfunction(v)):
        assert getattr(type(family), method) is not getattr(ModelFamily, method), f"{name}.{method} is not defined"
    assert VLLM_OMNI in family.engines and set(family.exact_engines) <= set(family.engines)
    assert family.lora_targets and family.checkpoint_files and family.tiny_preset in family.presets
    for engine in family.engines:
        assert callable(family.engine_class(engine).from_config)


def test_the_config_s_engine_choices_are_the_families_engines():
    from app.config import Engine
    from app.config import ModelFamily as FamilyChoice

    assert [str(e) for e in Engine] == list(all_engines())
    assert [str(f) for f in FamilyChoice] == list(FAMILY_NAMES)


def test_an_unknown_family_or_engine_is_named_in_the_error():
    with pytest.raises(ValueError, match="model.family='sd9' is not one of"):
        get_family("sd9")
    with pytest.raises(ValueError, match="rollout.engine=bagel cannot run model.family=qwen_image"):
        get_family("qwen_image").engine_class("bagel")


def test_a_checkpoint_folder_is_recognised_by_its_files(tmp_path):
    qwen = get_family("qwen_image")
    assert qwen.checkpoint_problem(tmp_path) == "is not a diffusers Qwen-Image folder (missing model_index.json)"
    (tmp_path / "model_index.json").write_text("{}")
    assert qwen.checkpoint_problem(tmp_path) is None


def test_nothing_outside_app_models_branches_on_a_family_name():
    """The search the issue asks for: a comparison with, or a lookup by, a family's name as a string."""
    names = "|".join(FAMILY_NAMES)
    quoted = rf"""["']({names})["']"""
    branch = re.compile(rf"(==|!=|\bin\b)\s*\(?\s*{quoted}|{quoted}\s*(==|!=)|\[{quoted}\]")
    found = []
    for path in [*ROOT.glob("app/**/*.py"), *ROOT.glob("deployments/*.py"), *ROOT.glob("jobs/*.py")]:
        if path.relative_to(ROOT).parts[:2] == ("app", "models"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if branch.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
