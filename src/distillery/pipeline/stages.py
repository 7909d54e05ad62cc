"""``distillery stage <name>``: one pipeline stage = params.yaml → work → ``artifacts/<name>/``.

Every stage writes its payload, ``metrics.json`` and ``lineage.json`` (DESIGN.md §2) into
``artifacts/<name>.tmp/`` and renames it to ``artifacts/<name>/`` only when complete, so a failed
or killed stage leaves the previous artifact as it was (dvc.yaml marks the outs ``persist`` so DVC
does not delete them first either); it logs an MLflow child run under the pipeline's parent run.
A rerun that makes the same bytes from the same inputs keeps the previous record (lineage and
metrics), so the artifact is byte-identical and downstream stages stay cached.

Around every stage (:func:`run_stage`): ``params.yaml`` is validated whole first; one writer per
stage (a lock in ``runs/.locks/``); the stage dies with the process that started it; the output
folders are checked for writability and room before any work; a disk error becomes one line.

Training stages (teacher, pretrain) check the whole chain before training, write their run config
to ``runs/<name>/run.yaml`` with its resume key (:mod:`distillery.pipeline.resume_key`), and launch
``python -m distillery.launch`` (torchrun, contained) with ``params.yaml: gpus``; their checkpoints
live in ``runs/<name>/`` (not a DVC out). A killed stage resumes from its last checkpoint; a stage
whose config, inputs or code changed starts from step 0 and says why.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from distillery.errors import UserError
from distillery.fsutil import replace_dir, write_text_atomic
from distillery.log import get_logger
from distillery.pipeline.params import Params

log = get_logger("stage")

ARTIFACTS = Path("artifacts")
RUNS = Path("runs")

# The params.yaml keys each stage reads (dvc.yaml lists the same keys as the stage's params).
STAGE_PARAMS: dict[str, list[str]] = {
    "clips": ["seed", "clips"],
    "base": ["base.path"],
    "latents": ["clips.num_frames", "clips.size", "clips.fps", "latents"],
    "teacher": ["seed", "gpus", "teacher"],
    "pretrain": ["seed", "gpus", "pretrain"],
    "validate": ["seed", "validate", "clips.num_frames", "clips.size", "clips.fps"],
    "export": ["export"],
}


# -- artifact folders ---------------------------------------------------------------------------
def fresh_staging(stage: str) -> Path:
    tmp = ARTIFACTS / f"{stage}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish(stage: str, staging: Path) -> Path:
    """Rename the stage's staging folder to ``artifacts/<stage>`` (replacing the previous one)."""
    return replace_dir(staging, ARTIFACTS / stage)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, default=str))


VOLATILE_KEYS = ("created", "code", "mlflow", "manifest_sha256")  # facts of one run, not of the artifact's content


def stable_view(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest without the facts that differ between two runs making the same bytes (times,
    code commit, MLflow ids, the tracker section of the config); inputs by role, path and digest."""
    view = {k: v for k, v in manifest.items() if k not in VOLATILE_KEYS}
    config = view.get("config")
    if isinstance(config, dict) and isinstance(config.get("training"), dict):
        view["config"] = {**config, "training": {k: v for k, v in config["training"].items() if k != "tracker"}}
    view["inputs"] = [{k: i.get(k) for k in ("role", "path", "sha256")} for i in view.get("inputs") or []]
    return view


def keep_previous_record(stage: str, staging: Path) -> bool:
    """Same inputs, same bytes: when the previous ``artifacts/<stage>`` has the same payload and the
    same stable manifest as ``staging``, put its lineage.json and metrics.json in ``staging`` so the
    new artifact is byte-identical (DVC then keeps every downstream stage cached). Its lineage then
    names the MLflow run that first made these bytes. Returns True when it did."""
    from distillery.lineage import LINEAGE_FILE

    previous = ARTIFACTS / stage
    try:
        old = json.loads((previous / LINEAGE_FILE).read_text())
        new = json.loads((staging / LINEAGE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if stable_view(old) != stable_view(new):
        return False
    for name in (LINEAGE_FILE, "metrics.json"):
        shutil.copy2(previous / name, staging / name)
    log.info("stage %s: same inputs and same bytes as the previous artifact: kept its record (MLflow run %s)",
             stage, (old.get("mlflow") or {}).get("run_id"))
    return True


def finish(stage: str, staging: Path, *, kind: str, params: Params, metrics: dict[str, Any], inputs: list[tuple[str, Path]],
           method: str | None = None, config: dict | None = None, mlflow: dict | None = None,
           volatile: dict[str, Any] | None = None) -> Path:
    """metrics.json + lineage.json into ``staging``, the MLflow child run (unless the trainer made
    one), then publish ``staging`` as ``artifacts/<stage>``. ``metrics`` must be a function of the
    artifact's content; ``volatile`` numbers (durations) go to MLflow and ``metrics/<stage>.json`` only."""
    from distillery.lineage import Input, write_lineage
    from distillery.pipeline.tracking import log_stage_run, parent_run_id

    write_json_atomic(staging / "metrics.json", metrics)
    read = params.subset(STAGE_PARAMS[stage])
    if mlflow is None:
        mlflow = log_stage_run(stage, parent_run_id(params.path.read_text()), read, {**metrics, **(volatile or {})})
    write_lineage(staging, kind=kind, stage=stage, method=method, config=config, params=read,
                  inputs=[Input(role, path) for role, path in inputs], mlflow=mlflow, metrics=metrics,
                  artifact_name=(ARTIFACTS / stage).as_posix())
    keep_previous_record(stage, staging)
    artifact = publish(stage, staging)
    Path("metrics").mkdir(exist_ok=True)
    write_json_atomic(Path("metrics") / f"{stage}.json", {**metrics, **(volatile or {})})  # what dvc.yaml declares as metrics
    return artifact


# -- stages -------------------------------------------------------------------------------------
def stage_clips(params: Params) -> None:
    from distillery.clips.synthetic import ClipSetConfig, make_clip_set

    c = params.get("clips")
    staging = fresh_staging("clips")
    started = time.perf_counter()
    cfg = ClipSetConfig(num_train=c["num_train"], num_validation=c["num_validation"], num_frames=c["num_frames"],
                        height=c["size"], width=c["size"], fps=c["fps"], seed=params.get("seed"))
    make_clip_set(staging / "data", cfg)
    finish("clips", staging, kind="data", params=params, inputs=[],
           metrics={"clips_train": c["num_train"], "clips_validation": c["num_validation"]},
           volatile={"seconds": round(time.perf_counter() - started, 2)})


def resolve_base(path: str) -> Path:
    if path == "tiny":
        from distillery.tinybase.shipped import shipped_tiny_base

        return shipped_tiny_base()
    p = Path(path).expanduser()
    if not (p / "model_index.json").is_file():
        raise UserError(f"params.yaml: base.path: {p} is not a diffusers model folder (no model_index.json); use 'tiny' or a Wan2.1 folder")
    return p


def stage_base(params: Params) -> None:
    source = resolve_base(params.get("base.path"))
    staging = fresh_staging("base")
    shutil.copytree(source, staging / "model", ignore=shutil.ignore_patterns("lineage.json"))
    cfg = json.loads((staging / "model" / "transformer" / "config.json").read_text())
    finish("base", staging, kind="model", params=params, inputs=[("source", source)],
           metrics={"transformer_layers": cfg.get("num_layers"), "latent_channels": cfg.get("in_channels")})


def stage_latents(params: Params) -> None:
    from distillery.preprocess import PreprocessConfig, preprocess

    data = params.get("latents.data") or str(ARTIFACTS / "clips" / "data")
    staging = fresh_staging("latents")
    l = params.get("latents")
    cfg = PreprocessConfig(num_frames=params.get("clips.num_frames"), height=params.get("clips.size"),
                           width=params.get("clips.size"), fps=float(params.get("clips.fps")),
                           rows_per_shard=l["rows_per_shard"], max_bad_fraction=l["max_bad_fraction"])
    manifest = preprocess(ARTIFACTS / "base" / "model", Path(data), staging / "data", cfg)
    metrics = {f"{s}_clips": c["rows"] for s, c in manifest["splits"].items()}
    metrics.update({f"{s}_skipped": c["skipped"] for s, c in manifest["splits"].items()})
    inputs = [("base", ARTIFACTS / "base"), ("videos", ARTIFACTS / "clips" if not params.get("latents.data") else Path(data))]
    finish("latents", staging, kind="data", params=params, inputs=inputs, metrics=metrics,
           volatile={"seconds": manifest["seconds_this_run"]})


TRAINING = {
    # stage: (template, init artifact)
    "teacher": ("stages/teacher_sft.yaml", "base"),
    "pretrain": ("stages/pretrain_dfsft.yaml", "teacher"),
}


def build_run_config(stage: str, params: Params) -> dict[str, Any]:
    """The stage's run config: its template with paths and params.yaml values filled in."""
    from distillery.pipeline.tracking import parent_run_id

    template, init = TRAINING[stage]
    raw = yaml.safe_load(Path(template).read_text())
    p = params.get(stage)
    latents = json.loads((ARTIFACTS / "latents" / "data" / "preprocess.json").read_text())
    raw["models"]["student"]["init_from"] = str(ARTIFACTS / init / "model")
    t = raw["training"]
    t["data"].update(path=str(ARTIFACTS / "latents" / "data"), batch_size=p["batch_size"],
                     text_max_length=latents["settings"]["max_sequence_length"])
    t["optimizer"]["learning_rate"] = p["learning_rate"]
    t["loop"].update(max_train_steps=p["steps"], seed=params.get("seed"), progress_bar=False)
    t["checkpoint"].update(output_dir=str(RUNS / stage), save_every=p["save_every"])
    t["tracker"].update(parent_run_id=parent_run_id(params.path.read_text()), run_name=stage, tags={"distillery.stage": stage})
    if stage == "pretrain":
        raw["method"]["chunk_size"] = p["chunk_size"]
    return raw


def check_chain(stage: str, raw: dict[str, Any]) -> None:
    """Before any training: the config builds, the roles fit the method, and the init model fits the data."""
    from distillery.engine.builder import check_roles_early
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.models.wan import locate_transformer

    config = load_run_config(raw=raw, prefixes=allowed_prefixes())
    check_roles_early(config)
    latents = json.loads((Path(config.training.data.path) / "preprocess.json").read_text())
    tdir, _ = locate_transformer(config.models["student"].config.init_from)
    arch = json.loads((tdir / "config.json").read_text())
    if arch.get("in_channels") != latents["latent_channels"]:
        raise UserError(f"stage {stage}: the model in {tdir} takes {arch.get('in_channels')} latent channels, "
                        f"the latents have {latents['latent_channels']}; preprocess with this model's VAE")
    if arch.get("text_dim") != latents["text_dim"]:
        raise UserError(f"stage {stage}: the model in {tdir} takes text_dim {arch.get('text_dim')}, the latents' "
                        f"prompt embeddings have {latents['text_dim']}; preprocess with this model's text encoder")


def torchrun_command(params: Params, config_path: Path) -> list[str]:
    g = params.get("gpus")
    cmd = [sys.executable, "-m", "distillery.launch", "--nproc_per_node", str(g["nproc_per_node"])]
    if int(g["nnodes"]) > 1:  # params.yaml was validated: rdzv_endpoint is a host:port here
        cmd += ["--nnodes", str(g["nnodes"]), "--rdzv_backend", "c10d", "--rdzv_endpoint", str(g["rdzv_endpoint"])]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", "distillery.train", "--config", str(config_path)]


def prepare_run_dir(stage: str, raw: dict[str, Any], key: dict[str, str]) -> Path:
    """``runs/<stage>/run.yaml`` + ``resume_key.json``. Checkpoints made from another config,
    other inputs or other code are discarded (one line says what changed): a stage resumes only
    what the same inputs made (DESIGN.md §2.2)."""
    from distillery.engine.checkpoint.manager import list_checkpoints
    from distillery.pipeline.resume_key import KEY_FILE, key_mismatch, read_key
    from distillery.procutil import exclusive_lock

    run_dir = RUNS / stage
    if run_dir.exists():
        # a writer still alive there (an orphaned worker, another stage) must not lose its folder under it
        with exclusive_lock(run_dir / ".lock", f"training output folder {run_dir}"):
            leftovers = list_checkpoints(run_dir) or any(run_dir.glob(".tmp-checkpoint-*")) or (run_dir / "train_log.jsonl").exists()
            why = key_mismatch(read_key(run_dir), key) if leftovers else None
            if why:
                log.info("stage %s: not resuming %s (%s): starting from step 0", stage, run_dir, why)
                for child in run_dir.iterdir():
                    if child.name != ".lock":
                        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / KEY_FILE, json.dumps(key, indent=2, sort_keys=True))
    path = run_dir / "run.yaml"
    write_text_atomic(path, yaml.safe_dump(raw, sort_keys=True))
    return path


_CHILD: subprocess.Popen | None = None  # the running torchrun launcher, stopped if this stage is orphaned


def _launch(cmd: list[str], env: dict[str, str]) -> int:
    """Run the launcher as a child that dies with this process (and its workers with it)."""
    global _CHILD
    from distillery.procutil import die_with_parent

    _CHILD = subprocess.Popen(cmd, env=env, preexec_fn=lambda: die_with_parent(signal.SIGKILL))
    try:
        return _CHILD.wait()
    finally:
        if _CHILD.poll() is None:
            _CHILD.terminate()
            _CHILD.wait()
        _CHILD = None


def stage_training(stage: str, params: Params) -> None:
    from distillery.engine.checkpoint.manager import list_checkpoints
    from distillery.export import export_weights
    from distillery.models.schedule import read_scheduler_shift
    from distillery.models.wan import locate_transformer
    from distillery.pipeline.resume_key import resume_key

    raw = build_run_config(stage, params)
    check_chain(stage, raw)
    init = TRAINING[stage][1]
    key = resume_key(stage, raw, {"student_init": ARTIFACTS / init, "data": ARTIFACTS / "latents"})
    config_path = prepare_run_dir(stage, raw, key)
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if params.get("gpus.nproc_per_node") > 1 else "2")}
    code = _launch(torchrun_command(params, config_path), env)
    if code != 0:
        raise SystemExit(code)  # the launcher printed the one line (a user error: code 2)
    found = list_checkpoints(RUNS / stage)
    if not found or found[-1][0] != raw["training"]["loop"]["max_train_steps"]:
        raise UserError(f"stage {stage}: training ended without its final checkpoint in {RUNS / stage}")
    checkpoint = found[-1][1]
    staging = fresh_staging(stage)
    export_weights(checkpoint, "student", staging / "model")
    _, scheduler = locate_transformer(raw["models"]["student"]["init_from"])
    if scheduler is not None:
        shutil.copytree(scheduler, staging / "model" / "scheduler")
    meta = json.loads((checkpoint / "metadata.json").read_text())
    rows = [json.loads(line) for line in (RUNS / stage / "train_log.jsonl").read_text().splitlines() if line.strip()]
    loss = [{"step": r["step"], "loss": r["total_loss"]} for r in rows if "total_loss" in r]
    (staging / "loss.json").write_text(json.dumps(loss))
    Path("plots").mkdir(exist_ok=True)
    write_json_atomic(Path("plots") / f"{stage}_loss.json", loss)
    shift = read_scheduler_shift(staging / "model" / "scheduler") if scheduler else None
    write_json_atomic(staging / "model" / "sampling.json", {"sampler": "euler", "shift": shift, "num_train_timesteps": 1000})
    last = loss[-10:] or [{"loss": float("nan")}]
    metrics = {"final_loss": round(sum(r["loss"] for r in last) / len(last), 5), "steps": meta["step"]}
    from distillery.engine.tracking import default_tracking_uri
    from distillery.config.schema import TrackerConfig

    mlflow = {"tracking_uri": default_tracking_uri(TrackerConfig()), "experiment": raw["training"]["tracker"]["experiment"],
              "run_id": meta.get("mlflow_run_id"), "parent_run_id": raw["training"]["tracker"]["parent_run_id"]}
    finish(stage, staging, kind="checkpoint", params=params, metrics=metrics, method=raw["method"]["_target_"], config=raw,
           inputs=[("student_init", ARTIFACTS / init), ("data", ARTIFACTS / "latents")], mlflow=mlflow,
           volatile={"seconds": round(time.perf_counter() - started, 1)})


def validation_prompts(n: int) -> list[str]:
    """The first ``n`` distinct captions of the latents' validation split (train split if none)."""
    from distillery.data import LatentDataset

    root = ARTIFACTS / "latents" / "data"
    split = "validation" if (root / "validation").is_dir() and any((root / "validation").glob("*.parquet")) else "train"
    ds = LatentDataset(root, split)
    seen: list[str] = []
    for i in range(len(ds)):
        caption = ds[i]["caption"]
        if caption not in seen:
            seen.append(caption)
        if len(seen) == n:
            break
    return seen


def stage_validate(params: Params) -> None:
    """Teacher at many and few steps, the pretrained student at its steps: adherence, NFE, latency, distance."""
    from distillery.validate import Candidate, ValidationConfig, run_validation, teacher_candidates

    v = params.get("validate")
    cfg = ValidationConfig(num_frames=params.get("clips.num_frames"), height=params.get("clips.size"),
                           width=params.get("clips.size"), fps=float(params.get("clips.fps")),
                           teacher_steps=list(v["teacher_steps"]), guidance_scale=float(v["guidance_scale"]),
                           seed=params.get("seed"), progress_bar=False)
    candidates = teacher_candidates(ARTIFACTS / "teacher" / "model", cfg)
    candidates.append(Candidate(f"pretrain_{v['student_steps']}", ARTIFACTS / "pretrain" / "model", int(v["student_steps"]),
                                float(v["guidance_scale"]), "euler"))
    staging = fresh_staging("validate")
    metrics = run_validation(ARTIFACTS / "base" / "model", candidates, validation_prompts(int(v["num_prompts"])),
                             staging / "report", cfg)
    Path("plots").mkdir(exist_ok=True)
    shutil.copy2(staging / "report" / "plots" / "adherence.csv", Path("plots") / "validate_adherence.csv")
    finish("validate", staging, kind="validation", params=params, metrics=metrics,
           inputs=[("teacher", ARTIFACTS / "teacher"), ("student", ARTIFACTS / "pretrain"), ("base", ARTIFACTS / "base"),
                   ("data", ARTIFACTS / "latents")])


def stage_export(params: Params) -> None:
    """A complete diffusers folder: the base's parts + the chosen student's transformer, lineage inside."""
    student = params.get("export.student")
    if student not in TRAINING:
        raise UserError(f"params.yaml: export.student: {student!r}; valid: {', '.join(TRAINING)}")
    staging = fresh_staging("export")
    model = staging  # the artifact *is* the diffusers folder, lineage.json inside
    base = ARTIFACTS / "base" / "model"
    skip = shutil.ignore_patterns("lineage.json", "fit_report.json")
    shutil.copytree(base, model, dirs_exist_ok=True,  # the base's own transformer is not copied at all
                    ignore=lambda folder, names: set(skip(folder, names)) | ({"transformer"} if Path(folder) == base else set()))
    shutil.copytree(ARTIFACTS / student / "model" / "transformer", model / "transformer")
    shutil.copy2(ARTIFACTS / student / "model" / "sampling.json", model / "sampling.json")
    finish("export", staging, kind="export", params=params, metrics={"student_stage": 0 if student == "teacher" else 1},
           inputs=[("student", ARTIFACTS / student), ("base", ARTIFACTS / "base")])


STAGES: dict[str, Callable[[Params], None]] = {
    "clips": stage_clips,
    "base": stage_base,
    "latents": stage_latents,
    "teacher": lambda p: stage_training("teacher", p),
    "pretrain": lambda p: stage_training("pretrain", p),
    "validate": stage_validate,
    "export": stage_export,
}


def _orphaned(stage: str) -> None:
    """The process that started this stage (dvc, a Prefect task, a shell) is gone: stop now, and
    the launcher and its workers with us (they die with their parent)."""
    log.warning("stage %s: the process that started it is gone: stopping (a rerun resumes)", stage)
    child = _CHILD
    if child is not None and child.poll() is None:
        child.kill()  # its workers die with it (checkpoints are atomic: nothing half-written survives)
    os._exit(143)


def cleanup_failed(stage: str) -> None:
    """Remove what a failed run of ``stage`` left half-written beside its artifact."""
    shutil.rmtree(ARTIFACTS / f"{stage}.tmp", ignore_errors=True)
    for old in ARTIFACTS.glob(f".{stage}.old-*"):
        shutil.rmtree(old, ignore_errors=True)


def run_stage(name: str, params_path: str = "params.yaml") -> int:
    """Run one stage: one writer at a time, dies with whoever started it, checked for room before
    working, and on any failure leaves the previous ``artifacts/<name>`` as it was."""
    from distillery.pipeline.preflight import check_free_space, check_writable, disk_error
    from distillery.procutil import AncestorWatch, exclusive_lock

    if name not in STAGES:
        raise UserError(f"unknown stage {name!r}; valid: {', '.join(STAGES)}")
    params = Params.load(params_path)
    watch = AncestorWatch(lambda: _orphaned(name))
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # `nohup distillery stage ...` asks to outlive its shell
        watch.start()
    try:
        check_writable([ARTIFACTS, RUNS / ".locks"] + ([RUNS] if name in TRAINING else []), name)
        with exclusive_lock(RUNS / ".locks" / f"{name}.lock", f"stage {name}"):
            cleanup_failed(name)  # what a killed earlier run of this stage left half-written
            check_free_space(name, params, ARTIFACTS)
            try:
                STAGES[name](params)
            except BaseException as exc:
                cleanup_failed(name)
                problem = disk_error(name, exc) if isinstance(exc, OSError) else None
                if problem is None:
                    raise
                raise problem from None
    finally:
        watch.stop()
    log.info("stage %s done: %s", name, ARTIFACTS / name)
    return 0


def add_stage_command(sub: Any) -> None:
    p = sub.add_parser("stage", help="run one pipeline stage (what dvc.yaml calls)")
    p.add_argument("name", help="clips | base | latents | teacher | pretrain | validate | export")
    p.add_argument("--params", default="params.yaml")
    p.set_defaults(func=lambda args: run_stage(args.name, args.params))
