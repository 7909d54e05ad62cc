"""A sparse student asked for in ``params.yaml`` (issue 64): ``<stage>.attention: sparse``, ``sparsity``,
``sparse_tile`` — typed knobs of every training stage.

- every recipe gives them to its student's model (and to no other role); sparsity and tile only with ``sparse``
  (``auto``, shipped: as the init trained; ``dense``);
- refused in one line before any stage works, naming the key: a value out of range or of the wrong shape (the schema),
  and, from the params and the base folder (preflight, ``distillery params check``), a base family without sparse
  attention, a tile too large for one attention tile, a causal student's chunks a tile straddles, and a sparsity that
  drops no key tile of the token grid the stage trains on;
- what the lineage records of the shipped transformer's attention, and what the export's card says of it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import model_folders_of_the_tiny_base
from workspace import copy_pipeline, shipped_params_text

from distillery.common.errors import UserError
from distillery.pipeline.dvcfile import stage_params
from distillery.pipeline.launch.sparse_preflight import check_attention, check_stage_attention, token_grid
from distillery.pipeline.params.loading import validate_params
from distillery.pipeline.params.reader import Params, StageParams
from distillery.tinybase.shipped import shipped_tiny_base, shipped_tiny_cosmos
from stages.training import shipped_attention, stage_run_config

RECIPES = [("teacher", "sft"), ("pretrain", "dfsft"), ("pretrain", "ode_init"), ("pretrain", "ode_init_bidirectional"),
           ("distill", "dmd2"), ("distill", "self_forcing"), ("pdd", "pdd"), ("pdd", "dm_pdd"), ("posttrain", "nft")]
SPARSE = {"attention": "sparse", "sparsity": 0.75, "sparse_tile": [1, 2, 2]}


def _workspace(tmp_path: Path, monkeypatch, updates: dict[str, object]) -> Params:
    """The shipped pipeline files in ``tmp_path`` with ``updates`` (dotted keys), and the manifests a recipe reads."""
    copy_pipeline(tmp_path)
    data = yaml.safe_load((tmp_path / "params.yaml").read_text())
    for dotted, value in updates.items():
        section, key = dotted.split(".")
        data[section][key] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "artifacts" / "latents" / "data").mkdir(parents=True)
    (tmp_path / "artifacts" / "latents" / "data" / "preprocess.json").write_text(
        json.dumps({"settings": {"max_sequence_length": 24}, "kind": "latents"}))
    model_folders_of_the_tiny_base(tmp_path)  # the folders the roles start from, read for their family
    (tmp_path / "artifacts" / "distill" / "model").mkdir(parents=True, exist_ok=True)  # what posttrain's recipe reads of its student
    (tmp_path / "artifacts" / "distill" / "model" / "sampling.json").write_text(json.dumps(
        {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 750.0]}))
    (tmp_path / "artifacts" / "base" / "model").mkdir(parents=True, exist_ok=True)  # its adherence reward's thresholds
    shutil.copy2(shipped_tiny_base() / "analyzer.json", tmp_path / "artifacts" / "base" / "model" / "analyzer.json")
    monkeypatch.chdir(tmp_path)
    return Params.load("params.yaml")


def _student(params: Params, stage: str):
    config, _ = stage_run_config(StageParams(params, stage, stage_params(stage)), "parent")
    return config


@pytest.mark.parametrize("stage,method", RECIPES)
def test_every_recipe_gives_its_student_the_attention_params_ask_for(tmp_path, monkeypatch, stage, method):
    params = _workspace(tmp_path, monkeypatch, {f"{stage}.method": method, **{f"{stage}.{k}": v for k, v in SPARSE.items()}})
    config = _student(params, stage)
    student = config.models["student"].config
    assert (student.attention, student.sparsity, student.sparse_tile) == ("sparse", 0.75, [1, 2, 2])
    for role, component in config.models.items():  # the teacher and the critic attend as their folders trained
        if role != "student":
            assert getattr(component.config, "attention", "auto") == "auto", role
    assert config.to_plain()["models"]["student"]["sparse_tile"] == [1, 2, 2]  # what run.yaml (and the lineage) holds


@pytest.mark.parametrize("attention", ["auto", "dense"])
def test_sparsity_and_tile_reach_the_student_only_when_it_is_sparse(tmp_path, monkeypatch, attention):
    params = _workspace(tmp_path, monkeypatch, {"distill.attention": attention, "distill.sparsity": 0.5,
                                                "distill.sparse_tile": [1, 2, 2]})
    plain = _student(params, "distill").to_plain()["models"]["student"]
    assert (plain["attention"], plain["sparsity"], plain["sparse_tile"]) == (attention, 0.9, [1, 16, 8])  # the plugin's defaults


@pytest.mark.parametrize("key,value,why", [
    ("sparsity", 1.0, "distill.sparsity: 1.0"),
    ("sparsity", -0.1, "distill.sparsity: -0.1"),
    ("sparse_tile", [1, 2], "must be 3 integers (frames, rows, columns)"),
    ("sparse_tile", [0, 2, 2], "distill.sparse_tile"),
    ("attention", "sparce", "distill.attention"),
])
def test_a_value_out_of_range_is_one_line_naming_the_key(key, value, why):
    data = yaml.safe_load(shipped_params_text())
    data["distill"][key] = value
    with pytest.raises(UserError, match="^params.yaml: ") as err:
        validate_params(data)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_the_token_grid_is_the_latent_over_the_patch():
    # the shipped tiny Wan: its VAE packs 4 frames and 4×4 pixels a latent, its transformer patches 1×2×2 of those
    assert token_grid(shipped_tiny_base(), 17, 32, 32) == (5, 4, 4)
    assert token_grid(shipped_tiny_base(), 17, 64, 32) == (5, 8, 4)


@pytest.mark.parametrize("updates,why", [
    # the shipped tiny set's 5×4×4 tokens in tiles of 1×16×8: 5 tiles (one a frame, ragged); 0.1 of 5 keeps all 5
    ({"distill.sparsity": 0.1}, "distill.sparsity: 0.1: drops none of the 5 key tiles of the 5×4×4 token grid it trains "
                                "on (tiles of 1×16×8 tokens): it would train dense; set a sparsity of at least 0.2 or a "
                                "smaller distill.sparse_tile"),
    ({"distill.sparse_tile": [8, 16, 16], "distill.method": "dmd2"}, "drops none of the 1 key tiles"),
    ({"distill.sparse_tile": [1, 256, 128]}, "distill.sparse_tile: [1, 256, 128]: a tile of 32768 tokens is larger"),
    ({"distill.sparse_tile": [2, 2, 2], "pretrain.chunk_size": 1},  # self_forcing's causal student
     "distill.sparse_tile: [2, 2, 2]: a tile of 2 frames straddles chunks of 1"),
    ({"pretrain.method": "dfsft", "pretrain.attention": "sparse", "pretrain.sparse_tile": [2, 2, 2], "pretrain.chunk_size": 3},
     "pretrain.sparse_tile: [2, 2, 2]: a tile of 2 frames straddles chunks of 3"),
    ({"base.path": str(shipped_tiny_cosmos())}, "distill.attention: sparse: the base's family cosmos-predict2.5 has no "
                                                "sparse attention"),
])
def test_what_the_student_cannot_train_is_refused_before_any_stage(tmp_path, monkeypatch, updates, why):
    params = _workspace(tmp_path, monkeypatch, {"distill.attention": "sparse", **updates})
    with pytest.raises(UserError) as err:
        check_attention(params)
    assert str(err.value).startswith("params.yaml: ") and why in str(err.value), str(err.value)


def test_what_can_train_passes_and_a_stage_that_ran_is_not_asked_again(tmp_path, monkeypatch):
    from distillery.pipeline.launch.runner import STAGES

    params = _workspace(tmp_path, monkeypatch, {"distill.attention": "sparse", "distill.sparsity": 0.5,
                                                "distill.sparse_tile": [1, 2, 2], "teacher.attention": "sparse",
                                                "teacher.sparsity": 0.1})
    check_stage_attention("distill", params)  # 5×2×2 tiles, half of them dropped; causal tiles of one frame
    with pytest.raises(UserError, match="teacher.sparsity: 0.1"):
        check_attention(params, "teacher", tuple(STAGES))
    check_attention(params, "pretrain", tuple(STAGES))  # the teacher stage is behind: its params are not its to judge


def test_a_stage_that_trains_nothing_is_asked_only_what_it_can_do(tmp_path, monkeypatch):
    """posttrain switched off trains nothing: its sparse knobs are not judged (its default is off) until it is on; a
    stage that publishes a given model untrained cannot train it sparse: one line."""
    params = _workspace(tmp_path / "off", monkeypatch, {"posttrain.attention": "sparse", "posttrain.sparsity": 0.1})
    check_attention(params)
    params = _workspace(tmp_path / "on", monkeypatch, {"posttrain.attention": "sparse", "posttrain.sparsity": 0.1,
                                                       "posttrain.enabled": True})
    with pytest.raises(UserError, match=r"^params.yaml: posttrain.sparsity: 0.1: drops none"):
        check_attention(params)
    params = _workspace(tmp_path / "given", monkeypatch, {"teacher.attention": "sparse", "teacher.source": "base"})
    with pytest.raises(UserError) as err:
        check_attention(params)
    assert str(err.value) == ("params.yaml: teacher.attention: sparse: teacher publishes a given model as is (nothing "
                              "trains it sparse); use teacher.attention: auto, or train the stage")


@pytest.mark.process
def test_params_check_refuses_a_sparse_student_in_one_line(tmp_path):
    copy_pipeline(tmp_path)  # the workspace's recipes: params.yaml's sections are theirs
    data = yaml.safe_load(shipped_params_text())
    data["pdd"].update({"attention": "sparse", "sparsity": 0.1})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "distillery.cli.main", "params", "check"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "pdd.sparsity: 0.1: drops none" in lines[0], lines[0]


def test_the_lineage_records_how_the_shipped_transformer_attends(tmp_path):
    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    config = json.loads((shipped_tiny_base() / "transformer" / "config.json").read_text())
    (model / "transformer" / "config.json").write_text(json.dumps(config))
    assert shipped_attention(model) == {"kind": "dense"}
    config["_sparse_attention"] = {"sparsity": 0.75, "tile": [1, 2, 2]}
    (model / "transformer" / "config.json").write_text(json.dumps(config))
    assert shipped_attention(model) == {"kind": "sparse", "sparsity": 0.75, "tile": [1, 2, 2]}


def test_the_export_card_states_the_attention_a_student_trained_with(tmp_path):
    """A Self-Forcing student whose transformer records sparse attention: the card says its tile, the share of key
    tiles kept and the sparsity, and offers ``stream()``."""
    from distillery.data.encoders import read_max_sequence_length
    from distillery.evaluation.candidates import Candidate
    from distillery.evaluation.validate import run_validation
    from distillery.evaluation.validation_config import ValidationConfig
    from distillery.export.model_card import export_model_card
    from distillery.lineage.manifest import write_lineage

    base, artifact = shipped_tiny_base(), tmp_path / "artifacts" / "distill"
    shutil.copytree(base / "transformer", artifact / "model" / "transformer")
    shutil.copytree(base / "scheduler", artifact / "model" / "scheduler")
    config = json.loads((artifact / "model" / "transformer" / "config.json").read_text())
    config["_sparse_attention"] = {"sparsity": 0.5, "tile": [1, 2, 2]}
    (artifact / "model" / "transformer" / "config.json").write_text(json.dumps(config))
    (artifact / "model" / "sampling.json").write_text(json.dumps(
        {"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 600.0],
         "chunk_size": 1, "context_noise": 0.0, "renoise": "sde"}))
    write_lineage(artifact, kind="model", stage="distill", method="distillery.methods.self_forcing")
    cfg = ValidationConfig(prompts=["a red ball moves left"], num_frames=9, height=16, width=16, num_seeds=1,
                           grid_formats=[], bootstrap_resamples=0, progress_bar=False, max_sequence_length=16)
    run_validation(base, [Candidate.from_artifact("distill_2", artifact / "model")], [], tmp_path / "artifacts" /
                   "validate" / "report", cfg)
    card = export_model_card("distill", artifact, tmp_path / "artifacts" / "validate", read_max_sequence_length(base), None,
                             folder=str(tmp_path / "export"))
    assert ("each query tile of 1 × 2 × 2 tokens (frames × rows × columns) attends only the 50% of the key tiles it "
            "scores highest (sparsity 0.5") in card
    assert "pipe.stream(" in card  # the streaming student says how to read its frames as they come


@pytest.mark.slow
def test_a_stage_trains_its_student_sparse_as_params_yaml_says(prepared, tmp_path):
    """``distillery stage teacher`` with ``teacher.attention: sparse`` in a git + DVC workspace (a copy of the session's
    ``prepared``): the run config and the lineage record the knobs, the shipped transformer records the attention it
    trained with, and the lineage's ``weights.attention`` says so; the stage with a sparsity that drops nothing is one
    line, exit 2, and leaves the artifact as it was."""
    from workspace import copy_workspace, set_params, sh, stage

    repo = copy_workspace(prepared, tmp_path / "ws")
    set_params(repo, {"teacher.attention": "sparse", "teacher.sparsity": 0.5, "teacher.sparse_tile": [1, 2, 2]})
    sh(["git", "commit", "-qam", "sparse teacher"], repo)
    stage(repo, "teacher", check=True)
    lineage = json.loads((repo / "artifacts" / "teacher" / "lineage.json").read_text())
    student = lineage["config"]["models"]["student"]
    assert (student["attention"], student["sparsity"], student["sparse_tile"]) == ("sparse", 0.5, [1, 2, 2])
    assert lineage["weights"]["attention"] == {"kind": "sparse", "sparsity": 0.5, "tile": [1, 2, 2]}
    record = json.loads((repo / "artifacts" / "teacher" / "model" / "transformer" / "config.json").read_text())
    assert record["_sparse_attention"] == {"sparsity": 0.5, "tile": [1, 2, 2]}
    before = (repo / "artifacts" / "teacher" / "lineage.json").read_bytes()
    set_params(repo, {"teacher.sparsity": 0.01})
    proc = stage(repo, "teacher")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "teacher.sparsity: 0.01: drops none" in lines[-1], proc.stderr
    assert (repo / "artifacts" / "teacher" / "lineage.json").read_bytes() == before
