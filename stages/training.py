"""The training stages (``teacher``, ``pretrain``, ...): one function for all, driven by the table.

For a stage of :data:`distillery.pipeline.launch.training_table.TRAINING_STAGES`, :func:`stage_training`:

1. fills the run config (:func:`distillery.pipeline.launch.run_config.fill_run_config`), builds it once and checks
   the whole chain before any training (:func:`~distillery.pipeline.launch.run_config.check_chain`): what the stage
   reads of its run config afterwards it reads from that build;
2. writes ``runs/<stage>/run.yaml`` with its resume key (:mod:`distillery.pipeline.launch.resume_key`): a
   killed stage resumes from its last checkpoint; a stage whose config, inputs or code changed
   starts from step 0 and says why (docs/reliability.md);
3. launches ``python -m distillery.cli.launch`` (torchrun, contained), one agent per node, as
   ``params.yaml: gpus`` says (:mod:`distillery.pipeline.launch.launcher`: local, or ``srun`` over a Slurm
   allocation; one local process is the worker itself); every agent dies with this process, its
   workers with it — and while they train, this process imports what publishing needs
   (:class:`PublishImports`);
4. reads the run's ``run_summary.json`` (:mod:`distillery.pipeline.publish.run_summary`) and publishes the
   artifact: ``model/`` (the trained role's transformer — its EMA shadow when ``<stage>.ema_decay`` is
   set, :func:`shipped_weights` —, the init's scheduler, ``sampling.json`` from the summary's sampling
   contract), ``loss.json`` and its curve ``loss.png``, metrics and lineage (its ``launch``: launcher,
   nodes, processes per node, and the Slurm job id under Slurm; its ``weights``: which weights ship).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from distillery.common.errors import UserError
from distillery.common.fsutil import write_text_atomic
from distillery.common.log import get_logger
from distillery.pipeline.launch.training_table import EMA_CALLBACK, TRAINING_STAGES, TrainingStageSpec
from distillery.pipeline.params.reader import StageParams
from distillery.pipeline.publish.artifacts import ARTIFACTS, RUNS, finish, fresh_staging, write_json_atomic

log = get_logger("stage")


def training_launch(params: StageParams, config_path: Path):
    """The launch of ``-m distillery.cli.train --config <config_path>`` that ``params.yaml: gpus`` asks for
    (:func:`distillery.pipeline.launch.launcher.plan_launch`: one torchrun agent per node, local or over Slurm)."""
    from distillery.pipeline.launch.launcher import plan_launch

    return plan_launch(params.get("gpus"), ["--config", str(config_path)])


def prepare_run_dir(stage: str, raw: dict[str, Any], inputs: dict[str, Path], world_size: int = 1) -> Path:
    """``runs/<stage>/run.yaml`` + ``resume_key.json``; returns the run.yaml path. Checkpoints made
    from another config, other inputs or other code are discarded (one line says what changed): a
    stage resumes only what the same inputs made (docs/reliability.md). An input's digest from the hash
    cache never discards them alone: it is re-read from the input's bytes first
    (:func:`rehashed_key`). A previous run's summary is removed, so the summary read after training
    is the one this launch wrote. Only what runs of the stage wrote is ever deleted (:func:`discard_run`);
    ``runs/<stage>`` as a symbolic link, or its lock file as a link, folder or FIFO, is one line, nothing touched."""
    from distillery.common.procutil import exclusive_lock
    from distillery.components.checkpoint.manager import list_checkpoints
    from distillery.pipeline.launch.resume_key import KEY_FILE, key_mismatch, read_key, resume_key
    from distillery.pipeline.publish.run_summary import SUMMARY_FILE

    key = resume_key(stage, raw, inputs, world_size)
    run_dir = RUNS / stage
    if run_dir.exists():
        # a writer still alive there (an orphaned worker, another stage) must not lose its folder under it
        with exclusive_lock(run_dir / ".lock", f"training output folder {run_dir}"):
            leftovers = list_checkpoints(run_dir) or any(run_dir.glob(".tmp-checkpoint-*")) or (run_dir / "train_log.jsonl").exists()
            saved = read_key(run_dir)
            why = key_mismatch(saved, key) if leftovers else None
            if why and saved:  # an input's digest may come from the hash cache: re-read it before discarding
                key = rehashed_key(stage, key, saved, inputs)
                why = key_mismatch(saved, key)
            if why:
                log.info("stage %s: not resuming %s (%s): starting from step 0", stage, run_dir, why)
                discard_run(run_dir)
            (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / KEY_FILE, json.dumps(key, indent=2, sort_keys=True))
    path = run_dir / "run.yaml"
    write_text_atomic(path, yaml.safe_dump(raw, sort_keys=True))
    return path


def discard_run(run_dir: Path) -> None:
    """Delete what runs of this stage wrote in ``run_dir`` — its recorded checkpoints, killed saves' temp
    folders, the run's log, summary, key and config — and nothing else: a file or folder it did not write
    (or a symbolic link, whatever its name) is left alone, said in one warning line."""
    from distillery.components.checkpoint import record
    from distillery.components.checkpoint.trust import CHECKPOINT_RE
    from distillery.engine.run_log import LOG_FILE
    from distillery.pipeline.launch.resume_key import KEY_FILE
    from distillery.pipeline.publish.run_summary import SUMMARY_FILE

    ours = record.written(run_dir)
    files = {LOG_FILE, SUMMARY_FILE, KEY_FILE, "run.yaml", record.RECORD_FILE}
    left = []
    for child in sorted(run_dir.iterdir()):
        if child.name == ".lock":
            continue
        if child.is_symlink():
            left.append(child.name)
        elif child.is_dir() and (child.name in ours or (child.name.startswith(".tmp-")
                                                        and CHECKPOINT_RE.match(child.name[len(".tmp-"):]))):
            shutil.rmtree(child)
        elif child.is_file() and child.name in files:
            child.unlink()
        else:
            left.append(child.name)
    if left:
        log.warning("%s holds %d entr%s this stage did not write (%s): left alone", run_dir, len(left),
                    "y" if len(left) == 1 else "ies", ", ".join(left[:5]) + (", …" if len(left) > 5 else ""))


def rehashed_key(stage: str, key: dict[str, str], saved: dict[str, str], inputs: dict[str, Path]) -> dict[str, str]:
    """``key`` with each input whose digest differs from ``saved`` re-hashed from its files' bytes,
    not taken from the hash cache; a cached digest that was wrong is corrected in the cache and
    reported in one warning line."""
    from distillery.common import hashcache
    from distillery.pipeline.launch.resume_key import folder_digest

    changed = {role: folder for role, folder in inputs.items() if saved.get(f"input:{role}") != key.get(f"input:{role}")}
    before = len(hashcache.CORRECTED)
    with hashcache.from_bytes():
        fresh = {f"input:{role}": folder_digest(folder) for role, folder in sorted(changed.items())}
    wrong = hashcache.CORRECTED[before:]
    if wrong:
        log.warning("stage %s: the hash cache held a wrong digest for %d input file(s) (first: %s); re-hashed from "
                    "their bytes and corrected in the cache", stage, len(wrong), wrong[0])
    return {**key, **fresh}


def kill_launcher() -> None:
    """Kill the running launch, if any (every agent's workers die with it; checkpoints are atomic)."""
    from distillery.pipeline.launch.launcher import kill_children

    kill_children()


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


def shipped_weights(spec: TrainingStageSpec, raw: dict[str, Any]) -> dict[str, Any]:
    """Which weights of the run ``raw`` the artifact ships, as its lineage records them: the trained
    role's own (``source: trained``), or — with the stage's EMA in the run config — the EMA shadow
    (``source: ema``, the callback, its decay and start step): what validate scores and export ships."""
    ema = (raw.get("callbacks") or {}).get(EMA_CALLBACK)
    if ema is None:
        return {"role": spec.export_role, "source": "trained"}
    return {"role": spec.export_role, "source": "ema", "callback": EMA_CALLBACK, "ema_decay": ema["decay"],
            "ema_start_step": ema["start_step"]}


def stage_training(spec: TrainingStageSpec, params: StageParams) -> None:
    """Train the stage ``spec`` declares and publish ``artifacts/<stage>`` (module doc)."""
    from distillery.components.tracking import default_tracking_uri
    from distillery.config.schema import TrackerConfig
    from distillery.pipeline.launch.run_config import check_chain, fill_run_config
    from distillery.pipeline.publish.mlflow_runs import parent_run_id
    from distillery.pipeline.publish.run_summary import read_run_summary

    stage = spec.name
    spec = spec.resolve(params)  # the recipe params.yaml picks (distill.method)
    trajectories = None
    if spec.trajectories:  # pretrain.method: ode_init: the teacher's ODE trajectories first (resumable), the data it trains on
        from stages.trajectories import TEACHER_ARTIFACT, stage_trajectories

        trajectories = stage_trajectories(stage, params, spec.data)
    raw = fill_run_config(spec, params, parent_run_id(params.path.read_text()), trajectories)
    config = check_chain(spec, raw)
    inputs = [(role, ARTIFACTS / artifact) for role, artifact in spec.input_artifacts()]
    resume_inputs = dict(inputs)
    if trajectories is not None:
        inputs.append(("teacher", ARTIFACTS / TEACHER_ARTIFACT))  # whose trajectories; the prompts: the data input
        resume_inputs.update(teacher=ARTIFACTS / TEACHER_ARTIFACT, trajectories=trajectories)
    world = params.get("gpus").world_size
    config_path = prepare_run_dir(stage, raw, resume_inputs, world)  # resumable on another world: the same global batch
    started = time.perf_counter()
    from distillery.pipeline.launch.launcher import run_launch

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if params.get("gpus.nproc_per_node") > 1 else "2")}
    launch = training_launch(params, config_path)
    init_from = config.models[spec.export_role].config.init_from
    publishing = PublishImports(init_from, diffusers=config.models[spec.export_role].lora is not None)
    code = run_launch(launch, env, while_running=publishing.start)
    if code != 0:
        raise SystemExit(code)  # the launcher printed the one line (a user error: code 2)
    publishing.wait()
    from distillery.evaluation.plots import write_loss_plot
    from distillery.export.weights import export_weights
    from distillery.models.registry import locate_transformer
    run_dir = RUNS / stage
    summary = read_run_summary(run_dir)
    checkpoint = summary.checkpoint_dir(run_dir)
    if summary.final_step != config.training.loop.max_train_steps or checkpoint is None or not checkpoint.is_dir():
        raise UserError(f"stage {stage}: training ended without its final checkpoint in {run_dir}")
    staging = fresh_staging(stage)
    weights = shipped_weights(spec, raw)
    export_weights(checkpoint, spec.export_role, staging / "model", ema=weights.get("callback"))
    _, scheduler = locate_transformer(init_from)
    if scheduler is not None:
        shutil.copytree(scheduler, staging / "model" / "scheduler")
    loss = summary.loss_rows()
    (staging / "loss.json").write_text(json.dumps(loss))
    write_loss_plot(loss, staging / "loss.png", f"{stage}: loss per step",  # the curves offline, beside the data
                    components=summary.component_rows())
    write_json_atomic(staging / "model" / "sampling.json", summary.sampling)
    if trajectories is not None:  # what the model was trained on, tracked with it
        from stages.trajectories import publish_trajectories

        publish_trajectories(trajectories, staging)
    last = loss[-10:] or [{"loss": float("nan")}]
    # named for what it is: the mean over the last 10 logged steps (the last step's own loss is noisy; loss.json has it)
    metrics = {"loss_last10_mean": round(sum(r["loss"] for r in last) / len(last), 5), "last_loss": round(last[-1]["loss"], 5),
               "steps": summary.final_step}
    tracker = config.training.tracker
    mlflow = {"tracking_uri": default_tracking_uri(TrackerConfig()), "experiment": tracker.experiment,
              "run_id": summary.mlflow_run_id, "parent_run_id": tracker.parent_run_id}
    finish(stage, staging, kind="checkpoint", params=params, metrics=metrics, method=config.method.target, config=raw,
           inputs=inputs, mlflow=mlflow, volatile={"seconds": round(time.perf_counter() - started, 1)}, launch=launch.record,
           weights=weights,
           mlflow_files=[(staging / "loss.png", "plots")], plots={f"{stage}_loss.json": loss})


IMPORTED_RECORD = "imported_from.json"  # what `distillery import-weights` writes beside transformer/ (its source file)


def given_model_folder(spec: TrainingStageSpec, params: StageParams) -> tuple[Path, list[tuple[str, Path]]]:
    """The model folder a given-model stage publishes and its lineage input: ``<given_path_key>``'s folder
    (a Wan2.1 diffusers folder: ``model_index.json`` naming only library classes, a ``transformer/``), or
    — its default, ``artifacts/base/model`` — the base artifact's model. A folder that is none of these is one line."""
    from distillery.pipeline.params.schema import BASE_MODEL, given_path

    path = given_path(params.get(spec.given_path_key), BASE_MODEL) if spec.given_path_key else None
    if path is None:
        return ARTIFACTS / "base" / "model", [("base", ARTIFACTS / "base")]
    from distillery.pipeline.publish.base_folder import check_model_index

    folder = Path(path).expanduser()
    what = f"params.yaml: {spec.given_path_key}: {folder}"
    imported = (folder / IMPORTED_RECORD).is_file()  # `distillery import-weights` wrote it: transformer/ + scheduler/
    if not (imported or (folder / "model_index.json").is_file()) or not (folder / "transformer" / "config.json").is_file():
        raise UserError(f"{what} is not a diffusers model folder (model_index.json and transformer/config.json) nor one "
                        f"`distillery import-weights` wrote ({IMPORTED_RECORD}); give a Wan2.1 folder, e.g. "
                        f"Wan2.1-T2V-14B-Diffusers")
    if not imported:
        check_model_index(folder, what)
    return folder, [("source", folder)]


def publish_given_model(spec: TrainingStageSpec, params: StageParams) -> None:
    """Publish ``artifacts/<stage>`` from a given model instead of training (``teacher.source: base``,
    ``pretrain.source: given``; a causal recipe's contract adds its ``chunk_size``, an imported folder's record is kept): its
    ``transformer/`` laid out as a trained artifact holds it (its family's ``lay_out_given_model``: a Wan 2.2 A14B's
    second expert inside it and the folder's boundary in its config) and ``scheduler/``, copied without any code file, ``sampling.json`` the many-step Euler
    contract of its own schedule, no loss; metrics ``steps: 0``; the lineage names the folder (or the base
    artifact) as its input and says ``weights: given``. Nothing under ``runs/<stage>`` is touched."""
    from distillery.models.schedule import read_scheduler_shift
    from distillery.pipeline.publish.base_folder import copy_model_folder

    stage = spec.name
    from distillery.models.registry import family_of

    source, inputs = given_model_folder(spec, params)
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
    chunks = dict(spec.resolve(params).config_overrides(params)).get("models.student.chunk_size")
    if chunks is not None:  # a causal recipe (pretrain.method dfsft / ode_init): the block-causal student's many-step contract
        contract["chunk_size"] = int(chunks)
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
           weights={"role": spec.export_role, "source": "given", "path": str(source)})


def run_training_stage(name: str, params: StageParams) -> None:
    """The runner's entry for training stage ``name`` (a row of the training table): trained, or — a stage whose
    model ``params.yaml`` gives (:meth:`TrainingStageSpec.given`) — published as given."""
    spec = TRAINING_STAGES[name]
    if spec.given(params):
        publish_given_model(spec, params)
        return
    stage_training(spec, params)
