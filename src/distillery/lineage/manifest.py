"""Artifact lineage: the ``lineage.json`` manifest every stage writes into its artifact folder —
writing it (:func:`write_lineage`), sealing it (:func:`seal`, :func:`manifest_digest`), reading it back
(:func:`read_lineage`) and checking its shape (:func:`manifest_shape_problem`).

Contract (DESIGN §2.1)::

    {"artifact", "kind", "created", "stage", "method", "config", "params", "code",
     "inputs", "outputs", "mlflow", "metrics", "manifest_sha256"}   (+ "launch", "weights": a training stage's)

- ``outputs`` is :func:`~distillery.lineage.hashing.hash_tree` of the artifact folder: every regular
  file (relative POSIX path, sha256, size in bytes), sorted by path, ``lineage.json`` itself excluded.
  Hidden files count like any other. An artifact holds regular files and folders only: a symlink (to a
  file or a folder) or a special file anywhere in it is refused when writing (:class:`UserError`) and
  reported when verifying (:mod:`distillery.lineage.verify`); it is never followed.
- each ``inputs`` entry is ``{"role", "path", "sha256", "lineage"}`` where ``sha256`` is
  :func:`~distillery.lineage.hashing.tree_digest` of the input's files and ``lineage`` is the input's own
  manifest embedded whole (recursively embedding its inputs), so an export alone answers the whole chain.
  An input without a ``lineage.json`` (an external base model) gets ``"lineage": null`` and a ``"files"``
  list so it is still pinned file by file (an external input's symlinks are followed and hashed
  by content, e.g. a Hugging Face cache snapshot).
- ``manifest_sha256`` seals the manifest: :func:`manifest_digest`, the sha256 of the canonical
  JSON of every other key. Embedded input manifests are part of that content and carry their own
  seal, so the digests chain: the export's digest pins every manifest upstream of it.

Stdlib only: the training library and the stages both call it; it never imports DVC or Prefect.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.common.hashcache import file_sha256, flush_active
from distillery.lineage.contract import DIGEST_KEY, LINEAGE_FILE, cut
from distillery.lineage.hashing import compare_files, hash_tree, tree_digest

logger = logging.getLogger("distillery")


MANIFEST_KEYS = ("artifact", "kind", "created", "stage", "method", "config", "params", "code",
                 "inputs", "outputs", "mlflow", "metrics")


_REQUIRED_KEYS = ("artifact", "kind", "stage", "inputs", "outputs")


_TMP_PREFIX = f".{LINEAGE_FILE}.tmp-"  # write_lineage's own in-flight temp file (top level only)


MAX_MANIFEST_DEPTH = 100  # JSON nesting of a lineage.json (a whole export chain: ~30); deeper is refused, unread


@dataclasses.dataclass(frozen=True)
class Input:
    """One input artifact of a stage: its role in the stage (``data``, ``student_init``,
    ``teacher``, ``base``, ...) and its folder (or single file)."""

    role: str  # what the stage uses it for
    path: str | Path  # the input folder as the stage saw it (recorded as given)
    # an input without a lineage.json (read from outside artifacts/): its files as :func:`pin_input` found them before
    # the stage read it; recorded only if they still are (else one line: it changed while the stage read it)
    pinned: tuple[dict[str, Any], ...] | None = None


def _external_files(path: Path) -> list[dict[str, Any]]:
    """``[{path, sha256, bytes}]`` of an input without a lineage.json: one file, or every file of a folder (links
    followed and hashed by content)."""
    if path.is_file():
        files = [{"path": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size}]
        flush_active()
        return files
    return hash_tree(path, follow_symlinks=True)


def pin_input(path: str | Path) -> tuple[dict[str, Any], ...]:
    """The files of an input read from outside ``artifacts/`` (no lineage.json: a prompts file, one's own videos, a
    given model folder) as they are now — taken before the stage reads it, handed to :class:`Input` ``pinned``: the
    lineage then records them only if the input is unchanged when the stage finishes, so the digest it records is
    the one of the bytes that were read. (With the hash cache, the second hash costs a stat per file.)"""
    p = Path(path)
    if not p.exists():
        raise UserError(f"input not found: {cut(p)}")
    return tuple(_external_files(p))


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """The seal of a manifest: sha256 hex of the canonical JSON (sorted keys, no whitespace,
    ASCII escapes) of every key except ``manifest_sha256``.

    Embedded input manifests are hashed as they stand, their own ``manifest_sha256`` included,
    so a digest pins the whole chain. Every field counts (``created``, MLflow ids, ...): the
    digest is as stable as the manifest's content. ``manifest`` must be JSON as read back from a
    lineage.json (string keys, JSON types).
    """
    content = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def seal_problem(manifest: Mapping[str, Any]) -> str | None:
    """Why a sealed manifest's recorded digest does not match its content (None if it does or if
    the manifest is unsealed)."""
    if DIGEST_KEY not in manifest:
        return None
    recorded, actual = manifest.get(DIGEST_KEY), manifest_digest(manifest)
    if recorded == actual:
        return None
    return (f"manifest digest mismatch: its content hashes to {actual[:12]}… but it records "
            f"{str(recorded)[:12]}… (edited after it was written)")


# git pathspecs (from the repository root) that code_info ignores: DVC's bookkeeping, the metric and plot
# copies the stages write for `dvc metrics/plots/exp show` (dvc.yaml, cache: false; committed with dvc.lock), and
# params.yaml: settings, not code (each stage records the values it read under `params`; `dvc exp run -S` edits it)
NOT_CODE = ("**/dvc.lock", ".dvc/**", "metrics/**", "plots/**", "params.yaml")
# what DVC puts in a stage's environment under `dvc exp run`: the experiment's name and the commit it starts from
DVC_EXPERIMENT_ENV = ("DVC_EXP_NAME", "DVC_EXP_BASELINE_REV")


def code_info() -> dict[str, Any]:
    """``{"git_commit", "dirty", "package_version"}`` of the code that runs now (+ ``"experiment"``: ``{"name",
    "baseline"}`` under ``dvc exp run``, from :data:`DVC_EXPERIMENT_ENV`).

    Git is asked about the current working directory (``git rev-parse HEAD``, ``git status
    --porcelain``, without taking git's optional index lock); outside a git checkout, or without
    git, commit and dirty are ``None``. DVC's own bookkeeping — ``dvc.lock`` files, which a
    pipeline run writes itself, the ``.dvc/`` folder and the stages' top-level ``metrics/`` and
    ``plots/`` copies (committed so that ``dvc exp show`` compares experiments) — does not make the tree dirty,
    and neither does ``params.yaml``, whose values the manifest records (:data:`NOT_CODE`): a pristine clone that
    ran ``dvc repro``, or ``dvc exp run -S key=value`` (which edits params.yaml), is clean. The version is
    ``distillery.__version__``.
    """
    from distillery import __version__

    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", *args], capture_output=True, text=True, timeout=60, env=env, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout if res.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = (git("status", "--porcelain", "--", ":/", *(f":(top,exclude,glob){p}" for p in NOT_CODE))
              if commit is not None else None)  # the whole repository, wherever the stage runs
    name, baseline = (os.environ.get(k) or None for k in DVC_EXPERIMENT_ENV)
    return {"git_commit": commit.strip() if commit else None,
            "dirty": None if status is None else bool(status.strip()),
            "package_version": __version__,
            **({"experiment": {"name": name, "baseline": baseline}} if name else {})}


def _display_path(p: str | Path) -> str:
    """POSIX form of ``p`` as given; an absolute path under the working directory is made relative."""
    path = Path(p)
    if path.is_absolute():
        try:
            return path.relative_to(Path.cwd()).as_posix()
        except ValueError:
            pass
    return path.as_posix()


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return obj.item()
    raise TypeError(f"lineage: cannot record a {type(obj).__name__} as JSON: {obj!r}")


def _input_entry(inp: Input) -> dict[str, Any]:
    """``{"role", "path", "sha256", "lineage"[, "files"]}`` for one input; the input's own
    lineage.json is embedded after checking that its seal and its files still match it."""
    path = Path(inp.path)
    shown = _display_path(inp.path)
    if not path.is_file() and not path.is_dir():
        raise UserError(f"input '{cut(inp.role, limit=40)}' not found: {cut(path)} (run the stage that produces it first)")
    if path.is_file() or not (path / LINEAGE_FILE).is_file():
        files = _external_files(path)
        if inp.pinned is not None and list(inp.pinned) != files:
            raise UserError(f"input '{cut(inp.role, limit=40)}' at {cut(path)} changed while the stage read it "
                            f"({_first_change(list(inp.pinned), files)}): what it made is not what that file holds now; "
                            f"nothing was published; run the stage again (dvc repro)")
        return {"role": inp.role, "path": shown, "sha256": tree_digest(files), "lineage": None, "files": files}
    manifest = read_lineage(path)
    files = hash_tree(path)
    problems = [p for p in [seal_problem(manifest)] if p] + compare_files(manifest.get("outputs") or [], files)
    if problems:
        raise UserError(f"input '{cut(inp.role, limit=40)}' at {cut(path)} no longer matches its "
                        "lineage.json "
                        f"({len(problems)} problem(s), first: {problems[0]}); "
                        f"check it with `distillery lineage {cut(path)} --verify` and rerun its stage")
    return {"role": inp.role, "path": shown, "sha256": tree_digest(files), "lineage": manifest}


def _first_change(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """The first file that differs between two ``[{path, sha256, bytes}]`` lists, in words."""
    problems = compare_files(before, after)
    return cut(problems[0], limit=120) if problems else "its files changed"


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def seal(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` as JSON (converted as :func:`write_lineage` does) with ``manifest_sha256`` set
    to the digest of everything else, as the last key."""
    content = json.loads(json.dumps({k: v for k, v in manifest.items() if k != DIGEST_KEY}, default=_json_default))
    return {**content, DIGEST_KEY: manifest_digest(content)}


def write_lineage(
    artifact_dir: str | Path,
    *,
    kind: str,
    stage: str,
    method: str | None = None,
    config: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    inputs: Sequence[Input] = (),
    mlflow: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    artifact_name: str | None = None,
    launch: Mapping[str, Any] | None = None,
    weights: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the DESIGN §2.1 manifest of a finished artifact folder, seal it
    (``manifest_sha256``) and write it as ``artifact_dir/lineage.json`` atomically (hidden temp
    file + ``os.replace``).

    Call it last, after every payload file is in place: ``outputs`` hashes the folder as it is
    now, every file counted (stale temp files of an earlier, killed lineage write are removed
    first). A symlink or special file in the folder raises :class:`UserError`. Each input is
    hashed and its own lineage.json embedded; an input whose files or seal no longer match its
    lineage.json, or a missing input, raises :class:`UserError` and nothing is written.
    ``config``/``params``/``metrics`` must be JSON-serialisable (dataclasses, paths, enums and
    numpy/torch scalars are converted). ``artifact_name`` is the path recorded as ``artifact``
    (default: ``artifact_dir`` as given): a stage that writes into a staging folder and renames it
    afterwards names the final place. ``launch`` (a training stage's: launcher, nodes, processes per
    node, world size, the Slurm job id, the HSDP / SP / TP layout) is recorded under ``launch`` when given, and ``weights`` (a
    trained model's: its own weights or its EMA's, with decay and start step) under ``weights``. Returns the manifest
    exactly as written (read back).
    """
    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise UserError(f"artifact folder not found: {cut(folder)}")
    for stale in folder.glob(f"{_TMP_PREFIX}*"):
        if stale.is_file() and not stale.is_symlink():
            stale.unlink()
    manifest = seal({
        "artifact": artifact_name if artifact_name is not None else _display_path(artifact_dir),
        "kind": kind,
        "created": _utc_now(),
        "stage": stage,
        "method": method,
        "config": config,
        "params": params,
        "code": code_info(),
        "inputs": [_input_entry(i) for i in inputs],
        "outputs": hash_tree(folder),
        "mlflow": mlflow,
        "metrics": metrics,
        **({"launch": dict(launch)} if launch is not None else {}),
        **({"weights": dict(weights)} if weights is not None else {}),
    })
    text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=_TMP_PREFIX)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / LINEAGE_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info("wrote %s: %d output file(s), %d input(s), manifest digest %s", folder / LINEAGE_FILE,
                len(manifest["outputs"]), len(manifest["inputs"]), manifest[DIGEST_KEY])
    return json.loads(text)

# ---------------------------------------------------------------------------------------------
# reading


def _manifest_path(path: str | Path) -> Path:
    p = Path(path)
    return p / LINEAGE_FILE if p.is_dir() else p


def read_lineage(path: str | Path) -> dict[str, Any]:
    """The manifest of an artifact; ``path`` is the artifact folder or its lineage.json.
    Raises :class:`UserError` if the file is missing, not JSON, or lacks the required keys."""
    p = _manifest_path(path)
    if not p.is_file():
        raise UserError(f"no {LINEAGE_FILE} at {p}: is {path} an artifact folder written by a distillery stage?")
    too_deep = (f"{cut(p)} is nested deeper than {MAX_MANIFEST_DEPTH} levels: not a lineage manifest (a whole "
                f"export chain is ~30); rerun the stage that wrote it")
    try:
        manifest = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{p} is not valid JSON ({exc}); rerun the stage that wrote it") from None
    except RecursionError:  # nested deeper than the JSON parser goes
        raise UserError(too_deep) from None
    except OSError as exc:
        raise UserError(f"cannot read {cut(p)}: {exc.strerror or exc}") from None
    if _deeper_than(manifest, MAX_MANIFEST_DEPTH):
        raise UserError(too_deep)
    if not isinstance(manifest, dict):
        raise UserError(f"{p} is not a lineage manifest (expected a JSON object)")
    missing = [k for k in _REQUIRED_KEYS if k not in manifest]
    if missing:
        raise UserError(f"{p} is not a lineage manifest: missing key(s) {', '.join(missing)} "
                        f"(expected {', '.join(MANIFEST_KEYS)})")
    return manifest


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON ``value`` nests lists/objects more than ``limit`` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _shown(value: Any) -> str:
    """A manifest value as a shape problem shows it: its JSON, cut short."""
    return cut(json.dumps(value, default=str), limit=40)


def _shape_problem(m: Any, where: str) -> str | None:
    """Why one manifest node (not its embedded inputs) cannot be shown as a tree node, or None."""
    if not isinstance(m, Mapping):
        return f"{where or 'the manifest'}: expected an object, got {_shown(m)}"
    at = f"{where}." if where else ""

    def got(key: str) -> str:
        return _shown(m.get(key))

    outputs = m.get("outputs")
    if outputs is not None and not (isinstance(outputs, list) and all(_is_file_entry(e) for e in outputs)):
        return f"{at}outputs: expected a list of {{path, sha256, bytes}} entries, got {got('outputs')}"
    inputs = m.get("inputs")
    if inputs is not None and not (isinstance(inputs, list) and all(isinstance(i, Mapping) for i in inputs)):
        return f"{at}inputs: expected a list of input entries, got {got('inputs')}"
    for i, inp in enumerate(inputs or []):
        files = inp.get("files")
        if files is not None and not (isinstance(files, list) and all(_is_file_entry(e) for e in files)):
            return f"{at}inputs[{i}].files: expected a list of {{path, sha256, bytes}} entries, got " \
                   f"{_shown(files)}"
        if inp.get("lineage") is not None and not isinstance(inp.get("lineage"), Mapping):
            return f"{at}inputs[{i}].lineage: expected an object or null, got {_shown(inp.get('lineage'))}"
    for key in ("code", "mlflow"):
        if m.get(key) is not None and not isinstance(m.get(key), Mapping):
            return f"{at}{key}: expected an object or null, got {got(key)}"
    commit = (m.get("code") or {}).get("git_commit")
    if commit is not None and not isinstance(commit, str):
        return f"{at}code.git_commit: expected a string or null, got {_shown(commit)}"
    return None


def _is_file_entry(e: Any) -> bool:
    size = e.get("bytes") if isinstance(e, Mapping) else None
    return isinstance(e, Mapping) and (size is None or (isinstance(size, int) and not isinstance(size, bool)))


def manifest_shape_problem(manifest: Any) -> str | None:
    """Why ``manifest`` (and each manifest embedded in it) is not shaped as :func:`write_lineage`
    writes it, as far as :func:`~distillery.lineage.render.lineage_tree` reads it (``outputs``/``files`` lists of file entries,
    ``inputs`` a list of objects, ``code``/``mlflow`` objects); None when it is. Walked without
    recursion; names the first problem by its path (``inputs[0].lineage.outputs``)."""
    stack: list[tuple[Any, str]] = [(manifest, "")]
    while stack:
        node, where = stack.pop()
        problem = _shape_problem(node, where)
        if problem:
            return problem
        for i, inp in reversed(list(enumerate(node.get("inputs") or []))):
            if isinstance(inp.get("lineage"), Mapping):
                stack.append((inp["lineage"], f"{where + '.' if where else ''}inputs[{i}].lineage"))
    return None
