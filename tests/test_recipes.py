"""The training stages' recipes, their run configs and the run summary they read.

- the registry (``stages/recipes/``): every training stage, each method a module with its ``Params`` (a subclass of its
  stage's section), its ``inputs`` and its ``recipe``; ``<stage>.method``'s choices are the registry's; a method's own
  knobs are read (and refused) only while it is chosen;
- a recipe's run config: built typed from the typed params (no key between them: ``1e-5`` lands as the float it is),
  each role from the stage its ``inputs`` name, the data, the knobs, the EMA and the LoRA;
- ``run_summary.json`` read into what the artifact needs: ``loss.json`` / ``sampling.json`` bytes,
  and one line for a missing, malformed or escaping summary;
- validate's candidates: the training stages ``stages/validate.py`` names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import model_folders_of_the_tiny_base
from workspace import copy_pipeline

from distillery.common.errors import UserError
from distillery.pipeline.dvcfile import stage_params
from distillery.pipeline.params.reader import Params, StageParams
from distillery.pipeline.params.schema import TRAINING_STAGES, ParamsSchema
from distillery.pipeline.publish.artifacts import write_json_atomic
from distillery.pipeline.publish.run_summary import SUMMARY_FILE, read_run_summary
from stages.recipes import registry
from stages.training import finished_run, selected_weights, shipped_weights, stage_run_config

ROOT = Path(__file__).resolve().parents[1]

REGISTERED = {"teacher": ["sft"], "pretrain": ["causal_cd", "dfsft", "ode_init", "ode_init_bidirectional", "tfsft"],
              "distill": ["dmd2", "phased_dmd", "self_forcing"], "pdd": ["dm_pdd", "pdd"], "posttrain": ["nft"]}
RECIPES = [(stage, method) for stage, methods in REGISTERED.items() for method in methods]


def _workspace(tmp_path: Path, monkeypatch, updates: dict[str, object] | None = None) -> Params:
    copy_pipeline(tmp_path)  # params.yaml as shipped
    data = yaml.safe_load((tmp_path / "params.yaml").read_text())
    for dotted, value in (updates or {}).items():
        section, key = dotted.split(".")
        data[section][key] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    for kind in ("latents", "prompts"):
        (tmp_path / "artifacts" / kind / "data").mkdir(parents=True)
        manifest = {"settings": {"max_sequence_length": 24}, "kind": kind, **({"latent_shape": [8, 5, 4, 4]} if kind == "prompts" else {})}
        (tmp_path / "artifacts" / kind / "data" / "preprocess.json").write_text(json.dumps(manifest))
    model_folders_of_the_tiny_base(tmp_path)  # the folders the roles start from, read for their family
    monkeypatch.chdir(tmp_path)
    return Params.load("params.yaml")


def _config(params: Params, stage: str, prepared=None):
    return stage_run_config(StageParams(params, stage, stage_params(stage)), "parent123", prepared)


def test_the_registry_is_every_training_stage_and_its_methods():
    """One registry, the folder ``stages/recipes/<stage>/<method>.py``: each a ``Params`` of its stage's section (a
    subclass: the section's knobs and the method's own), its ``inputs`` and its ``recipe``."""
    found = registry()
    assert {stage: sorted(methods) for stage, methods in found.items()} == REGISTERED
    assert set(found) == set(TRAINING_STAGES)
    for stage, methods in found.items():
        section = type(getattr(ParamsSchema(), stage))
        for method, module in methods.items():
            assert issubclass(module.Params, section), (stage, method)
            assert callable(module.inputs) and callable(module.recipe), (stage, method)
            assert module.inputs(module.Params())["student"], (stage, method)  # the role the artifact ships
    assert {getattr(ParamsSchema(), s).method for s in TRAINING_STAGES} <= {m for ms in REGISTERED.values() for m in ms}


@pytest.mark.parametrize("value", ["consistency", 3, None])
def test_a_method_is_one_the_registry_lists(tmp_path, monkeypatch, value):
    with pytest.raises(UserError, match=r"^params.yaml: distill.method: .*valid values: dmd2, phased_dmd, self_forcing "
                                        r"\(stages/recipes/distill/\)$"):
        _workspace(tmp_path, monkeypatch, {"distill.method": value})


def test_a_methods_own_knobs_are_read_only_while_it_is_chosen(tmp_path, monkeypatch):
    """``distill.context_noise`` is Self-Forcing's knob: read (typed, bounded) while ``distill.method`` is
    ``self_forcing``; under ``dmd2`` the stage's section has no such field, yet the value the file holds is held to
    Self-Forcing's declaration all the same (a refusal never depends on the method chosen); a key no recipe of the stage
    declares is refused either way."""
    for method in ("self_forcing", "dmd2"):
        with pytest.raises(UserError, match=r"^params.yaml: distill.context_noise: 1000.0: must be in \[0, 1000\)"):
            _workspace(tmp_path / f"a-{method}", monkeypatch, {"distill.method": method, "distill.context_noise": 1000.0})
    params = _workspace(tmp_path / "b", monkeypatch, {"distill.method": "dmd2", "distill.context_noise": 12.0})
    assert not hasattr(params.get("distill"), "context_noise")
    assert params.written("distill.context_noise") == 12.0  # what DVC records, in the lineage too
    with pytest.raises(UserError, match=r"^params.yaml: distill.context_nois: unknown key.*did you mean"):
        _workspace(tmp_path / "c", monkeypatch, {"distill.method": "dmd2", "distill.context_nois": 0.0})
    with pytest.raises(UserError, match=r"^params.yaml: pdd.dm_weight: -1.0: must be a finite number ≥ 0"):
        _workspace(tmp_path / "d", monkeypatch, {"pdd.method": "dm_pdd", "pdd.dm_weight": -1.0})


@pytest.mark.parametrize("stage,method", RECIPES)
def test_a_recipe_builds_its_run_config_from_the_typed_params(tmp_path, monkeypatch, stage, method):
    updates = {f"{stage}.method": method, f"{stage}.learning_rate": 1.0e-5, f"{stage}.steps": 7, "pretrain.chunk_size": 2,
               f"{stage}.activation_checkpointing": True, f"{stage}.weight_decay": 0.01, f"{stage}.lr_scheduler": "linear",
               f"{stage}.warmup_steps": 3}
    params = _workspace(tmp_path, monkeypatch, updates)
    _posttrain_inputs()
    config, inputs = _config(params, stage)
    for role, init in inputs.items():
        assert config.models[role].config.init_from == f"artifacts/{init}/model"
    optimizer = config.training.optimizer
    assert optimizer.learning_rate == 1.0e-5 and isinstance(optimizer.learning_rate, float)
    assert (optimizer.weight_decay, optimizer.lr_scheduler, optimizer.warmup_steps) == (0.01, "linear", 3)
    assert config.training.loop.max_train_steps == 7 and config.training.loop.progress_bar is True
    assert config.training.data.path == "artifacts/latents/data" and config.training.data.text_max_length == 24
    # the teacher's CFG unconditional is the latents' negative prompt where a stage has one (distill, pdd); SFT's dropout: empty
    assert config.training.data.unconditional == ("negative" if stage in ("distill", "pdd") else "empty")
    assert list(config.callbacks) == ["grad_clip"]  # EMA off by default
    assert config.training.checkpoint.output_dir == f"runs/{stage}"
    assert config.training.model.activation_checkpointing is True  # real-shape runs on one GPU need it (BENCHMARKS.md)
    tracker = config.training.tracker
    assert (tracker.parent_run_id, tracker.run_name, tracker.tags) == ("parent123", stage, {"distillery.stage": stage})
    assert config.method.target.startswith("distillery.methods.") and config.models["student"].target.startswith(
        "distillery.models.wan.")
    assert shipped_weights(config) == {"role": "student", "source": "trained"}
    if method in ("dfsft", "tfsft", "ode_init"):  # one params key, two config fields: the noise chunks are the attention chunks
        assert config.method.config.chunk_size == config.models["student"].config.chunk_size == 2
    if method == "causal_cd":  # the block-causal student over pretrain.chunk_size frames
        assert config.models["student"].config.chunk_size == 2
    if method == "self_forcing":  # the causal student attends over the chunks it was pretrained on
        assert config.models["student"].config.chunk_size == 2
    if stage == "distill":
        assert config.models["critic"].optimizer.learning_rate == params.get("distill.critic_learning_rate")
        assert config.method.config.num_student_steps == params.get("distill.student_steps")
    if stage == "posttrain":  # the student's own contract; the base decodes; the adherence reward alone by default
        nft = config.method.config
        assert nft.sampling == DMD2_CONTRACT and nft.vae_from == "artifacts/base/model"
        assert [(name, r["_target_"].rpartition(".")[2], r["weight"]) for name, r in nft.rewards.items()] == [
            ("adherence", "AdherenceReward", 1.0)]
        assert config.models["student"].config.shift == 3.0
    assert yaml.safe_load(yaml.safe_dump(config.to_plain())) == config.to_plain()  # what run.yaml holds


def test_posttrain_of_the_pdd_student_trains_its_head_bank_on_its_contract(tmp_path, monkeypatch):
    """posttrain.student: pdd — the student is the PDD model with as many heads as its contract's grid, sampled (and so
    trained) as its sampling.json says."""
    params = _workspace(tmp_path, monkeypatch, {"posttrain.student": "pdd"})
    _posttrain_inputs()
    _contracts({"pdd": CONTRACTS["pdd"]})
    config, inputs = _config(params, "posttrain")
    assert inputs == {"student": "pdd"} and config.models["student"].config.init_from == "artifacts/pdd/model"
    assert config.models["student"].target.endswith("PDDWanModel") and config.models["student"].config.pdd_steps == 8
    assert config.method.config.sampling == CONTRACTS["pdd"]


def test_posttrain_rewards_are_typed_params_and_their_folders_inputs(tmp_path, monkeypatch):
    """posttrain's rewards: a weight per reward (0: off), at least one on, a model reward only with its folder; each
    folder of a reward that is on is an input of the stage (lineage, resume key) beside the base."""
    from stages.recipes.posttrain import nft

    with pytest.raises(UserError, match=r"^params.yaml: posttrain.reward_adherence, reward_clip, reward_preference: all 0"):
        _workspace(tmp_path / "a", monkeypatch, {"posttrain.reward_adherence": 0.0})
    with pytest.raises(UserError, match=r"^params.yaml: posttrain.reward_clip: 0.5 needs posttrain.clip_model"):
        _workspace(tmp_path / "b", monkeypatch, {"posttrain.reward_clip": 0.5})
    with pytest.raises(UserError, match=r"^params.yaml: posttrain.samples_per_prompt: 1"):
        _workspace(tmp_path / "c", monkeypatch, {"posttrain.samples_per_prompt": 1})
    params = _workspace(tmp_path / "d", monkeypatch, {"posttrain.reward_clip": 0.5, "posttrain.clip_model": "clip",
                                                      "posttrain.reward_preference": -1.0, "posttrain.preference_model": "pref",
                                                      "posttrain.preference_label": "good"})
    p = params.typed.posttrain
    assert nft.reads(p) == {"base": Path("artifacts/base"), "reward_clip": Path("clip"), "reward_preference": Path("pref")}
    rewards = nft.rewards(p)
    assert {name: r["weight"] for name, r in rewards.items()} == {"adherence": 1.0, "clip": 0.5, "preference": -1.0}
    assert (rewards["clip"]["model_from"], rewards["preference"]["model_from"], rewards["preference"]["label"]) == (
        "clip", "pref", "good")


@pytest.mark.parametrize("stage", list(TRAINING_STAGES))
def test_ema_and_lora_reach_the_run_config(tmp_path, monkeypatch, stage):
    """``<stage>.ema_decay`` set: a ``callbacks.ema`` of the student beside gradient clipping, whose weights the stage
    ships (and records); ``<stage>.lora_rank`` > 0: the student trains a LoRA adapter (alpha: the rank when null)."""
    params = _workspace(tmp_path, monkeypatch, {f"{stage}.ema_decay": 0.99, f"{stage}.ema_start_step": 5,
                                                f"{stage}.lora_rank": 4})
    _posttrain_inputs()
    config, _ = _config(params, stage)
    ema = config.callbacks["ema"]
    assert ema.target == "distillery.callbacks.ema.EMACallback" and list(config.callbacks) == ["grad_clip", "ema"]
    assert (ema.config.decay, ema.config.start_step, ema.config.roles) == (0.99, 5, ["student"])
    assert shipped_weights(config) == {"role": "student", "source": "ema", "callback": "ema", "ema_decay": 0.99,
                                       "ema_start_step": 5}
    assert (config.models["student"].lora.rank, config.models["student"].lora.alpha) == (4, 4.0)


@pytest.mark.parametrize("student_init", ["teacher", "distill"])
def test_pdd_method_picks_the_dm_pdd_recipe_beside_the_students_init(tmp_path, monkeypatch, student_init):
    """``pdd.method: dm_pdd`` adds a critic from the teacher and its knobs; ``pdd.student_init`` still picks the
    student's init; ``pdd`` is the plain PDD recipe (no critic, no DM knob)."""
    params = _workspace(tmp_path, monkeypatch, {"pdd.method": "dm_pdd", "pdd.student_init": student_init,
                                                "pdd.dm_weight": 0.25, "pdd.critic_learning_rate": 3.0e-5})
    config, inputs = _config(params, "pdd")
    assert inputs == {"student": student_init, "teacher": "teacher", "critic": "teacher"}
    assert config.method.target == "distillery.methods.dm_pdd.DMPDDMethod" and config.method.config.dm_weight == 0.25
    assert config.models["critic"].config.init_from == "artifacts/teacher/model"
    assert config.models["critic"].optimizer.learning_rate == 3.0e-5
    assert config.models["student"].config.init_from == f"artifacts/{student_init}/model"
    plain, inputs = _config(_workspace(tmp_path / "plain", monkeypatch, {"pdd.student_init": student_init}), "pdd")
    assert inputs == {"student": student_init, "teacher": "teacher"} and "critic" not in plain.models
    assert not hasattr(plain.method.config, "dm_weight")


@pytest.mark.parametrize("method", ["self_forcing", "dmd2", "phased_dmd"])
@pytest.mark.parametrize("critic_init", ["teacher", "base"])
def test_distill_critic_init_picks_the_critics_start(tmp_path, monkeypatch, method, critic_init):
    """``distill.critic_init``: the critic (fake score) starts from the teacher artifact (the default) or from the
    base — the student's base, as the published recipes start it —, whichever ``distill.method``; dvc.yaml names the
    dep ``artifacts/${distill.critic_init}``."""
    from distillery.pipeline.dvcfile import load_dvc_stages

    params = _workspace(tmp_path, monkeypatch, {"distill.method": method, "distill.critic_init": critic_init})
    config, inputs = _config(params, "distill")
    assert inputs == {"student": "pretrain", "teacher": "teacher", "critic": critic_init}
    assert config.models["critic"].config.init_from == f"artifacts/{critic_init}/model"
    assert config.models["teacher"].config.init_from == "artifacts/teacher/model"
    assert f"artifacts/{critic_init}" in load_dvc_stages(tmp_path)["distill"].deps


def test_causal_cd_follows_the_teacher_artifacts_ode_with_its_knobs(tmp_path, monkeypatch):
    """``pretrain.method: causal_cd``: the causal student beside the frozen teacher artifact (an input of the stage, in
    its lineage), the teacher's CFG from ``pretrain.guidance_scale`` (ode_init's key: the same meaning), its own knobs;
    a bidirectional teacher, no trajectories made first."""
    params = _workspace(tmp_path, monkeypatch, {"pretrain.method": "causal_cd", "pretrain.guidance_scale": 2.5,
                                                "pretrain.cd_steps": 12, "pretrain.target_decay": 0.9,
                                                "pretrain.target_start_step": 3})
    config, inputs = _config(params, "pretrain")
    assert inputs == {"student": "teacher", "teacher": "teacher"}
    assert config.models["student"].target == "distillery.models.wan.CausalWanModel"
    assert config.models["teacher"].target == "distillery.models.wan.WanModel" and not config.models["teacher"].config.trainable
    m = config.method.config
    assert config.method.target == "distillery.methods.causal_cd.CausalCDMethod"
    assert (m.num_discrete_steps, m.guidance_scale, m.target_decay, m.target_start_step) == (12, 2.5, 0.9, 3)
    with pytest.raises(UserError, match=r"^params.yaml: pretrain.cd_steps: 1: must be ≥ 2"):
        _workspace(tmp_path / "b", monkeypatch, {"pretrain.method": "causal_cd", "pretrain.cd_steps": 1})


@pytest.mark.parametrize("method", ["tfsft", "causal_cd"])
def test_a_latents_recipe_refuses_a_prompt_only_set(tmp_path, monkeypatch, method):
    with pytest.raises(UserError, match=rf"^params.yaml: pretrain.data: prompts: pretrain.method {method} trains on video "
                                        "latents"):
        _workspace(tmp_path, monkeypatch, {"pretrain.method": method, "pretrain.data": "prompts"})


@pytest.mark.parametrize("method", ["self_forcing", "dmd2"])
def test_distill_gan_weight_and_the_collapse_watch_reach_the_run_config(tmp_path, monkeypatch, method):
    """``distill.gan_weight`` is the method's discriminator term (0 by default: no head); ``distill.collapse_every``
    adds the collapse watch over the student — the data it trains on, the base's VAE, the teacher's samples with the
    real score's CFG — that stops the run with ``distill.stop_on_collapse``."""
    config, _ = _config(_workspace(tmp_path / "off", monkeypatch, {"distill.method": method}), "distill")
    assert config.method.config.gan_weight == 0.0 and "collapse" not in config.callbacks
    params = _workspace(tmp_path / "on", monkeypatch, {"distill.method": method, "distill.gan_weight": 0.05,
                                                       "distill.collapse_every": 10, "distill.stop_on_collapse": True})
    config, _ = _config(params, "distill")
    assert config.method.config.gan_weight == 0.05
    watch = config.callbacks["collapse"]
    assert watch.target == "distillery.callbacks.collapse.CollapseWatchCallback" and list(config.callbacks) == [
        "grad_clip", "collapse"]
    w = watch.config
    assert (w.every_steps, w.stop, w.teacher, w.teacher_guidance_scale) == (10, True, "teacher", 4.0)
    assert (w.data_path, w.vae_from, w.text_max_length) == ("artifacts/latents/data", "artifacts/base/model", 24)
    assert yaml.safe_load(yaml.safe_dump(config.to_plain())) == config.to_plain()


@pytest.mark.parametrize("updates, message", [
    ({"distill.stop_on_collapse": True}, "distill.stop_on_collapse: true needs the collapse watch on"),
    ({"distill.gan_weight": 0.1, "distill.data": "prompts"}, "distill.gan_weight: 0.1: the discriminator's real samples"),
    ({"distill.gan_weight": -0.1}, r"distill.gan_weight: -0.1: must be"),
    ({"distill.method": "phased_dmd", "distill.gan_weight": 0.1},
     "distill.gan_weight: 0.1: distill.method phased_dmd has no discriminator term"),
])
def test_distill_refuses_a_watch_or_gan_that_cannot_run(tmp_path, monkeypatch, updates, message):
    with pytest.raises(UserError, match=rf"^params.yaml: {message}") as info:
        _workspace(tmp_path, monkeypatch, updates)
    assert "\n" not in str(info.value)


def test_phased_dmd_is_a_bidirectional_two_expert_recipe_with_a_second_guidance_scale(tmp_path, monkeypatch):
    """``distill.method: phased_dmd``: the bidirectional student from the pretrain artifact, Phased DMD's method with
    simulated rollouts that step by Euler (``ode``), a base of two experts declared; ``distill.guidance_scale_2`` — every
    DMD recipe's — the low-noise expert's real-score CFG (unset: the high-noise one's for both; below 1 refused), the
    collapse watch's teacher samples with both scales."""
    params = _workspace(tmp_path, monkeypatch, {"distill.method": "phased_dmd", "distill.guidance_scale": 4.0,
                                                "distill.guidance_scale_2": 3.0, "distill.collapse_every": 10})
    config, inputs = _config(params, "distill")
    assert inputs == {"student": "pretrain", "teacher": "teacher", "critic": "teacher"}
    assert config.method.target == "distillery.methods.phased_dmd.PhasedDMDMethod"
    knobs = config.method.config
    assert (knobs.rollout, knobs.rollout_renoise, knobs.num_student_steps) == ("simulate", "ode", 4)
    assert (knobs.real_score_guidance_scale, knobs.real_score_guidance_scale_2) == (4.0, 3.0)
    assert config.models["student"].target == "distillery.models.wan.WanModel"
    assert registry()["distill"]["phased_dmd"].EXPERTS == 2
    watch = config.callbacks["collapse"].config
    assert (watch.teacher_guidance_scale, watch.teacher_guidance_scale_2) == (4.0, 3.0)
    for method in ("dmd2", "self_forcing"):  # unset: the method's default (one scale for both experts)
        plain, _ = _config(_workspace(tmp_path / method, monkeypatch, {"distill.method": method}), "distill")
        assert plain.method.config.real_score_guidance_scale_2 is None
    with pytest.raises(UserError, match="distill.guidance_scale_2"):
        _workspace(tmp_path / "low", monkeypatch, {"distill.method": "dmd2", "distill.guidance_scale_2": 0.5})


def test_a_prompt_only_set_gives_the_rollouts_shape(tmp_path, monkeypatch):
    params = _workspace(tmp_path, monkeypatch, {"distill.data": "prompts"})
    config, _ = _config(params, "distill")
    assert config.training.data.path == "artifacts/prompts/data" and config.training.data.latent_shape == [8, 5, 4, 4]


def test_a_recipe_that_reads_an_undeclared_key_is_refused(tmp_path, monkeypatch):
    """A recipe reads another stage's knob through the stage's typed view, held to its dvc.yaml ``params:``
    (distill lists ``pretrain.chunk_size``, not ``pretrain.steps``)."""
    from distillery.pipeline.params.reader import UndeclaredParam

    params = _workspace(tmp_path, monkeypatch)
    view = StageParams(params, "distill", stage_params("distill")).typed
    assert view.pretrain.chunk_size == 1 and view.distill.learning_rate == 1.0e-4
    with pytest.raises(UndeclaredParam, match="pretrain.steps"):
        view.pretrain.steps  # noqa: B018


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


SELECTION = {"step": 4, "checkpoint": "checkpoint-4", "reason": "the healthy check nearest the teacher's samples",
             "by": "collapse", "metrics": {"teacher_distance": 0.1}, "collapse_step": 8}


def test_a_run_the_collapse_watch_stopped_publishes_its_selection(tmp_path, monkeypatch):
    """A run the collapse watch stopped at step 8 of 7+ (its summary's ``selection``): the stage takes it as finished,
    publishes the selected pre-collapse checkpoint and records which, why and where the run collapsed
    (:func:`stages.training.selected_weights`, the lineage's ``weights``); stopped with nothing healthy to select, the
    stage says so in one line."""
    params = _workspace(tmp_path, monkeypatch, {"distill.steps": 20, "distill.collapse_every": 2,
                                                "distill.stop_on_collapse": True})
    config, _ = _config(params, "distill")
    run = Path("runs/distill")
    (run / "checkpoint-4").mkdir(parents=True)
    (run / SUMMARY_FILE).write_text(json.dumps({**SUMMARY, "final_step": 8, "checkpoint": "checkpoint-4",
                                                "selection": SELECTION}))
    summary = finished_run("distill", config)
    assert summary.checkpoint_dir(run) == run / "checkpoint-4" and summary.stopped_early.startswith("the healthy")
    weights = selected_weights(config, summary)
    assert weights == {"role": "student", "source": "trained", "selected": {**SELECTION, "stopped": True}}
    none = {**SELECTION, "step": None, "checkpoint": None, "reason": "collapse at step 2: diversity fell"}
    (run / SUMMARY_FILE).write_text(json.dumps({**SUMMARY, "final_step": 2, "checkpoint": None, "selection": none}))
    with pytest.raises(UserError, match=r"^stage distill: the collapse watch stopped training at step 2 with no checkpoint "
                                        r"fit to publish \(collapse at step 2: diversity fell\)") as info:
        finished_run("distill", config)
    assert "\n" not in str(info.value)
    (run / SUMMARY_FILE).write_text(json.dumps({**SUMMARY, "final_step": 8, "checkpoint": "checkpoint-4"}))
    with pytest.raises(UserError, match="training ended without its final checkpoint"):  # stopped, but not by the watch
        finished_run("distill", config)


@pytest.mark.parametrize("edit, message", [
    (None, "not found"),
    ({"selection": [1]}, "selection: expected dict"),
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

DMD2_CONTRACT = {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 750.0]}
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


def _posttrain_inputs() -> None:
    """What posttrain's recipe reads of its inputs: the distilled student's sampling.json (a DMD2 ladder) and the base's
    analyzer.json (the adherence reward's thresholds: the shipped tiny base's)."""
    from distillery.pipeline.params.schema import SHIPPED_TINY_BASE

    _contracts({"distill": DMD2_CONTRACT})
    (Path("artifacts") / "base" / "model").mkdir(parents=True, exist_ok=True)
    shutil.copy2(Path(__file__).resolve().parents[1] / SHIPPED_TINY_BASE / "analyzer.json", "artifacts/base/model/analyzer.json")


def _off(stage: str) -> None:
    """``artifacts/<stage>`` as a switched-off stage leaves it (``stages.training.publish_off``): a lineage of kind off."""
    from distillery.pipeline.publish.artifacts import OFF_KIND

    (Path("artifacts") / stage).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path("artifacts") / stage / "lineage.json", {"artifact": f"artifacts/{stage}", "kind": OFF_KIND,
                                                                   "stage": stage, "inputs": [], "outputs": {}})


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
    _off("posttrain")  # off by default: no candidate
    view = StageParams(params, "validate", stage_params("validate"))
    candidates = table_candidates(view)
    assert _same(candidates, _hand_written_candidates(view))
    assert [c.name for c in candidates] == ["teacher_40", "teacher_8", "teacher_4", "teacher_2", "teacher_1", "pretrain_40",
                                            "distill_4", "pdd_1", "pdd_2", "pdd_4", "pdd_8"]  # metrics.json's keys, in order
    # DVC's few columns: each validated stage's first candidate (the curves stay in the report)
    assert headline_candidates(candidates) == ["teacher_40", "pretrain_40", "distill_4", "pdd_1"]
    assert validation_inputs() == [(name, Path("artifacts") / stage) for name, stage in (
        ("teacher", "teacher"), ("pretrain", "pretrain"), ("student", "distill"), ("pdd", "pdd"),
        ("posttrain", "posttrain"), ("base", "base"), ("data", "latents"))]
    # other params move the same candidates the same way (steps, guidance, the NFE curve)
    (tmp_path / "other").mkdir()
    params = _workspace(tmp_path / "other", monkeypatch, {"validate.teacher_steps": [12, 3], "validate.pretrain_steps": 6,
                                                          "validate.guidance_scale": 2.5, "validate.pdd_nfe": [2, 8]})
    _contracts(CONTRACTS)
    _off("posttrain")
    view = StageParams(params, "validate", stage_params("validate"))
    assert _same(table_candidates(view), _hand_written_candidates(view))
    assert [c.name for c in table_candidates(view)][:3] == ["teacher_12", "teacher_3", "pretrain_6"]


def test_validate_scores_the_posttrain_student_when_it_is_on(tmp_path, monkeypatch):
    """posttrain on: its student is a candidate after the others, sampled as its contract says (the post-trained
    student's ladder, no CFG), and a headline column; off: neither (and export refuses it, one line)."""
    from stages.export import stage_export
    from stages.validate import headline_candidates, table_candidates

    params = _workspace(tmp_path, monkeypatch, {"posttrain.enabled": True, "export.student": "posttrain"})
    _contracts({**CONTRACTS, "posttrain": DMD2_CONTRACT})
    view = StageParams(params, "validate", stage_params("validate"))
    candidates = table_candidates(view)
    assert _same(candidates[:-1], _hand_written_candidates(view))
    assert candidates[-1].name == "posttrain_2" and candidates[-1].model_dir == Path("artifacts/posttrain/model")
    assert (candidates[-1].sampler, candidates[-1].guidance_scale) == ("few_step_x0", 1.0)
    assert headline_candidates(candidates)[-1] == "posttrain_2"
    shutil.rmtree("artifacts/posttrain")
    _off("posttrain")
    assert "posttrain_2" not in [c.name for c in table_candidates(view)]
    shutil.rmtree("artifacts/posttrain")  # its stage never ran here (stages run by hand): named, not a missing file
    with pytest.raises(UserError, match=r"candidate posttrain: artifacts/posttrain does not exist: the posttrain stage "
                                        r"has not run here; run it first \(`distillery stage posttrain`"):
        table_candidates(view)
    _off("posttrain")
    with pytest.raises(UserError, match=r"^params.yaml: export.student: posttrain: the posttrain stage is off"):
        stage_export(StageParams(params, "export", stage_params("export")))


def test_validate_candidates_follow_a_row_added_to_the_table(tmp_path, monkeypatch):
    from stages.validate import VALIDATED, ValidationSpec, table_candidates, validation_inputs

    params = _workspace(tmp_path, monkeypatch)
    _contracts({**CONTRACTS, "wan22": {"sampler": "few_step_x0", "shift": 5.0, "num_train_timesteps": 1000,
                                       "timesteps": [1000.0, 750.0, 500.0]}})
    _off("posttrain")
    table = {**VALIDATED,
             "wan22": ValidationSpec("wan22"),  # its contract's ladder: 3 steps
             "wide": ValidationSpec("wide", steps="validate.teacher_steps", guidance="validate.guidance_scale", sampler="euler")}
    (Path("artifacts") / "wide" / "model").mkdir(parents=True)  # its stage ran (its own sampler: no contract read)
    view = StageParams(params, "validate", stage_params("validate"))
    candidates = table_candidates(view, table)
    assert _same(candidates[:11], _hand_written_candidates(view))  # the default rows' first, the reference still teacher_40
    added = candidates[11:]
    assert [c.name for c in added] == ["wan22_3", "wide_40", "wide_8", "wide_4", "wide_2", "wide_1"]
    assert added[0].sampler == "few_step_x0" and added[0].shift == 5.0 and added[0].guidance_scale == 1.0
    assert added[0].model_dir == Path("artifacts/wan22/model")
    assert all(c.sampler == "euler" and c.guidance_scale == 4.0 and c.shift is None for c in added[1:])
    assert [name for name, _ in validation_inputs(table)] == ["teacher", "pretrain", "student", "pdd", "posttrain", "wan22",
                                                              "wide", "base", "data"]
    with pytest.raises(ValueError, match="needs a steps key"):
        ValidationSpec("x", sampler="euler")


def test_validate_reads_what_its_dvc_stage_declares_of_every_validated_stage():
    """Each validated stage's params keys are in validate's dvc.yaml ``params:`` and its artifact among the deps (DVC
    reruns validate when they change)."""
    from distillery.pipeline.dvcfile import stage_spec
    from distillery.pipeline.params.reader import covers
    from stages.validate import VALIDATED

    declared, deps = stage_params("validate", ROOT), stage_spec("validate", ROOT).deps
    assert list(VALIDATED) == ["teacher", "pretrain", "distill", "pdd", "posttrain"]
    for name, how in VALIDATED.items():
        assert f"artifacts/{name}" in deps
        assert all(covers(declared, key) for key in how.params_read()), (name, how.params_read(), declared)
