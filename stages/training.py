"""The training stages (``teacher``, ``pretrain``, ``distill``, ``pdd``): one function for all, driven by each
stage's recipe.

For training stage ``<stage>``, :func:`run_training_stage` publishes the model ``params.yaml`` gives
(``teacher.source: base``, ``pretrain.source: given``: :func:`publish_given_model`), or the record of a stage switched
off (``posttrain.enabled: false``: :func:`publish_off`, no model), or :func:`stage_training`:

1. its recipe — the module ``<stage>.method`` names, ``stages/recipes/<stage>/<method>.py`` — builds the typed run
   config once, from the stage's typed section and its :class:`~distillery.pipeline.launch.run_config.RunInputs`
   (:func:`stage_run_config`; a recipe that makes its data first, ``pretrain.method: ode_init``'s trajectories, makes
   it before), and the whole chain is checked before any training
   (:func:`~distillery.pipeline.launch.run_config.check_run_config`): what the stage reads of its run config afterwards
   it reads from that build;
2. writes ``runs/<stage>/run.yaml`` with its resume key (:mod:`distillery.pipeline.launch.run_folder`): a killed stage
   resumes from its last checkpoint; a stage whose config, inputs or code changed starts from step 0 and says why
   (docs/reliability.md);
3. launches ``python -m distillery.cli.launch`` (torchrun, contained), one agent per node, as ``params.yaml: gpus``
   says (:mod:`distillery.pipeline.launch.launcher`: local, or ``srun`` over a Slurm allocation; one local process is
   the worker itself); every agent dies with this process, its workers with it — and while they train, this process
   imports what publishing needs (:class:`PublishImports`);
4. reads the run's ``run_summary.json`` (:mod:`distillery.pipeline.publish.run_summary`) and publishes the artifact:
   ``model/`` (the trained student's transformer — its EMA shadow when ``<stage>.ema_decay`` is set,
   :func:`shipped_weights` —, the init's scheduler, ``sampling.json`` from the summary's sampling contract),
   ``loss.json`` and its curve ``loss.png``, metrics and lineage (its ``launch``: launcher, nodes, processes per node,
   the Slurm job id under Slurm, and the layout: :func:`run_layout`; its ``weights``: which weights ship). A run whose
   collapse watch chose its checkpoint (``distill.collapse_every``) ships that one, and ``weights.selected`` says which
   and why — a run the watch stopped at a collapse too (:func:`finished_run`, :func:`selected_weights`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.pipeline.launch.run_config import EMA_CALLBACK, EXPORT_ROLE, PreparedData, data_dir, run_inputs
from distillery.pipeline.params.reader import StageParams
from distillery.pipeline.params.recipes import given_contract, prepared_data, recipe_reads
from distillery.pipeline.publish.artifacts import (
    ARTIFACTS,
    OFF_KIND,
    RUNS,
    finish,
    fresh_staging,
    link_tree,
    write_json_atomic,
)

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.publish.run_summary import RunSummary

log = get_logger("stage")


def training_launch(params: StageParams, config_path: Path):
    """The launch of ``-m distillery.cli.train --config <config_path>`` that ``params.yaml: gpus`` asks for
    (:func:`distillery.pipeline.launch.launcher.plan_launch`: one torchrun agent per node, local or over Slurm)."""
    from distillery.pipeline.launch.launcher import plan_launch

    return plan_launch(params.get("gpus"), ["--config", str(config_path)])


class PublishImports:
    """What publishing a trained model imports (torch, the model family's package, matplotlib — and diffusers when
    ``diffusers`` says export rebuilds the transformer: a LoRA role, two experts; a full-weight role of one is written
    without it, :mod:`distillery.export.direct_weights`), imported on a thread of this process while the launch
    trains — this process only waits then — instead of after it, on the stage's critical path. :meth:`wait` joins
    it; an import that failed there fails again, with its own error, where the module is used."""

    def __init__(self, init_folder: str, diffusers: bool = True) -> None:
        import threading

        self.init_folder = init_folder
        self.diffusers = diffusers
        self.thread = threading.Thread(target=self._run, name="publish-imports", daemon=True)

    def _run(self) -> None:
        import importlib

        try:
            import distillery.evaluation.plots  # noqa: F401
            import distillery.export.weights  # noqa: F401
            from distillery.models.registry import family_of, transformer_class

            family = family_of(self.init_folder)
            family.loaders()
            if self.diffusers or family.experts != 1:
                getattr(importlib.import_module("diffusers"), transformer_class(self.init_folder)[0])  # a family's classes are diffusers'
            importlib.import_module("matplotlib.figure")
            importlib.import_module("matplotlib.backends.backend_agg")
        except Exception:  # noqa: BLE001 - a warm-up only: the real import reports it
            pass

    def start(self) -> None:
        self.thread.start()

    def wait(self) -> None:
        if self.thread.ident is not None:  # started
            self.thread.join()


def shipped_weights(config: RunConfig) -> dict[str, Any]:
    """Which weights of the run ``config`` the artifact ships, as its lineage records them: the trained student's own
    (``source: trained``), or — with the stage's EMA in the run config — the EMA shadow (``source: ema``, the callback,
    its decay and start step): what validate scores and export ships."""
    ema = config.callbacks.get(EMA_CALLBACK)
    if ema is None:
        return {"role": EXPORT_ROLE, "source": "trained"}
    return {"role": EXPORT_ROLE, "source": "ema", "callback": EMA_CALLBACK, "ema_decay": ema.config.decay,
            "ema_start_step": ema.config.start_step}


def run_layout(config: RunConfig) -> dict[str, int]:
    """How the run split its models and samples over the launch's ranks, as its lineage records it under ``launch``:
    HSDP's copies, the sequence-parallel group (ranks per sample) and the tensor-parallel group. A stage resumed from
    a checkpoint of another layout (the resume key leaves the layout out: DCP reshards it) records the layout it
    finished at."""
    d = config.training.distributed
    return {"replicate_size": d.replicate_size, "sp_size": d.sp_size, "tp_size": d.tp_size}


def shipped_attention(model: Path) -> dict[str, Any]:
    """How the transformer of the published ``model`` folder attends, as its ``config.json`` records it trained
    (:data:`distillery.models.wan.sparse_attention.RECORD_KEY`): ``{"kind": "sparse", "sparsity", "tile"}`` or
    ``{"kind": "dense"}`` — in the lineage beside which weights ship, so the record says what validate and the export
    sample (``<stage>.attention: auto`` resolved)."""
    from distillery.models.wan.sparse_attention import read_record

    spec = read_record(json.loads((model / "transformer" / "config.json").read_text()))
    return {"kind": "dense"} if spec is None else {"kind": "sparse", **spec.record()}


def stage_run_config(params: StageParams, parent_run_id: str,
                     prepared: PreparedData | None = None) -> tuple[RunConfig, dict[str, str]]:
    """The stage's typed run config, built once by its recipe from its typed section (:meth:`StageParams.typed`) and
    its :class:`~distillery.pipeline.launch.run_config.RunInputs` — trained on ``prepared`` when the recipe made its
    data, else on ``artifacts/<data>/data`` —, and the recipe's inputs (role → the stage it starts from)."""
    stage, recipe = params.stage, params.recipe()
    p = getattr(params.typed, stage)
    inputs = recipe.inputs(p)
    data = prepared.folder if prepared is not None else data_dir(p.data_artifact())
    config = recipe.recipe(p, run_inputs(stage, inputs, data, params, parent_run_id))
    if config.training.checkpoint.output_dir != str(RUNS / stage) or EXPORT_ROLE not in config.models:  # a recipe's bug
        raise ValueError(f"stage {stage}: its recipe must train a {EXPORT_ROLE} into {RUNS / stage} "
                         "(TrainingStageParams.training)")
    return config, inputs


def finished_run(stage: str, config: RunConfig) -> RunSummary:
    """The summary of the run of ``config`` (in ``runs/<stage>``), which must have reached its last step and saved
    its final checkpoint — or been stopped by its collapse watch (``<stage>.stop_on_collapse``) with a pre-collapse
    checkpoint selected (one line otherwise: a run that collapsed before any healthy check has nothing to publish)."""
    from distillery.pipeline.publish.run_summary import read_run_summary

    run_dir = Path(config.training.checkpoint.output_dir)
    summary = read_run_summary(run_dir)
    checkpoint = summary.checkpoint_dir(run_dir)
    stopped = summary.stopped_early
    if stopped is not None and checkpoint is None:
        raise UserError(f"stage {stage}: the collapse watch stopped training at step {summary.final_step} with no "
                        f"checkpoint fit to publish ({stopped}); lower {stage}.learning_rate or {stage}.steps and rerun")
    ended = summary.final_step == config.training.loop.max_train_steps or stopped is not None
    if not ended or checkpoint is None or not checkpoint.is_dir():
        raise UserError(f"stage {stage}: training ended without its final checkpoint in {run_dir}")
    return summary


def selected_weights(config: RunConfig, summary: RunSummary) -> dict[str, Any]:
    """:func:`shipped_weights` and, when a callback chose the run's checkpoint (the collapse watch), ``selected``: which
    step, why, and where (and whether) the run collapsed — what the artifact's lineage records."""
    weights = shipped_weights(config)
    if summary.selection is not None:
        keys = ("step", "checkpoint", "reason", "by", "collapse_step", "metrics")
        weights["selected"] = {k: summary.selection.get(k) for k in keys}
        weights["selected"]["stopped"] = summary.stopped_early is not None
    return weights


def publish_model(summary: RunSummary, config: RunConfig, model: Path) -> None:
    """The trained student of a finished run of ``config`` as the model folder ``model``: its transformer — the EMA
    shadow when the run kept one (:func:`shipped_weights`) —, its init's scheduler and ``sampling.json``, the sampling
    contract the run's method gave (what validate and the export sample it with)."""
    from distillery.export.weights import export_weights
    from distillery.models.registry import locate_transformer

    run_dir = Path(config.training.checkpoint.output_dir)
    export_weights(summary.checkpoint_dir(run_dir), EXPORT_ROLE, model, ema=shipped_weights(config).get("callback"))
    _, scheduler = locate_transformer(config.models[EXPORT_ROLE].config.init_from)
    if scheduler is not None:
        shutil.copytree(scheduler, model / "scheduler")
    write_json_atomic(model / "sampling.json", summary.sampling)


def stage_training(params: StageParams) -> None:
    """Train the stage and publish ``artifacts/<stage>`` (module doc)."""
    from distillery.components.tracking import default_tracking_uri
    from distillery.config.schema import TrackerConfig
    from distillery.lineage.manifest import pin_input
    from distillery.pipeline.launch.launcher import run_launch
    from distillery.pipeline.launch.run_config import check_run_config
    from distillery.pipeline.launch.run_folder import prepare_run_dir
    from distillery.pipeline.publish.mlflow_runs import parent_run_id

    stage = params.stage
    p = getattr(params.typed, stage)
    prepared = prepared_data(params.recipe(), p, params)  # ode_init: the teacher's ODE trajectories first (resumable)
    config, roles = stage_run_config(params, parent_run_id(params.path.read_text()), prepared)
    check_run_config(stage, config, roles)
    raw = config.to_plain()
    inputs = [(f"{role}_init", ARTIFACTS / source) for role, source in roles.items()]
    inputs.append(("data", ARTIFACTS / p.data_artifact()))
    reads = recipe_reads(params.recipe(), p)  # the base, a reward model's folder: inputs, and parts of the resume key
    inputs += list(reads.items())
    pinned = {name: pin_input(path) for name, path in reads.items() if not path.resolve().is_relative_to(ARTIFACTS.resolve())}
    resume_inputs = dict(inputs)
    if prepared is not None:  # what the prepared set was made from (the prompts: the data input), and the set itself
        inputs += list(prepared.made_from.items())
        resume_inputs.update({**prepared.made_from, prepared.name: prepared.folder})
    world = params.get("gpus").world_size
    config_path = prepare_run_dir(stage, raw, resume_inputs, world)  # resumable on another world: the same global batch
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if params.get("gpus.nproc_per_node") > 1 else "2")}
    launch = training_launch(params, config_path)
    init_from = config.models[EXPORT_ROLE].config.init_from
    publishing = PublishImports(init_from, diffusers=config.models[EXPORT_ROLE].lora is not None)
    code = run_launch(launch, env, while_running=publishing.start)
    if code != 0:
        raise SystemExit(code)  # the launcher printed the one line (a user error: code 2)
    publishing.wait()
    from distillery.evaluation.plots import write_loss_plot

    summary = finished_run(stage, config)
    staging = fresh_staging(stage)
    publish_model(summary, config, staging / "model")
    weights = {**selected_weights(config, summary), "attention": shipped_attention(staging / "model")}
    loss = summary.loss_rows()
    (staging / "loss.json").write_text(json.dumps(loss))
    write_loss_plot(loss, staging / "loss.png", f"{stage}: loss per step",  # the curves offline, beside the data
                    components=summary.component_rows())
    if prepared is not None:  # what the model was trained on, tracked with it
        link_tree(prepared.folder, staging / prepared.name)
    last = loss[-10:] or [{"loss": float("nan")}]
    # named for what it is: the mean over the last 10 logged steps (the last step's own loss is noisy; loss.json has it)
    metrics = {"loss_last10_mean": round(sum(r["loss"] for r in last) / len(last), 5), "last_loss": round(last[-1]["loss"], 5),
               "steps": summary.final_step}
    if summary.selection is not None:  # the checkpoint that ships is the collapse watch's choice
        metrics["selected_step"] = summary.selection.get("step")
        log.warning("stage %s: publishing %s: %s", stage, summary.checkpoint, summary.selection.get("reason", ""))
    tracker = config.training.tracker
    mlflow = {"tracking_uri": default_tracking_uri(TrackerConfig()), "experiment": tracker.experiment,
              "run_id": summary.mlflow_run_id, "parent_run_id": tracker.parent_run_id}
    finish(stage, staging, kind="checkpoint", params=params, metrics=metrics, method=config.method.target, config=raw,
           inputs=inputs, mlflow=mlflow, volatile={"seconds": round(time.perf_counter() - started, 1)},
           launch={**launch.record, **run_layout(config)},
           weights=weights, pinned=pinned,
           mlflow_files=[(staging / "loss.png", "plots")], plots={f"{stage}_loss.json": loss})


IMPORTED_RECORD = "imported_from.json"  # what `distillery import-weights` writes beside transformer/ (its source file)


def given_model_folder(stage: str, path: str) -> tuple[Path, list[tuple[str, Path]]]:
    """The model folder a given-model stage publishes and its lineage input: ``<stage>.path``'s folder ``path`` (a
    Wan2.1 diffusers folder: ``model_index.json`` naming only library classes, a ``transformer/``), or — its default,
    ``artifacts/base/model`` — the base artifact's model. A folder that is none of these is one line."""
    from distillery.pipeline.params.schema import BASE_MODEL, given_path

    path = given_path(path, BASE_MODEL)
    if path is None:
        return ARTIFACTS / "base" / "model", [("base", ARTIFACTS / "base")]
    from distillery.pipeline.publish.base_folder import check_model_index

    folder = Path(path).expanduser()
    what = f"params.yaml: {stage}.path: {folder}"
    imported = (folder / IMPORTED_RECORD).is_file()  # `distillery import-weights` wrote it: transformer/ + scheduler/
    if not (imported or (folder / "model_index.json").is_file()) or not (folder / "transformer" / "config.json").is_file():
        raise UserError(f"{what} is not a diffusers model folder (model_index.json and transformer/config.json) nor one "
                        f"`distillery import-weights` wrote ({IMPORTED_RECORD}); give a Wan2.1 folder, e.g. "
                        f"Wan2.1-T2V-14B-Diffusers")
    if not imported:
        check_model_index(folder, what)
    return folder, [("source", folder)]


def publish_given_model(params: StageParams) -> None:
    """Publish ``artifacts/<stage>`` from a given model instead of training (``teacher.source: base``,
    ``pretrain.source: given``; a causal recipe's contract adds its ``chunk_size``, an imported folder's record is kept): its
    ``transformer/`` laid out as a trained artifact holds it (its family's ``lay_out_given_model``: a Wan 2.2 A14B's
    second expert inside it and the folder's boundary in its config) and ``scheduler/``, copied without any code file, ``sampling.json`` the many-step Euler
    contract of its own schedule, no loss; metrics ``steps: 0``; the lineage names the folder (or the base
    artifact) as its input and says ``weights: given``. Nothing under ``runs/<stage>`` is touched."""
    from distillery.models.schedule import read_scheduler_shift
    from distillery.pipeline.publish.base_folder import copy_model_folder

    stage = params.stage
    p = getattr(params.typed, stage)
    from distillery.models.registry import family_of

    source, inputs = given_model_folder(stage, p.path)
    started = time.perf_counter()
    staging = fresh_staging(stage)
    from distillery.lineage.manifest import pin_input

    pinned = {role: pin_input(path) for role, path in inputs if role == "source"}  # a given folder as copied
    # every expert and the folder's layout, as a trained artifact holds them (a Wan 2.2 A14B: transformer_2, boundary)
    family_of(source).loaders().lay_out_given_model(
        source, staging / "model", lambda src, dst: copy_model_folder(src, dst, exclude=("lineage.json",)))
    if (source / "scheduler").is_dir():
        copy_model_folder(source / "scheduler", staging / "model" / "scheduler", exclude=("lineage.json",))
    scheduler = staging / "model" / "scheduler"
    if not scheduler.is_dir():
        raise UserError(f"{source}: no scheduler/ beside its transformer/: its flow shift is unknown; give a full "
                        f"Wan2.1 diffusers folder")
    shift = read_scheduler_shift(scheduler)
    num_train = int(json.loads((scheduler / "scheduler_config.json").read_text()).get("num_train_timesteps", 1000))
    contract: dict = {"sampler": "euler", "shift": shift, "num_train_timesteps": num_train}
    contract.update(given_contract(params.recipe(), p))  # a causal recipe (pretrain.method dfsft, ode_init): its chunks
    if "chunk_size" in contract:  # the block-causal student's many-step contract
        from distillery.models.wan.common import image_conditioning

        if image_conditioning(json.loads((staging / "model" / "transformer" / "config.json").read_text())) is not None:
            contract["given_first_frame"] = True  # a causal image-to-video student: its frame 0 is the given frame
    write_json_atomic(staging / "model" / "sampling.json", contract)
    if (source / IMPORTED_RECORD).is_file():  # the file it was imported from (sha256, entry): in the artifact too
        shutil.copy2(source / IMPORTED_RECORD, staging / "model" / IMPORTED_RECORD)
    config = json.loads((staging / "model" / "transformer" / "config.json").read_text())
    log.info("stage %s: %s given as is (%s layers, %s heads of %s): published untrained", stage, source,
             config.get("num_layers"), config.get("num_attention_heads"), config.get("attention_head_dim"))
    finish(stage, staging, kind="model", params=params, metrics={"steps": 0}, inputs=inputs, pinned=pinned,
           plots={f"{stage}_loss.json": []},
           volatile={"seconds": round(time.perf_counter() - started, 1)},
           weights={"role": EXPORT_ROLE, "source": "given", "path": str(source)})


def publish_off(params: StageParams) -> None:
    """Publish ``artifacts/<stage>`` of a switched-off stage (``posttrain.enabled: false``): no model, its lineage of
    kind :data:`OFF_KIND` (the params it read say why), metrics ``steps: 0``; ``runs/<stage>`` is left as it is (a run
    switched on again resumes from it when nothing it depends on changed)."""
    stage = params.stage
    log.info("stage %s: off (%s.enabled: false): no model published", stage, stage)
    finish(stage, fresh_staging(stage), kind=OFF_KIND, params=params, metrics={"steps": 0}, inputs=[],
           plots={f"{stage}_loss.json": []})


def run_training_stage(name: str, params: StageParams) -> None:
    """The runner's entry for training stage ``name``: trained by its recipe, or — a stage whose model ``params.yaml``
    gives (``teacher.source: base``, ``pretrain.source: given``) — published as given, or — a stage switched off
    (``posttrain.enabled: false``) — published as off (:func:`publish_off`)."""
    section = getattr(params.typed, name)
    if section.off():
        publish_off(params)
        return
    if section.given():
        publish_given_model(params)
        return
    stage_training(params)
