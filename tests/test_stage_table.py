"""The training stages' declarative table, their run configs and the run summary they read.

- a template filled by its table row with the typed params' Python values (no YAML text between
  them): every value lands with its type (``1e-5`` stays a float), nothing else of the template
  changes, a template holds no value a row fills, a row naming a key the schema lacks is one line;
- ``run_summary.json`` read into what the artifact needs: ``loss.json`` / ``sampling.json`` bytes,
  and one line for a missing, malformed or escaping summary.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import yaml

from distillery.common.errors import UserError
from distillery.stages.artifacts import write_json_atomic
from distillery.stages.dvcfile import stage_params
from distillery.stages.params import Params, StageParams
from distillery.stages.run_config import fill_run_config, stage_overrides
from distillery.stages.run_summary import SUMMARY_FILE, read_run_summary
from distillery.stages.training_table import TRAINING_STAGES, TrainingStageSpec

ROOT = Path(__file__).resolve().parents[1]


def _workspace(tmp_path: Path, monkeypatch, updates: dict[str, object] | None = None) -> Params:
    for name in ("dvc.yaml", "params.yaml", "templates"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(ROOT / name, tmp_path / name)
    data = yaml.safe_load((tmp_path / "params.yaml").read_text())
    for dotted, value in (updates or {}).items():
        section, key = dotted.split(".")
        data[section][key] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "artifacts" / "latents" / "data").mkdir(parents=True)
    (tmp_path / "artifacts" / "latents" / "data" / "preprocess.json").write_text(json.dumps({"settings": {"max_sequence_length": 24}}))
    monkeypatch.chdir(tmp_path)
    return Params.load("params.yaml")


def _unset(raw: dict, dotted: str) -> None:
    """Remove ``dotted`` (absent is fine) and the sections it leaves empty."""
    first, _, rest = dotted.partition(".")
    if not rest:
        raw.pop(first, None)
    elif isinstance(raw.get(first), dict):
        _unset(raw[first], rest)
        if not raw[first]:
            raw.pop(first)


ROWS = [(name, variant) for name, spec in TRAINING_STAGES.items() for variant in (spec.variants or [None])]


@pytest.mark.parametrize("stage,variant", ROWS)
def test_template_filled_by_its_row(tmp_path, monkeypatch, stage, variant):
    row = TRAINING_STAGES[stage]
    updates = {f"{stage}.learning_rate": 1.0e-5, f"{stage}.steps": 7, "pretrain.chunk_size": 2,
               f"{stage}.activation_checkpointing": True}
    if variant is not None:
        updates[row.variant_key] = variant
    params = _workspace(tmp_path, monkeypatch, updates)
    view = StageParams(params, stage, stage_params(stage))
    spec = row.resolve(view)
    assert spec.template == (row.variants[variant].template if variant else row.template) and spec.variant_key is None
    raw = fill_run_config(spec, view, "parent123")
    for role, init in spec.inputs.items():
        assert raw["models"][role]["init_from"] == f"artifacts/{init}/model"
    assert raw["training"]["optimizer"]["learning_rate"] == 1.0e-5 and isinstance(raw["training"]["optimizer"]["learning_rate"], float)
    assert raw["training"]["loop"]["max_train_steps"] == 7 and "progress_bar" not in raw["training"]["loop"]
    assert raw["training"]["data"] == {"path": "artifacts/latents/data", "batch_size": params.get(f"{stage}.batch_size"),
                                       "text_max_length": 24}
    assert raw["training"]["checkpoint"]["output_dir"] == f"runs/{stage}"
    assert raw["training"]["model"]["activation_checkpointing"] is True  # real-shape runs on one GPU need it (BENCHMARKS.md)
    assert raw["training"]["tracker"] == {"backend": "mlflow", "experiment": "distillery", "parent_run_id": "parent123",
                                          "run_name": stage, "tags": {"distillery.stage": stage}}
    if stage == "pretrain":  # one params key, two config keys: the DF noise chunks are the causal attention chunks
        assert raw["method"]["chunk_size"] == raw["models"]["student"]["chunk_size"] == 2
    if variant == "self_forcing":  # the causal student attends over the chunks it was pretrained on
        assert raw["models"]["student"]["chunk_size"] == 2 and raw["method"]["context_noise"] == params.get("distill.context_noise")
    if stage == "distill":
        assert raw["models"]["critic"]["optimizer"]["learning_rate"] == params.get("distill.critic_learning_rate")
        assert raw["method"]["num_student_steps"] == params.get("distill.student_steps")
        assert raw["method"]["_target_"].endswith({"self_forcing": "SelfForcingMethod", "dmd2": "DMD2Method"}[variant])
    # nothing but the overridden keys differs from the template
    template = yaml.safe_load(Path(spec.template).read_text())
    filled = copy.deepcopy(raw)
    for key, _ in stage_overrides(spec, view, "parent123"):
        _unset(template, key)
        _unset(filled, key)
    assert filled == template


def _lookup(raw: dict, dotted: str) -> object:
    node: object = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None  # absent: a placeholder too
        node = node[part]
    return node


@pytest.mark.parametrize("stage,variant", ROWS)
def test_templates_hold_no_value_a_row_fills(tmp_path, monkeypatch, stage, variant):
    """Every key the stage fills is null (or absent) in its template, so a template never holds a value
    that contradicts params.yaml; each params.yaml key the row reads is named in the template's text."""
    row = TRAINING_STAGES[stage]
    params = _workspace(tmp_path, monkeypatch, {row.variant_key: variant} if variant else None)
    view = StageParams(params, stage, stage_params(stage))
    spec = row.resolve(view)
    text = Path(spec.template).read_text()
    template = yaml.safe_load(text)
    held = {key: _lookup(template, key) for key, _ in stage_overrides(spec, view, "p") if _lookup(template, key) is not None}
    assert not held, f"{spec.template} holds values its stage fills: {held}"
    assert not [k for k in spec.params if f"params.yaml {k}" not in text]


def test_a_row_naming_an_unknown_config_key_is_one_line(tmp_path, monkeypatch):
    params = _workspace(tmp_path, monkeypatch)
    spec = TrainingStageSpec(name="teacher", template="templates/teacher_sft.yaml", inputs={"student": "base"},
                             params={"teacher.steps": "training.loop.max_steps"})
    with pytest.raises(UserError, match="training.loop.max_steps") as info:
        fill_run_config(spec, StageParams(params, "teacher", stage_params("teacher")), "p")
    assert "\n" not in str(info.value)


SUMMARY = {"format": 1, "final_step": 6, "checkpoint": "checkpoint-6", "mlflow_run_id": "abc",
           "method": "distillery.methods.sft.SFTMethod", "last_metrics": {"total_loss": 0.25},
           "loss": [{"step": 5, "loss": 0.5}, {"step": 6, "loss": 0.25}],
           "sampling": {"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000}}


def test_run_summary_gives_the_artifact_records(tmp_path):
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(SUMMARY))
    summary = read_run_summary(tmp_path)
    assert summary.final_step == 6 and summary.mlflow_run_id == "abc"
    assert summary.checkpoint_dir(tmp_path) == tmp_path / "checkpoint-6"
    # the bytes the stage wrote before the summary existed (from train_log.jsonl and the scheduler's shift)
    assert json.dumps(summary.loss_rows()) == '[{"step": 5, "loss": 0.5}, {"step": 6, "loss": 0.25}]'
    write_json_atomic(tmp_path / "sampling.json", summary.sampling)
    assert (tmp_path / "sampling.json").read_text() == json.dumps({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000}, indent=2)


@pytest.mark.parametrize("edit, message", [
    (None, "not found"),
    ({"format": 2}, "format 2"),
    ({"final_step": "6"}, "final_step: expected int"),
    ({"final_step": True}, "final_step: expected int"),
    ({"loss": [{"step": 1}]}, "loss[0]: loss: expected float or int"),
    ({"checkpoint": "../elsewhere"}, "not a folder name inside"),
    ({"sampling": None}, "sampling: expected dict"),
])
def test_bad_run_summary_is_one_line(tmp_path, edit, message):
    if edit is not None:
        (tmp_path / SUMMARY_FILE).write_text(json.dumps({**SUMMARY, **edit}))
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        read_run_summary(tmp_path)
    assert "\n" not in str(info.value)
