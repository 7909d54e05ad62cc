"""The model-family registry (models/registry.py): a folder's family from its transformer class, the
variant from its sampling contract, one line for a class no family loads."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from distillery.cli.guard import run_guarded
from distillery.common.errors import UserError
from distillery.models import registry
from distillery.models.base import CausalModelBase, PDDModelBase
from distillery.sampling import build_sampler
from distillery.tinybase.shipped import shipped_tiny_base

SHIFT = 3.0


def _artifact(tmp_path: Path, name: str, contract: dict) -> Path:
    """An artifact's ``model/`` as a training stage publishes it: the tiny base's transformer and
    scheduler, and ``sampling.json``."""
    model = tmp_path / name / "model"
    for part in ("transformer", "scheduler"):
        shutil.copytree(shipped_tiny_base() / part, model / part)
    (model / "sampling.json").write_text(json.dumps(contract))
    return model


def _load_as_contract_says(folder: Path):
    """What validate and the exported pipeline do: the folder's family loads it as its contract asks."""
    sampler = build_sampler(json.loads((folder / "sampling.json").read_text()))
    return registry.load_inference_model(folder, shift=SHIFT, **sampler.model_options())


def test_the_tiny_wan_folders_resolve_to_the_wan_loaders(tmp_path):
    from distillery.models.wan import CausalWanModel, PDDWanModel, WanModel
    from distillery.models.wan.pdd import write_head_bank

    base = shipped_tiny_base()
    causal = _artifact(tmp_path, "pretrain", {"sampler": "causal_streaming", "shift": SHIFT, "num_train_timesteps": 1000,
                                              "timesteps": [1000.0, 500.0], "chunk_size": 2})
    pdd = _artifact(tmp_path, "pdd", {"sampler": "pdd_fused", "shift": SHIFT, "num_train_timesteps": 1000, "pdd_steps": 4,
                                      "block_size_max": 4, "num_steps": 2})
    proj = registry.load_inference_model(base).transformer.proj_out
    out_features, in_features = proj.weight.shape
    weight, bias = torch.randn(4, out_features, in_features), torch.randn(4, out_features)
    write_head_bank(pdd / "transformer" / registry.family_of(pdd).loaders().HEAD_BANK_FILE, weight, bias)

    for folder in (base, base / "transformer", causal, causal / "transformer", pdd):
        family = registry.family_of(folder)
        assert family.name == "wan2.1" and family.loaders() is importlib.import_module("distillery.models.wan")
    assert registry.locate_transformer(causal) == (causal / "transformer", causal / "scheduler")

    plain = registry.load_inference_model(base)
    assert type(plain) is WanModel and not plain.transformer.training
    student = _load_as_contract_says(causal)
    assert type(student) is CausalWanModel and isinstance(student, CausalModelBase) and student.chunk_size == 2
    heads = _load_as_contract_says(pdd)
    assert type(heads) is PDDWanModel and isinstance(heads, PDDModelBase) and heads.pdd_steps == 4
    assert all(torch.equal(heads.head_bank.weight[k], weight[k]) and torch.equal(heads.head_bank.bias[k], bias[k])
               for k in range(4))  # the folder's own head bank, not proj_out copies
    # a model of the family answers its input widths from its config (what validate and the stages check)
    assert registry.family_of(base).loaders().input_widths(plain.transformer_config()) == (
        plain.transformer.config.in_channels, plain.transformer.config.text_dim)


def test_the_tiny_cosmos_folders_resolve_to_the_cosmos_loaders(tmp_path):
    from distillery.models.cosmos import CosmosModel
    from distillery.tinybase.shipped import shipped_tiny_cosmos

    base = shipped_tiny_cosmos()
    trained = tmp_path / "teacher" / "model"  # an artifact's model/: no model_index.json, the family from the class
    for part in ("transformer", "scheduler"):
        shutil.copytree(base / part, trained / part)
    for folder in (base, base / "transformer", trained, trained / "transformer"):
        family = registry.family_of(folder)
        assert family.name == "cosmos-predict2.5" and family.loaders() is importlib.import_module("distillery.models.cosmos")
    assert registry.locate_transformer(trained) == (trained / "transformer", trained / "scheduler")
    plain = registry.load_inference_model(trained)
    assert type(plain) is CosmosModel and not plain.transformer.training and plain.schedule.shift == SHIFT
    assert registry.image_conditioning(base) is None  # text-to-world


def _foreign(tmp_path: Path, class_name: str = "HunyuanVideoTransformer3DModel") -> Path:
    folder = tmp_path / "hunyuan"
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": class_name, "in_channels": 16}))
    return folder


def test_a_folder_of_an_unknown_family_is_one_line_naming_the_class_and_the_families(tmp_path, capsys):
    folder = _foreign(tmp_path)
    for call in (registry.family_of, registry.locate_transformer, registry.load_inference_model):
        with pytest.raises(UserError) as info:
            call(folder)
        message = str(info.value)
        assert "\n" not in message and "'HunyuanVideoTransformer3DModel'" in message and "wan2.1 (WanTransformer3DModel)" in message
        assert str(folder / "transformer" / "config.json") in message
    assert run_guarded(lambda: registry.family_of(folder)) == 2  # an entry point: exit 2, one line, no traceback
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "HunyuanVideoTransformer3DModel" in err


def test_a_model_index_names_the_class_when_there_is_no_transformer_config(tmp_path):
    folder = tmp_path / "index-only"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideoPipeline",
                                                         "transformer": ["diffusers", "HunyuanVideoTransformer3DModel"]}))
    with pytest.raises(UserError, match=r"model_index.json: a 'HunyuanVideoTransformer3DModel' transformer; no registered"):
        registry.family_of(folder)
    (folder / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "WanTransformer3DModel"]}))
    assert registry.family_of(folder).name == "wan2.1"  # the family is known; its locator then wants the weights
    with pytest.raises(UserError, match="no transformer/config.json or config.json found"):
        registry.locate_transformer(folder)


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "no transformer/config.json or config.json with a _class_name"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text("{not json")), "config.json: not valid JSON"),
])
def test_a_folder_naming_no_transformer_is_one_line(tmp_path, setup, message):
    folder = tmp_path / "m"
    setup(folder)
    with pytest.raises(UserError, match=message) as info:
        registry.family_of(folder)
    assert "\n" not in str(info.value)


def test_every_family_exports_its_loaders_and_claims_its_own_classes():
    # families may share a class (every Wan's is WanTransformer3DModel), never a class in one folder layout
    layouts = [registry.FolderLayout(experts=e, boundary_ratio=0.875 if e == 2 else None, expand_timesteps=x, vae_z_dim=z)
               for e in (1, 2) for x in (False, True) for z in (None, 8, 16, 48)]
    classes = {c for family in registry.FAMILIES for c in family.transformer_classes}
    for c, layout in ((c, layout) for c in classes for layout in layouts):
        claiming = [f.name for f in registry.FAMILIES if c in f.transformer_classes and f.claims(layout)]
        assert len(claiming) <= 1, f"{claiming} all claim a {c} of {layout}"
    assert len({f.name for f in registry.FAMILIES}) == len(registry.FAMILIES)
    protocol = registry.FamilyLoaders
    assert set(registry.LOADER_NAMES) == {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
    for family in registry.FAMILIES:
        loaders = family.loaders()
        missing = [name for name in registry.LOADER_NAMES if not hasattr(loaders, name)]
        assert not missing, f"{family.package} lacks {missing}"


def test_every_family_builds_each_student_kind_it_does_not_refuse_and_refuses_the_rest_in_one_line():
    """What the recipes build a role from (``stages/recipes/parts.py``): a family's plugin class of each kind, or the
    one line the stages' preflight refuses the recipe with (a causal HunyuanVideo 1.5)."""
    from distillery.models.base import ModelBase

    expected = {"bidirectional": ModelBase, "causal": CausalModelBase, "pdd": PDDModelBase}
    assert set(expected) == set(registry.STUDENT_KINDS)
    for family in registry.FAMILIES:
        classes = family.loaders().MODEL_CLASSES
        for kind in registry.STUDENT_KINDS:
            if family.refusal(kind) is None:
                assert issubclass(family.model_class(kind), expected[kind]) and kind in classes
            else:
                assert kind not in classes
                with pytest.raises(UserError, match=f"a {family.name} model: ") as info:
                    family.model_class(kind)
                assert "\n" not in str(info.value)
    hunyuan = next(f for f in registry.FAMILIES if f.name == "hunyuanvideo1.5")
    assert hunyuan.refusal("causal") == registry.HUNYUAN15_CAUSAL_REFUSAL


def test_export_weights_refuses_a_checkpoint_of_an_unknown_family_in_one_line():
    """What export_weights asks of a checkpoint role's config.json: the family of its class (one line when none is
    registered), whose loaders build the transformer."""
    from distillery.models.registry import family_of_class

    with pytest.raises(UserError, match="'HunyuanVideoTransformer3DModel' transformer; no registered model family") as info:
        family_of_class("HunyuanVideoTransformer3DModel", "cannot export roles/student/config.json")
    assert "\n" not in str(info.value)
    config = json.loads((shipped_tiny_base() / "transformer" / "config.json").read_text())
    module = family_of_class(config["_class_name"], "cannot export").loaders().build_transformer(config)
    assert type(module).__name__ == "WanTransformer3DModel"
