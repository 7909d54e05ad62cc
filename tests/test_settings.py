"""One typed path for a setting: params.yaml → typed params → the run config's Python values → the optimizer.

- the stages read typed params (a section is its dataclass, ``clips.fps`` a float) and record in their
  lineage the values as the file wrote them (as ``dvc.lock`` does);
- params.yaml and run configs go through one converter: the same facts, each file's wording;
- a dotted command-line override is read as DVC reads YAML (1.2: ``1e-4`` is a float) or refused;
- a run resolves its per-role optimizers once and checks its roles once;
- the validate stage and the validation callback share one config of prompts, noise and video rate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import model_folders_of_the_tiny_base, run_config
from workspace import copy_pipeline, shipped_params_text

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.config.loader import parse_override_args
from distillery.pipeline.dvcfile import stage_params
from distillery.pipeline.params.loading import validate_params
from distillery.pipeline.params.reader import Params, StageParams
from distillery.pipeline.params.schema import ClipsParams, ValidateParams

ROOT = Path(__file__).resolve().parents[1]


def _params(tmp_path: Path, text: str) -> Params:
    (tmp_path / "params.yaml").write_text(text)
    return Params.load(tmp_path / "params.yaml")


def test_stages_read_typed_params_and_record_them_as_written(tmp_path):
    shipped = shipped_params_text()
    assert "  fps: 8\n" in shipped  # an integer where the schema takes a number
    params = _params(tmp_path, shipped)
    view = StageParams(params, "validate", stage_params("validate", ROOT))
    section = view.get("validate")
    assert isinstance(section, ValidateParams) and section.teacher_steps == [40, 8, 4, 2, 1]
    assert isinstance(params.get("clips"), ClipsParams)
    fps = params.get("clips.fps")
    assert fps == 8.0 and type(fps) is float  # typed
    written = StageParams(params, "clips", stage_params("clips", ROOT)).recorded()["clips"]["fps"]
    assert written == 8 and type(written) is int  # the lineage records what dvc.lock records
    with pytest.raises(UserError, match=r"clips.colour: missing \(valid keys under clips: num_train"):
        params.get("clips.colour")


def test_one_converter_two_wordings(tmp_path):
    """The same converter refuses a value in params.yaml and in a run config; each file words it its way."""
    with pytest.raises(UserError) as params_error:
        validate_params({"validate": {"teacher_steps": [40, "4"]}}, "params.yaml")
    assert str(params_error.value) == "params.yaml: validate.teacher_steps: [40, '4']: item 1 ('4'): expected an integer"
    raw = run_config(tmp_path / "base", tmp_path / "data", tmp_path / "run")
    raw["training"]["optimizer"]["betas"] = [0.9, "x"]
    with pytest.raises(UserError) as config_error:
        load_run_config(raw=raw, prefixes=allowed_prefixes())
    assert str(config_error.value) == "config error: training.optimizer.betas[1]: expected a number, got 'x'"
    raw["training"]["optimizer"]["betas"] = [0.9, 0.999]
    raw["training"]["optimizer"]["learning_rate"] = "1e-4"  # what PyYAML reads from a run-config file's 1e-4
    with pytest.raises(UserError, match=r"learning_rate: expected a number, got '1e-4'; YAML reads 1e-4 as text: .* 1.0e-4$"):
        load_run_config(raw=raw, prefixes=allowed_prefixes())


def test_cli_override_values_are_read_as_dvc_reads_yaml(tmp_path):
    """``distillery train --training.optimizer.learning_rate 1e-4`` (as the train help shows it) is the float
    YAML 1.2 reads, not the text YAML 1.1 reads; a value 1.1 would read as another value is refused."""
    raw = run_config(tmp_path / "base", tmp_path / "data", tmp_path / "run")
    args = ["--training.optimizer.learning_rate", "1e-4", "--training.optimizer.betas=[0.0, 9.99E-1]",
            "--training.loop.seed", "0x10", "--training.tracker.tags", "{note: 2e3x, n: '010'}"]
    config = load_run_config(raw=raw, overrides=parse_override_args(args), prefixes=allowed_prefixes())
    assert config.training.optimizer.learning_rate == 1e-4
    assert config.training.optimizer.betas == (0.0, 0.999)
    assert config.training.loop.seed == 16
    assert config.training.tracker.tags == {"note": "2e3x", "n": "010"}
    for text, fix in [("010", "write 10, or 8 if you meant octal"), ("yes", "write true, or quote it ('yes') for the text"),
                      ("1:30", "write 90 for the number, or quote it ('1:30') for the text"), ("[1, 0o7]", "write 7, or quote it ('0o7') for the text")]:
        with pytest.raises(UserError) as info:
            load_run_config(raw=raw, overrides=[("training.tracker.experiment", text)], prefixes=allowed_prefixes())
        message = str(info.value)
        assert message.startswith("config error: --training.tracker.experiment: ") and message.endswith(fix), message
        assert "YAML 1.2 (as DVC reads it)" in message and "\n" not in message


def test_a_run_checks_its_roles_and_resolves_its_optimizers_once(tmp_path, monkeypatch):
    """Models → method → optimizers: the role check and the per-role optimizer merge each run once
    (before: three role checks and two merges inside one build)."""
    from distillery.components import optim
    from distillery.components.distributed import init_distributed, shutdown
    from distillery.engine.builder import build_run
    from distillery.methods.sft import SFTMethod
    from distillery.tinybase.shipped import shipped_tiny_base

    checks, merges = [], []
    check_roles, resolve = SFTMethod.check_roles, optim.resolve_optimizer_config
    monkeypatch.setattr(SFTMethod, "check_roles", classmethod(lambda cls, roles: checks.append(sorted(roles)) or check_roles(roles)))
    monkeypatch.setattr(optim, "resolve_optimizer_config", lambda *a: merges.append(a[2]) or resolve(*a))
    raw = run_config(shipped_tiny_base(), tmp_path / "data", tmp_path / "run", lr=3e-4)
    config = load_run_config(raw=raw, prefixes=allowed_prefixes())
    env = init_distributed(config.training.distributed)
    try:
        built = build_run(config, env)
    finally:
        shutdown()
    assert checks == [["student"]] and merges == ["student"]
    assert built.method.optimizer_configs["student"].learning_rate == 3e-4
    assert built.method.optimizers["student"].param_groups[0]["lr"] == 3e-4


def test_validation_settings_are_shared():
    """The stage's and the callback's configs are one config of prompts, noise and rate: the same
    bounds however they are built, the same generator seed for prompt i (seed index 0)."""
    from distillery.callbacks.validation import ValidationCallbackConfig
    from distillery.config.validation import ValidationSampling
    from distillery.evaluation.validation_config import ValidationConfig, generator_seed

    stage, callback = ValidationConfig(seed=7, num_seeds=2), ValidationCallbackConfig(data_path="data", seed=7)
    assert isinstance(stage, ValidationSampling) and isinstance(callback, ValidationSampling)
    assert [callback.generator_seed(i) for i in range(3)] == [generator_seed(stage, i, 0) for i in range(3)] == [7, 8, 9]
    assert generator_seed(stage, 2, 1) == 1009
    with pytest.raises(UserError, match=r"^config error: validate.seed: -1: must be ≥ 0$"):
        ValidationConfig(seed=-1)
    with pytest.raises(UserError, match=r"^config error: callbacks.validation.fps: 0.5: must be ≥ 1$"):
        ValidationCallbackConfig(data_path="data", fps=0.5)
    with pytest.raises(UserError, match=r"num_prompts: 0: must be ≥ 1"):
        ValidationConfig(num_prompts=0)


def test_distillery_stage_teacher_writes_the_same_run_yaml(tmp_path, monkeypatch):
    """The run config a training stage writes for the shipped params (what runs/teacher/run.yaml holds: the typed config
    its recipe built, every field), as a golden file: a setting's path from params.yaml to the run config must not
    change its values."""
    from stages.training import stage_run_config

    copy_pipeline(tmp_path)
    model_folders_of_the_tiny_base(tmp_path)  # the folders the roles start from, read for their family
    (tmp_path / "artifacts/latents/data").mkdir(parents=True)
    (tmp_path / "artifacts/latents/data/preprocess.json").write_text(json.dumps({"settings": {"max_sequence_length": 24}}))
    monkeypatch.chdir(tmp_path)
    params = Params.load("params.yaml")
    view = StageParams(params, "teacher", stage_params("teacher"))
    config, _ = stage_run_config(view, "parent123")
    assert yaml.safe_dump(config.to_plain(), sort_keys=True) == GOLDEN_TEACHER_RUN_YAML


def test_a_stage_trains_at_its_own_sp_and_tp_sizes_else_the_gpus_ones(tmp_path, monkeypatch):
    """``gpus.sp_size`` / ``tp_size`` are every training stage's layout; a stage's own ``sp_size`` / ``tp_size`` win.
    The run config's ``training.distributed`` holds the sizes the stage trains at."""
    from stages.training import stage_run_config

    copy_pipeline(tmp_path)
    model_folders_of_the_tiny_base(tmp_path)  # the folders the roles start from, read for their family
    (tmp_path / "artifacts/latents/data").mkdir(parents=True)
    (tmp_path / "artifacts/latents/data/preprocess.json").write_text(json.dumps({"settings": {"max_sequence_length": 24}}))
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((tmp_path / "params.yaml").read_text())
    raw["gpus"].update(nproc_per_node=4, sp_size=2)
    raw["teacher"]["tp_size"] = 2
    raw["pretrain"]["sp_size"] = 4
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    params = Params.load("params.yaml")
    found = {}
    for stage in ("teacher", "pretrain"):
        d = stage_run_config(StageParams(params, stage, stage_params(stage)), "parent123")[0].training.distributed
        found[stage] = (d.sp_size, d.tp_size)
    assert found == {"teacher": (2, 2), "pretrain": (4, 1)}


def test_a_stage_whose_heads_do_not_split_over_its_sp_group_is_refused_before_its_run_folder(tmp_path, monkeypatch):
    """The heads of each role's model are the model plugin's to check (``config.json``): ``gpus.sp_size: 8`` fits the
    launch (``params.yaml`` passes) but not the tiny Wan's 4 heads — one line when the stage checks its built run
    config, before ``runs/<stage>`` exists."""
    import shutil

    from distillery.pipeline.launch.run_config import check_run_config
    from stages.training import stage_run_config

    copy_pipeline(tmp_path)
    (tmp_path / "artifacts/latents/data").mkdir(parents=True)
    (tmp_path / "artifacts/latents/data/preprocess.json").write_text(json.dumps({"settings": {"max_sequence_length": 24}}))
    shutil.copytree(Path(__file__).resolve().parents[1] / "src/distillery/assets/tiny-wan", tmp_path / "artifacts/base/model")
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((tmp_path / "params.yaml").read_text())
    raw["gpus"].update(nproc_per_node=8, sp_size=8)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    view = StageParams(Params.load("params.yaml"), "teacher", stage_params("teacher"))
    config, roles = stage_run_config(view, "parent123")
    with pytest.raises(UserError, match=r"sp_size: 8: models.student: .*4 attention heads do not split over 8"):
        check_run_config("teacher", config, roles)
    assert not (tmp_path / "runs").exists()


GOLDEN_TEACHER_RUN_YAML = """\
callbacks:
  grad_clip:
    _target_: distillery.callbacks.grad_clip.GradClipCallback
    max_grad_norm: 1.0
    norm_type: 2.0
    per_role: {}
method:
  _target_: distillery.methods.sft.SFTMethod
  caption_dropout: 0.1
  precondition_outputs: false
models:
  student:
    _target_: distillery.models.wan.WanModel
    attention: auto
    init_from: artifacts/base/model
    logit_mean: 0.0
    logit_std: 1.0
    random_init: false
    shift: null
    sparse_tile:
    - 1
    - 16
    - 8
    sparsity: 0.9
    timestep_sampling: uniform
    trainable: true
training:
  checkpoint:
    keep_last: 2
    output_dir: runs/teacher
    resume: latest
    save_every: 40
    save_final: true
  data:
    batch_size: 16
    drop_last: true
    latent_shape: null
    path: artifacts/latents/data
    split: train
    text_max_length: 24
    unconditional: empty
  distributed:
    backend: auto
    device: auto
    mixed_precision: auto
    replicate_size: 1
    reshard_after_forward: null
    shard_single_rank: false
    sp_size: 1
    tp_size: 1
  loop:
    grad_accum_steps: 1
    log_every: 1
    max_train_steps: 120
    progress_bar: true
    seed: 0
    skip_nonfinite_steps: 0
    stop_at_step: null
  model:
    activation_checkpointing: false
    activation_checkpointing_fraction: 1.0
    attention_backend: auto
    compile: null
    compile_mode: blocks
  optimizer:
    betas:
    - 0.9
    - 0.999
    eps: 1.0e-08
    learning_rate: 0.0002
    lr_scheduler: cosine
    min_lr_ratio: 0.1
    warmup_steps: 10
    weight_decay: 0.0
  tracker:
    backend: mlflow
    experiment: distillery
    parent_run_id: parent123
    run_name: teacher
    tags:
      distillery.stage: teacher
    tracking_uri: null
"""
