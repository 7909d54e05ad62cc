"""The resume key of a training stage: what must be equal for ``runs/<stage>/`` to be resumed.

A training stage keeps its DCP checkpoints in ``runs/<stage>/`` (not a DVC out) so that a killed
stage resumes. Those checkpoints may only be resumed by a run that would have produced them: same
run config (tracking metadata aside), same input artifacts (by content), same code. The key is
written to ``runs/<stage>/resume_key.json`` before training starts; a stage that finds a different
key (or none beside existing checkpoints) discards the folder and starts at step 0, saying which
part differs in one line.

Parts of the key (each a sha256 hex digest):
- ``config``: the run config as YAML-able data, without ``training.tracker`` (MLflow metadata:
  parent run id and tags change with the git commit and do not change the result) and without the
  mesh layout (``training.distributed.replicate_size``, ``sp_size``, ``tp_size``,
  ``models.<role>.distributed``): like the world size, which the config does not hold either, a layout
  only places the same state (a checkpoint holds whole tensors and is resharded on load, docs/gpus.md),
  so a stage moved to more nodes, to HSDP, or to another sequence- or tensor-parallel group resumes;
  and with the *global* batch (``training.data.batch_size`` × the launch's data ranks: its world size
  over ``sp_size × tp_size``) in place of the per-rank one: 1 node × batch 16 and 2 nodes × batch 8
  are the same run (same draws, same losses) and resume each other, while the same per-rank batch on
  more data ranks is another run;
- ``input:<role>``: the content of each input artifact: :func:`distillery.lineage.hashing.tree_digest` of its
  files without its ``lineage.json`` (the ``sha256`` a consumer's lineage records for that input). The
  manifest is left out because it holds facts of one run (times, MLflow run ids, the code commit): an
  older copy of the artifact with the same files resumes instead of retraining from step 0;
- ``code``: the files of the stage's code dependencies as ``dvc.yaml`` lists them (the same set
  whose change makes DVC rerun the stage), or the whole installed package without a ``dvc.yaml``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from distillery.common.fsutil import read_json_file

KEY_FILE = "resume_key.json"


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


LAYOUT_KEYS = ("replicate_size", "sp_size", "tp_size")  # training.distributed's mesh layout: not in the key


def config_digest(raw: dict[str, Any], world_size: int = 1) -> str:
    """Digest of a run config without its tracker section and mesh layout, its per-rank batch as the
    global batch of the data ranks of ``world_size`` ranks (canonical JSON; module doc)."""
    training = {k: v for k, v in raw.get("training", {}).items() if k != "tracker"}
    distributed = training.get("distributed") if isinstance(training.get("distributed"), dict) else {}
    groups = 1
    for key in ("sp_size", "tp_size"):  # the ranks of one sample (an SP group) and of one model split (a TP group)
        groups *= distributed.get(key) if isinstance(distributed.get(key), int) and distributed.get(key) > 0 else 1
    data = training.get("data")
    if isinstance(data, dict) and isinstance(data.get("batch_size"), int):
        training["data"] = {**{k: v for k, v in data.items() if k != "batch_size"},
                            "global_batch_size": data["batch_size"] * max(1, world_size // groups)}
    if distributed:
        training["distributed"] = {k: v for k, v in distributed.items() if k not in LAYOUT_KEYS}
    models = {role: {k: v for k, v in entry.items() if k != "distributed"} if isinstance(entry, dict) else entry
              for role, entry in (raw.get("models") or {}).items()}
    canon = json.dumps({**raw, "models": models, "training": training}, sort_keys=True, separators=(",", ":"), default=str)
    return _sha256_text(canon)


def folder_digest(folder: Path) -> str:
    """Content digest of an artifact folder: every file's path, size and sha256, its top-level
    ``lineage.json`` left out (module doc)."""
    from distillery.lineage.contract import LINEAGE_FILE
    from distillery.lineage.hashing import hash_tree, tree_digest

    return tree_digest(hash_tree(folder, exclude=(LINEAGE_FILE,)))


def code_paths(stage: str, dvc_yaml: Path = Path("dvc.yaml")) -> list[Path]:
    """The code files the stage depends on: its ``dvc.yaml`` deps that are not artifacts."""
    if dvc_yaml.is_file():
        from distillery.pipeline.dvcfile import stage_spec

        deps = stage_spec(stage, dvc_yaml.parent).deps
        roots = [Path(d) for d in deps if not d.startswith("artifacts")]
    else:
        import distillery

        roots = [Path(distillery.__file__).parent]
    files: list[Path] = []
    for root in roots:
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            files.extend(p for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts)
    return files


def code_digest(stage: str) -> str:
    h = hashlib.sha256()
    for path in code_paths(stage):
        h.update(path.as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def resume_key(stage: str, raw: dict[str, Any], inputs: dict[str, Path], world_size: int = 1) -> dict[str, str]:
    """``{"config": ..., "input:<role>": ..., "code": ...}`` for a stage about to train on ``world_size`` ranks."""
    key = {"config": config_digest(raw, world_size)}
    for role, folder in sorted(inputs.items()):
        key[f"input:{role}"] = folder_digest(folder)
    key["code"] = code_digest(stage)
    return key


def key_mismatch(saved: dict[str, str] | None, current: dict[str, str]) -> str | None:
    """None when ``saved`` equals ``current``; else a short phrase naming what differs."""
    if saved is None:
        return "no resume key was recorded with its checkpoints"
    changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if not changed:
        return None
    names = {"config": "the run config", "code": "the stage's code"}
    return "changed: " + ", ".join(names.get(k, k.replace("input:", "input ")) for k in changed)


def read_key(run_dir: Path) -> dict[str, str] | None:
    """The key recorded in ``run_dir`` (``None`` when absent, unreadable, not a regular file — a FIFO never
    blocks: :func:`distillery.common.fsutil.read_json_file` — or not a flat object of strings)."""
    try:
        data = read_json_file(run_dir / KEY_FILE, 1 << 20)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and all(isinstance(v, str) for v in data.values()) else None
