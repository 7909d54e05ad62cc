"""Publishing a stage's artifact (docs/architecture.md §2): staging folder → record → atomic rename.

Every stage writes its payload into ``artifacts/<stage>.tmp/`` (:func:`fresh_staging`); :func:`finish`
adds ``metrics.json`` and ``lineage.json`` and renames it to ``artifacts/<stage>/`` only when complete,
so a failed or killed stage leaves the previous artifact as it was (dvc.yaml marks the outs
``persist`` so DVC does not delete them first either). A rerun that makes the same bytes from the
same inputs keeps the previous record (:func:`keep_previous_record`), so the artifact is
byte-identical and downstream stages stay cached.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from distillery.common.fsutil import follow_umask, replace_dir, write_text_atomic
from distillery.common.log import get_logger
from distillery.pipeline.params.reader import StageParams

log = get_logger("stage")

ARTIFACTS = Path("artifacts")  # DVC outs, relative to the pipeline folder (the stage's cwd)
RUNS = Path("runs")  # training stages' checkpoints (not DVC outs)

OFF_KIND = "off"  # the lineage kind of a switched-off stage's artifact (posttrain.enabled: false): no model/ in it


def published_off(stage: str) -> bool:
    """Whether ``artifacts/<stage>`` records a stage that was switched off (lineage kind :data:`OFF_KIND`: no model to
    validate or export). False when it holds a model, or no artifact is there yet."""
    from distillery.lineage.manifest import read_lineage

    folder = ARTIFACTS / stage
    return (folder / "lineage.json").is_file() and read_lineage(folder).get("kind") == OFF_KIND


VOLATILE_KEYS = ("created", "code", "mlflow", "manifest_sha256")  # facts of one run, not of the artifact's content


def fresh_staging(stage: str) -> Path:
    """An empty ``artifacts/<stage>.tmp/`` (a leftover one is removed first)."""
    tmp = ARTIFACTS / f"{stage}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def keep_only(staging: Path, keep: str) -> bool:
    """Empty the staging folder ``staging`` but for its sub-folder ``keep`` (never through a link); False, nothing
    touched, when there is no such folder to keep."""
    kept = staging / keep
    if not (staging.is_dir() and not staging.is_symlink() and kept.is_dir() and not kept.is_symlink()):
        return False
    for child in staging.iterdir():
        if child.name == keep:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    return True


def resumable_staging(stage: str, keep: str = "data") -> Path:
    """``artifacts/<stage>.tmp/`` keeping a stopped run's ``<keep>/`` folder — the shards a killed ``latents`` or
    ``prompts`` stage finished (each written by rename, its record last: the encoder keeps a shard only where its record
    says these settings and inputs, and redoes the rest) — and removing everything else there; a fresh one otherwise."""
    tmp = ARTIFACTS / f"{stage}.tmp"
    kept = tmp / keep
    if not keep_only(tmp, keep):
        return fresh_staging(stage)
    files = sum(1 for p in kept.rglob("*") if p.is_file())
    log.info("stage %s: %s holds %d file(s) of a stopped run: its finished shards are kept, not encoded again",
             stage, kept, files)
    return tmp


def publish(stage: str, staging: Path) -> Path:
    """Rename the stage's staging folder to ``artifacts/<stage>`` (replacing the previous one), its files
    readable as the umask says (a writer's private 0600 temp files, e.g. safetensors', put right)."""
    follow_umask(staging)
    return replace_dir(staging, ARTIFACTS / stage)


def link_tree(folder: Path, dest: Path) -> None:
    """``folder`` into ``dest`` (in a staging folder) by hard links, a copy across file systems; hidden entries (a killed
    run's temp files) are left out."""
    import os

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(folder, dest, copy_function=link, ignore=shutil.ignore_patterns(".*"))


def write_json_atomic(path: Path, data: Any) -> None:
    """``json.dumps(data, indent=2)`` written to ``path`` atomically (the byte format every record uses)."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str))


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
    from distillery.lineage.contract import LINEAGE_FILE

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


def verify_shipped_chain(stage: str, inputs: list[tuple[str, Path]]) -> dict[str, str]:
    """Read every byte of the stage's input artifacts and of every upstream artifact present, against
    their own manifests (:func:`distillery.lineage.verify.verify_chain`; DVC and the hash cache trust size
    and mtime, this does not), and log what it cost. Returns the manifest digest of each artifact
    checked, by normalised path; a mismatch is a one-line :class:`UserError` and nothing is published."""
    from distillery.common.errors import UserError
    from distillery.lineage.verify import verify_chain

    check = verify_chain([path for _, path in inputs])
    log.info("%s: %s the chain it ships (every byte of %d artifacts, %d files, against their lineage.json; "
             "%d upstream not present): %.1f MiB read in %.2f s", stage, "verified" if check.ok else "checked",
             len(check.digests), check.files, len(check.not_present), check.bytes_read / 2**20, check.seconds)
    if not check.ok:
        more = f" (+{len(check.problems) - 1} more)" if len(check.problems) > 1 else ""
        raise UserError(f"stage {stage}: the chain it ships does not verify: {check.problems[0]}{more}; nothing was "
                        f"published; `distillery lineage {check.failed[0]} --verify --recursive` names every problem; "
                        f"restore it or rerun its stage (dvc repro --force): DVC and the hash cache trust size and "
                        f"mtime, so neither sees this")
    return check.digests


def _embedded_as_verified(stage: str, manifest: dict[str, Any], verified: dict[str, str]) -> None:
    """The input manifests ``write_lineage`` embedded are the ones :func:`verify_shipped_chain` read."""
    import os

    from distillery.common.errors import UserError
    from distillery.lineage.manifest import manifest_digest

    for inp in manifest.get("inputs") or []:
        sub = inp.get("lineage")
        if isinstance(sub, dict) and verified.get(os.path.normpath(inp["path"])) != manifest_digest(sub):
            raise UserError(f"stage {stage}: {inp['path']} changed while the stage ran (its lineage.json is not the one "
                            f"verified); nothing was published; rerun the stage")


def finish(stage: str, staging: Path, *, kind: str, params: StageParams, metrics: dict[str, Any],
           inputs: list[tuple[str, Path]], method: str | None = None, config: dict | None = None,
           mlflow: dict | None = None, volatile: dict[str, Any] | None = None,
           mlflow_files: list[tuple[Path, str]] | None = None, plots: dict[str, Any] | None = None,
           verify_chain: bool = False, launch: dict[str, Any] | None = None,
           weights: dict[str, Any] | None = None, pinned: dict[str, Any] | None = None) -> Path:
    """metrics.json + lineage.json into ``staging``, the MLflow child run (unless the trainer made
    one), then publish ``staging`` as ``artifacts/<stage>``. ``metrics`` must be a function of the
    artifact's content; ``volatile`` numbers (durations) go to MLflow and ``metrics/<stage>.json`` only.
    ``mlflow_files``: ``(file in staging, artifact folder)`` pairs copied into the stage's MLflow run
    (the trainer's run when ``mlflow`` names one). The lineage's ``params`` are the stage's dvc.yaml
    params (:meth:`StageParams.recorded`). ``plots``: ``plots/<name>`` → JSON data, or a ``Path``
    relative to the artifact folder (copied from the published artifact). ``metrics/<stage>.json``
    and the plots are written only after the artifact is published (dvc.yaml keeps them ``persist``):
    a failed stage leaves the last good ones. ``verify_chain`` (the export): every byte of the
    inputs and their upstream artifacts is checked against their manifests first
    (:func:`verify_shipped_chain`). ``launch``: how a training stage ran (launcher, nodes, the Slurm
    job), recorded in the lineage. ``weights``: which weights a training stage's model holds (its own
    or its EMA's, :func:`stages.training.shipped_weights`), recorded in the lineage. ``pinned``: ``{role: files}`` of
    the inputs read from outside ``artifacts/``, as :func:`distillery.lineage.manifest.pin_input` found them before the
    stage read them: an input changed since is one line and nothing is published (its lineage would record bytes the
    stage never read)."""
    from distillery.lineage.manifest import Input, write_lineage
    from distillery.pipeline.publish.mlflow_runs import log_files, log_stage_run, parent_run_id

    verified = verify_shipped_chain(stage, inputs) if verify_chain else None
    write_json_atomic(staging / "metrics.json", metrics)
    read = params.recorded()
    if mlflow is None:
        mlflow = log_stage_run(stage, parent_run_id(params.path.read_text()), read, {**metrics, **(volatile or {})},
                               mlflow_files or ())
    else:
        parent_run_id(params.path.read_text())  # a trainer made the stage's run: the parent run lasts to its end too
        if mlflow_files and mlflow.get("run_id"):
            log_files(mlflow["tracking_uri"], mlflow["run_id"], mlflow_files)
    manifest = write_lineage(staging, kind=kind, stage=stage, method=method, config=config, params=read,
                             inputs=[Input(role, path, (pinned or {}).get(role)) for role, path in inputs], mlflow=mlflow, metrics=metrics,
                             artifact_name=(ARTIFACTS / stage).as_posix(), launch=launch, weights=weights)
    if verified is not None:
        _embedded_as_verified(stage, manifest, verified)
    keep_previous_record(stage, staging)
    artifact = publish(stage, staging)
    Path("metrics").mkdir(exist_ok=True)
    write_json_atomic(Path("metrics") / f"{stage}.json", {**metrics, **(volatile or {})})  # what dvc.yaml declares as metrics
    for name, data in (plots or {}).items():
        Path("plots").mkdir(exist_ok=True)
        if isinstance(data, Path):
            shutil.copy2(artifact / data, Path("plots") / name)
        else:
            write_json_atomic(Path("plots") / name, data)
    return artifact
