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
from pathlib import Path

import pytest
import yaml
from workspace import copy_pipeline

from distillery.common.errors import UserError
from distillery.pipeline.dvcfile import stage_params
from distillery.pipeline.launch.run_config import fill_run_config, stage_overrides
from distillery.pipeline.launch.training_table import TRAINING_STAGES, TrainingStageSpec
from distillery.pipeline.params.reader import Params, StageParams
from distillery.pipeline.publish.artifacts import write_json_atomic
from distillery.pipeline.publish.run_summary import SUMMARY_FILE, read_run_summary

ROOT = Path(__file__).resolve().parents[1]


def _workspace(tmp_path: Path, monkeypatch, updates: dict[str, object] | None = None) -> Params:
    copy_pipeline(tmp_path)
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
    # the teacher's CFG unconditional is the latents' negative prompt where a stage has one (distill, pdd); SFT's dropout: empty
    assert raw["training"]["data"] == {"path": "artifacts/latents/data", "batch_size": params.get(f"{stage}.batch_size"),
                                       "text_max_length": 24,
                                       **({"unconditional": "negative"} if stage in ("distill", "pdd") else {})}
    optimizer = raw["training"]["optimizer"]
    for key in ("lr_scheduler", "warmup_steps", "weight_decay"):
        assert optimizer[key] == params.get(f"{stage}.{key}") and type(optimizer[key]) is type(params.get(f"{stage}.{key}"))
    assert "ema" not in raw["callbacks"]  # EMA off by default: the template's callbacks as they are
    assert raw["training"]["checkpoint"]["output_dir"] == f"runs/{stage}"
    assert raw["training"]["model"]["activation_checkpointing"] is True  # real-shape runs on one GPU need it (BENCHMARKS.md)
    assert raw["training"]["tracker"] == {"backend": "mlflow", "experiment": "distillery", "parent_run_id": "parent123",
                                          "run_name": stage, "tags": {"distillery.stage": stage}}
    if stage == "pretrain":  # one params key, two config keys: the DF noise chunks are the causal attention chunks
        assert raw["method"]["chunk_size"] == raw["models"]["student"]["chunk_size"] == 2
    if variant == "self_forcing":  # the causal student attends over the chunks it was pretrained on
        assert raw["models"]["student"]["chunk_size"] == 2 and raw["method"]["context_noise"] == params.get("distill.context_noise")
        assert raw["method"]["same_step_across_chunks"] is False
    if stage == "distill":  # null: the init's scheduler's shift
        assert "shift" in raw["models"]["student"] and raw["models"]["student"]["shift"] is None
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


def _unnamed_placeholders(spec: TrainingStageSpec, view: StageParams, text: str) -> list[str]:
    """The knobs the stage takes whose run-config key the template holds (a null placeholder) without naming the
    knob in its text (``# filled: params.yaml <knob>``): a placeholder says where its value comes from."""
    template = yaml.safe_load(text)
    return [s.key for s in spec.settings() if s.taken(view.get) and any(_holds(template, k) for k in s.sets)
            and f"params.yaml {s.key}" not in text]


def _holds(raw: dict, dotted: str) -> bool:
    first, _, rest = dotted.partition(".")
    return isinstance(raw, dict) and first in raw and (not rest or _holds(raw[first], rest))


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
    that contradicts params.yaml; each placeholder names the params.yaml knob that fills it."""
    row = TRAINING_STAGES[stage]
    params = _workspace(tmp_path, monkeypatch, {row.variant_key: variant} if variant else None)
    view = StageParams(params, stage, stage_params(stage))
    spec = row.resolve(view)
    text = Path(spec.template).read_text()
    template = yaml.safe_load(text)
    held = {key: _lookup(template, key) for key, _ in stage_overrides(spec, view, "p") if _lookup(template, key) is not None}
    assert not held, f"{spec.template} holds values its stage fills: {held}"
    assert not _unnamed_placeholders(spec, view, text)


def test_a_knob_setting_an_unknown_config_key_is_one_line(tmp_path, monkeypatch):
    params = _workspace(tmp_path, monkeypatch)
    spec = TrainingStageSpec(name="teacher", template="stages/teacher_sft.yaml", inputs={"student": "base"},
                             borrows={"teacher.steps": ("training.loop.max_steps",)})
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


def test_run_summary_gives_each_loss_on_its_own(tmp_path):
    """The loss plot's curves: every *_loss the trainer logged, each over its own steps ({} from an older summary)."""
    losses = {"critic_loss": [{"step": 5, "loss": 0.5}, {"step": 6, "loss": 0.4}], "generator_loss": [{"step": 6, "loss": 1.0}]}
    (tmp_path / SUMMARY_FILE).write_text(json.dumps({**SUMMARY, "losses": losses}))
    assert read_run_summary(tmp_path).component_rows() == losses
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(SUMMARY))
    assert read_run_summary(tmp_path).component_rows() == {}


@pytest.mark.parametrize("edit, message", [
    (None, "not found"),
    ({"losses": {"critic_loss": [{"step": "1", "loss": 0.5}]}}, "losses.critic_loss[0]: step: expected int"),
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


# -- validate's candidates: the table's rows with a validation -----------------------------------------------------

CONTRACTS = {  # what the training stages write as model/sampling.json with the default params (a DAG run's)
    "teacher": {"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000},
    "pretrain": {"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000, "chunk_size": 1},
    "distill": {"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000,
                "timesteps": [1000.0, 900.0, 750.0, 500.0], "chunk_size": 1, "context_noise": 0.0, "renoise": "sde"},
    "pdd": {"sampler": "pdd_fused", "shift": 3.0, "num_train_timesteps": 1000, "pdd_steps": 8, "block_size_max": 8,
            "num_steps": 4, "guidance_scale": 1.0},
}


def _contracts(stages: dict[str, dict]) -> None:
    for stage, contract in stages.items():
        (Path("artifacts") / stage / "model").mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path("artifacts") / stage / "model" / "sampling.json", contract)


def _hand_written_candidates(params: StageParams) -> list:
    """The list stages/validate.py wrote out by hand before the table declared it (kept here as the reference)."""
    import dataclasses

    from distillery.evaluation.candidates import Candidate, teacher_candidates
    from distillery.pipeline.publish.artifacts import ARTIFACTS

    v = params.get("validate")
    candidates = teacher_candidates(ARTIFACTS / "teacher" / "model", list(v.teacher_steps), float(v.guidance_scale))
    candidates.append(Candidate.from_artifact(f"pretrain_{v.pretrain_steps}", ARTIFACTS / "pretrain" / "model",
                                              int(v.pretrain_steps), float(v.guidance_scale)))
    distilled = Candidate.from_artifact("distill", ARTIFACTS / "distill" / "model")
    candidates.append(dataclasses.replace(distilled, name=f"distill_{distilled.num_steps}"))
    candidates += [Candidate.from_artifact(f"pdd_{n}", ARTIFACTS / "pdd" / "model", int(n)) for n in v.pdd_nfe]
    return candidates


def _same(a: list, b: list) -> bool:
    """Candidates equal field by field, their contract options too (which dataclass equality leaves out)."""
    return a == b and [c.options for c in a] == [c.options for c in b] and [type(c.guidance_scale) for c in a] == [
        type(c.guidance_scale) for c in b]


def test_validate_candidates_from_the_table_are_the_hand_written_list(tmp_path, monkeypatch):
    from stages.validate import headline_candidates, table_candidates, validation_inputs

    params = _workspace(tmp_path, monkeypatch)
    _contracts(CONTRACTS)
    view = StageParams(params, "validate", stage_params("validate"))
    candidates = table_candidates(view)
    assert _same(candidates, _hand_written_candidates(view))
    assert [c.name for c in candidates] == ["teacher_40", "teacher_8", "teacher_4", "teacher_2", "teacher_1", "pretrain_40",
                                            "distill_4", "pdd_1", "pdd_2", "pdd_4", "pdd_8"]  # metrics.json's keys, in order
    # DVC's few columns: each validated stage's first candidate (the curves stay in the report)
    assert headline_candidates(candidates) == ["teacher_40", "pretrain_40", "distill_4", "pdd_1"]
    assert validation_inputs() == [(name, Path("artifacts") / stage) for name, stage in (
        ("teacher", "teacher"), ("pretrain", "pretrain"), ("student", "distill"), ("pdd", "pdd"), ("base", "base"),
        ("data", "latents"))]
    # other params move the same candidates the same way (steps, guidance, the NFE curve)
    (tmp_path / "other").mkdir()
    params = _workspace(tmp_path / "other", monkeypatch, {"validate.teacher_steps": [12, 3], "validate.pretrain_steps": 6,
                                                          "validate.guidance_scale": 2.5, "validate.pdd_nfe": [2, 8]})
    _contracts(CONTRACTS)
    view = StageParams(params, "validate", stage_params("validate"))
    assert _same(table_candidates(view), _hand_written_candidates(view))
    assert [c.name for c in table_candidates(view)][:3] == ["teacher_12", "teacher_3", "pretrain_6"]


def test_validate_candidates_follow_a_row_added_to_the_table(tmp_path, monkeypatch):
    from distillery.pipeline.launch.training_table import ValidationSpec
    from stages.validate import table_candidates, validation_inputs

    params = _workspace(tmp_path, monkeypatch)
    _contracts({**CONTRACTS, "wan22": {"sampler": "few_step_x0", "shift": 5.0, "num_train_timesteps": 1000,
                                       "timesteps": [1000.0, 750.0, 500.0]}})
    table = {**TRAINING_STAGES,
             "wan22": TrainingStageSpec(name="wan22", template="stages/teacher_sft.yaml", inputs={"student": "base"},
                                        validation=ValidationSpec("wan22")),  # its contract's ladder: 3 steps
             "unscored": TrainingStageSpec(name="unscored", template="stages/teacher_sft.yaml", inputs={"student": "base"}),
             "wide": TrainingStageSpec(name="wide", template="stages/teacher_sft.yaml", inputs={"student": "teacher"},
                                       validation=ValidationSpec("wide", steps="validate.teacher_steps",
                                                                 guidance="validate.guidance_scale", sampler="euler"))}
    view = StageParams(params, "validate", stage_params("validate"))
    candidates = table_candidates(view, table)
    assert _same(candidates[:11], _hand_written_candidates(view))  # the default rows' first, the reference still teacher_40
    added = candidates[11:]
    assert [c.name for c in added] == ["wan22_3", "wide_40", "wide_8", "wide_4", "wide_2", "wide_1"]
    assert added[0].sampler == "few_step_x0" and added[0].shift == 5.0 and added[0].guidance_scale == 1.0
    assert added[0].model_dir == Path("artifacts/wan22/model")
    assert all(c.sampler == "euler" and c.guidance_scale == 4.0 and c.shift is None for c in added[1:])
    assert [name for name, _ in validation_inputs(table)] == ["teacher", "pretrain", "student", "pdd", "wan22", "wide",
                                                              "base", "data"]
    with pytest.raises(ValueError, match="needs a steps key"):
        ValidationSpec("x", sampler="euler")


def test_validate_reads_what_its_dvc_stage_declares_of_every_validated_row():
    """Each validated row's params keys are in validate's dvc.yaml ``params:`` and its artifact among the deps (DVC
    reruns validate when they change)."""
    from distillery.pipeline.dvcfile import stage_spec
    from distillery.pipeline.params.reader import covers

    declared, deps = stage_params("validate", ROOT), stage_spec("validate", ROOT).deps
    validated = [(name, spec.validation) for name, spec in TRAINING_STAGES.items() if spec.validation is not None]
    assert [name for name, _ in validated] == ["teacher", "pretrain", "distill", "pdd"]
    for name, how in validated:
        assert f"artifacts/{name}" in deps
        assert all(covers(declared, key) for key in how.params_read()), (name, how.params_read(), declared)


@pytest.mark.parametrize("student_init", ["teacher", "distill"])
def test_pdd_method_picks_the_dm_pdd_recipe_beside_the_students_init(tmp_path, monkeypatch, student_init):
    """``pdd.method: dm_pdd`` swaps the template for DM-PDD's, adds a critic from the teacher and its
    params; ``pdd.student_init`` still picks the student's init; ``pdd`` is the plain PDD recipe."""
    from distillery.config import allowed_prefixes, load_run_config

    row = TRAINING_STAGES["pdd"]
    assert row.templates() == ["stages/pdd.yaml", "stages/pdd_dm.yaml"] and "pdd.method" in row.params_read()
    params = _workspace(tmp_path, monkeypatch, {"pdd.method": "dm_pdd", "pdd.student_init": student_init,
                                                "pdd.dm_weight": 0.25, "pdd.critic_learning_rate": 3.0e-5})
    view = StageParams(params, "pdd", stage_params("pdd"))
    spec = row.resolve(view)
    assert spec.template == "stages/pdd_dm.yaml" and spec.method_key is None and spec.variant_key is None
    assert spec.inputs == {"student": student_init, "teacher": "teacher", "critic": "teacher"}
    raw = fill_run_config(spec, view, "p")
    assert raw["method"]["_target_"] == "distillery.methods.dm_pdd.DMPDDMethod" and raw["method"]["dm_weight"] == 0.25
    assert raw["models"]["critic"]["init_from"] == "artifacts/teacher/model"
    assert raw["models"]["critic"]["optimizer"]["learning_rate"] == 3.0e-5
    assert raw["models"]["student"]["init_from"] == f"artifacts/{student_init}/model"
    load_run_config(raw=raw, prefixes=allowed_prefixes())  # the filled config builds
    assert not _unnamed_placeholders(spec, view, Path(spec.template).read_text())
    (tmp_path / "plain").mkdir()
    plain_view = StageParams(_workspace(tmp_path / "plain", monkeypatch), "pdd", stage_params("pdd"))
    plain = row.resolve(plain_view)
    assert plain.template == "stages/pdd.yaml" and "critic" not in plain.inputs
    assert "method.dm_weight" not in dict(plain.config_overrides(plain_view))  # a dm_pdd knob (pdd.dm_weight's when)


@pytest.mark.parametrize("stage", list(TRAINING_STAGES))
def test_ema_and_recipe_knobs_reach_the_run_config(tmp_path, monkeypatch, stage):
    """``<stage>.ema_decay`` set: a ``callbacks.ema`` of the exported role beside the template's callbacks, which
    the built config accepts; the recipe knobs land as typed values; the stage ships (and records) the EMA's weights."""
    from distillery.config import allowed_prefixes, load_run_config
    from stages.training import shipped_weights

    row = TRAINING_STAGES[stage]
    updates = {f"{stage}.ema_decay": 0.99, f"{stage}.ema_start_step": 5, f"{stage}.weight_decay": 0.01,
               f"{stage}.lr_scheduler": "linear", f"{stage}.warmup_steps": 3}
    if stage == "distill":
        updates.update({"distill.same_step_across_chunks": True, "distill.student_shift": 5.0})
    params = _workspace(tmp_path, monkeypatch, updates)
    view = StageParams(params, stage, stage_params(stage))
    spec = row.resolve(view)
    raw = fill_run_config(spec, view, "p")
    template = yaml.safe_load(Path(spec.template).read_text())
    assert raw["callbacks"] == {**template["callbacks"], "ema": {"_target_": "distillery.callbacks.ema.EMACallback",
                                                                 "decay": 0.99, "start_step": 5, "roles": ["student"]}}
    assert {k: raw["training"]["optimizer"][k] for k in ("weight_decay", "lr_scheduler", "warmup_steps")} == \
        {"weight_decay": 0.01, "lr_scheduler": "linear", "warmup_steps": 3}
    config = load_run_config(raw=raw, prefixes=allowed_prefixes())
    assert config.callbacks["ema"].config.decay == 0.99 and config.callbacks["ema"].config.start_step == 5
    assert config.training.optimizer.weight_decay == 0.01
    if stage == "distill":
        assert raw["method"]["same_step_across_chunks"] is True and config.method.config.same_step_across_chunks is True
        assert config.models["student"].config.shift == 5.0
    assert shipped_weights(spec, raw) == {"role": "student", "source": "ema", "callback": "ema", "ema_decay": 0.99,
                                          "ema_start_step": 5}
    (tmp_path / "off").mkdir()
    off = fill_run_config(spec, StageParams(_workspace(tmp_path / "off", monkeypatch), stage, stage_params(stage)), "p")
    assert shipped_weights(spec, off) == {"role": "student", "source": "trained"}
    assert set(row.ema_keys()) <= set(row.params_read())


@pytest.mark.parametrize("method", ["self_forcing", "dmd2"])
@pytest.mark.parametrize("critic_init", ["teacher", "base"])
def test_distill_critic_init_picks_the_critics_start(tmp_path, monkeypatch, method, critic_init):
    """``distill.critic_init``: the critic (fake score) starts from the teacher artifact (the default, today's recipe)
    or from the base — the student's base, as the published recipes start it —, whichever ``distill.method``;
    its lineage role is ``critic_init`` and dvc.yaml names the dep ``artifacts/${distill.critic_init}``."""
    from distillery.pipeline.dvcfile import load_dvc_stages

    params = _workspace(tmp_path, monkeypatch, {"distill.method": method, "distill.critic_init": critic_init})
    view = StageParams(params, "distill", stage_params("distill"))
    spec = TRAINING_STAGES["distill"].resolve(view)
    assert spec.inputs == {"student": "pretrain", "teacher": "teacher", "critic": critic_init} and not spec.input_keys
    assert ("critic_init", critic_init) in spec.input_artifacts()
    raw = fill_run_config(spec, view, "p")
    assert raw["models"]["critic"]["init_from"] == f"artifacts/{critic_init}/model"
    assert raw["models"]["teacher"]["init_from"] == "artifacts/teacher/model"
    assert "distill.critic_init" in TRAINING_STAGES["distill"].params_read()
    assert f"artifacts/{critic_init}" in load_dvc_stages(tmp_path)["distill"].deps
