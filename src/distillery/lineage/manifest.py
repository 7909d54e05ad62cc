"""Artifact lineage: the ``lineage.json`` manifest every stage writes into its artifact folder.

Contract (DESIGN §2.1)::

    {"artifact", "kind", "created", "stage", "method", "config", "params", "code",
     "inputs", "outputs", "mlflow", "metrics", "manifest_sha256"}   (+ "launch", "weights": a training stage's)

- ``outputs`` is :func:`hash_tree` of the artifact folder: every regular file (relative POSIX
  path, sha256, size in bytes), sorted by path, ``lineage.json`` itself excluded. Hidden files
  count like any other. An artifact holds regular files and folders only: a symlink (to a file
  or a folder) or a special file anywhere in it is refused when writing (:class:`UserError`)
  and reported when verifying; it is never followed.
- each ``inputs`` entry is ``{"role", "path", "sha256", "lineage"}`` where ``sha256`` is
  :func:`tree_digest` of the input's files and ``lineage`` is the input's own manifest embedded
  whole (recursively embedding its inputs), so an export alone answers the whole chain. An input
  without a ``lineage.json`` (an external base model) gets ``"lineage": null`` and a ``"files"``
  list so it is still pinned file by file (an external input's symlinks are followed and hashed
  by content, e.g. a Hugging Face cache snapshot).
- ``manifest_sha256`` seals the manifest: :func:`manifest_digest`, the sha256 of the canonical
  JSON of every other key. Embedded input manifests are part of that content and carry their own
  seal, so the digests chain: the export's digest pins every manifest upstream of it.

Trust model of :func:`verify_lineage` (``distillery lineage --verify``):

- offline and path-independent: it rehashes the artifact's own files by relative path, recomputes
  the manifest digest, and checks embedded input manifests for internal consistency (recorded
  files digest and seal); a copy of the folder on another machine verifies the same.
- the seal catches any edit of the manifest that does not also recompute the digest (changed
  params, a file's hash edited to match a changed file, an entry deleted with its file). It holds
  no secret: someone who edits files AND rewrites the manifest consistently, seal included,
  passes the self-check. That is caught only against a value recorded elsewhere: ``expect`` (the
  manifest digest published with the artifact, or the one embedded in a downstream manifest) or
  ``dvc_lock`` (the DVC directory hash that ``dvc repro`` recorded for the artifact folder,
  ``lineage.json`` included).
- ``recursive`` also checks each upstream input found at its recorded path (relative to the
  current directory) against its own manifest, and that manifest against the one embedded here.
- manifests written before the seal existed verify with a warning (``unsealed``), and never
  satisfy ``expect``.
- an artifact carries no code: a code file (:data:`CODE_SUFFIXES`: Python source, bytecode,
  native modules) anywhere in it is ``refused`` — but an export's own modules (:data:`EXPORT_OWN_CODE`
  at its top level, each with the sha256 the export stage recorded in the manifest's
  ``config.shipped_code``; one missing from that record, or of another digest, is refused) —, and so is
  a ``model_index.json`` entry naming a module outside diffusers/transformers (diffusers would
  import it from the folder under ``trust_remote_code``) — but an export's top-level ``_class_name``
  :data:`EXPORT_PIPELINE_CLASS`, its own pipeline (allowed only where ``pipeline.py`` is recorded).

:func:`verify_chain` (the export stage, before it publishes) reads every byte of its input
artifacts and of every upstream artifact present, against their own manifests and the embedded
ones: the stages' hash cache, like DVC, trusts size and mtime, and this does not.

Stdlib (+ PyYAML to read a dvc.lock) only: the training library and the stages both call it; it
never imports DVC or Prefect.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import re
import stat
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.common.fsutil import file_kind
from distillery.common.hashcache import file_sha256, flush_active, read_sha256
from distillery.common.treeutil import flatten

logger = logging.getLogger("distillery")

LINEAGE_FILE = "lineage.json"
MANIFEST_KEYS = ("artifact", "kind", "created", "stage", "method", "config", "params", "code",
                 "inputs", "outputs", "mlflow", "metrics")
DIGEST_KEY = "manifest_sha256"  # the manifest's seal: manifest_digest() of every other key
_REQUIRED_KEYS = ("artifact", "kind", "stage", "inputs", "outputs")
_CHUNK = 1 << 20  # bytes read per hashing step
_TMP_PREFIX = f".{LINEAGE_FILE}.tmp-"  # write_lineage's own in-flight temp file (top level only)
_SHOWN = 120  # characters of a user value echoed in a message
MAX_MANIFEST_DEPTH = 100  # JSON nesting of a lineage.json (a whole export chain: ~30); deeper is refused, unread
_MAX_LOCK_DEPTH = 64  # YAML nesting of a dvc.lock / .dvc file (real ones: ~6)
# files an artifact never carries: Python source, bytecode and native modules, which a loader could import
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".pyw", ".pyx", ".so", ".dylib", ".dll")
# the code files an export ships (its pipeline and the modules it imports: distillery.export.code.SHIPPED_MODULES),
# each allowed only with the digest recorded under config.shipped_code of the export's manifest
EXPORT_OWN_CODE = ("pipeline.py", "distilled_schedule.py", "distilled_samplers.py", "distilled_wan.py", "distilled_causal.py",
                   "distilled_fast.py", "vae_decode.py", "vae_kernels.py")
EXPORT_CODE_RECORD = "shipped_code"
# the _class_name an export's top-level model_index.json may give as [module, class]: its own recorded pipeline.py
# (distillery.export.code.OWN_PIPELINE: diffusers then loads that class, never a plain WanPipeline)
EXPORT_PIPELINE_CLASS = ("pipeline", "DistilledWanPipeline")
MODEL_LIBRARIES = ("diffusers", "transformers")  # the libraries a model_index.json component may come from
_INDEX_FILE = "model_index.json"


@dataclasses.dataclass(frozen=True)
class Input:
    """One input artifact of a stage: its role in the stage (``data``, ``student_init``,
    ``teacher``, ``base``, ...) and its folder (or single file)."""

    role: str  # what the stage uses it for
    path: str | Path  # the input folder as the stage saw it (recorded as given)


@dataclasses.dataclass
class VerifyResult:
    """Outcome of :func:`verify_lineage`: ``ok`` iff ``problems`` is empty."""

    ok: bool  # no problem found
    problems: list[str]  # one readable line per problem, naming the file by relative path
    files: int = 0  # output files recorded in the manifest (each rehashed)
    manifest_digest: str = ""  # manifest_digest() of lineage.json as it is now
    sealed: bool = False  # the manifest records its own digest (manifest_sha256)
    notes: list[str] = dataclasses.field(default_factory=list)  # informational lines and warnings
    bytes_read: int = 0  # bytes of the artifact's own files read to rehash them


def _cut(value: Any, limit: int = _SHOWN) -> str:
    """``value`` as text, cut to ``limit`` characters for a readable message."""
    s = str(value)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def is_code_file(name: str) -> bool:
    """Whether a file named ``name`` (a path's last part) is code a loader could import
    (:data:`CODE_SUFFIXES`): an artifact carries none, an export only its own modules (:data:`EXPORT_OWN_CODE`)."""
    return name.lower().endswith(CODE_SUFFIXES)


# ---------------------------------------------------------------------------------------------
# hashing


def hash_file(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes, read in 1 MiB chunks (constant memory); never cached."""
    return read_sha256(path)


@dataclasses.dataclass
class _Listing:
    """What :func:`_scan` found under a folder."""

    files: dict[str, Path]  # relative POSIX path -> path of each regular file
    refused: list[tuple[str, str]]  # (relative path, why) of each symlink / special file, not followed


def _real(path: str | Path) -> Path:
    """``path`` with every symbolic link resolved, never raising on a loop (``Path.resolve`` raises
    ``RuntimeError``; a loop stays unresolved here and is refused by the caller as a link it cannot follow)."""
    return Path(os.path.realpath(path))


def _scan(folder: Path, exclude: Iterable[str] = (), *, follow_links: bool = False) -> _Listing:
    """Every entry under ``folder``.

    Regular files are listed by relative POSIX path (hidden ones included); ``exclude`` names are
    skipped at the top level only, and only when they are regular files. By default a symlink (to
    a file or a folder) is ``refused`` and never followed; special files (FIFOs, sockets,
    devices) always are. ``follow_links`` (external inputs only, e.g. a Hugging Face cache
    snapshot) lists a linked file as that file and enters a linked folder, refusing a link that
    leads back into its own ancestors (a loop) or nowhere.
    """
    excluded = set(exclude)
    listing = _Listing({}, [])
    stack: list[tuple[str, Path, tuple[Path, ...]]] = [("", folder, (_real(folder),) if follow_links else ())]
    while stack:
        rel_dir, here, ancestors = stack.pop()
        try:
            with os.scandir(here) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            listing.refused.append((rel_dir.rstrip("/") or ".", f"unreadable folder: {exc.strerror or exc}"))
            continue
        for e in entries:
            rel = rel_dir + e.name
            if e.is_symlink():
                if follow_links and os.path.isfile(e.path):
                    listing.files[rel] = Path(e.path)
                    continue
                real = _real(e.path) if follow_links else None
                if real is not None and os.path.isdir(e.path) and real not in ancestors:
                    stack.append((rel + "/", Path(e.path), (*ancestors, real)))
                    continue
                try:
                    target = os.readlink(e.path)
                except OSError:
                    target = "?"
                loop = "; a loop" if real is not None and real in ancestors else ""
                listing.refused.append((rel, f"symlink -> {_cut(target, 60)}{loop}"))
            elif e.is_dir(follow_symlinks=False):
                real = (_real(e.path),) if follow_links else ()
                stack.append((rel + "/", Path(e.path), (*ancestors, *real)))
            elif e.is_file(follow_symlinks=False):
                if not (rel_dir == "" and e.name in excluded):
                    listing.files[rel] = Path(e.path)
            else:
                listing.refused.append((rel, "not a regular file"))
    listing.refused.sort()
    return listing


def _entry(rel: str, path: Path) -> dict[str, Any]:
    """One ``hash_tree`` entry; the digest comes from the stage's hash cache when the file is
    unchanged since it was last hashed (:mod:`distillery.common.hashcache`; verification never uses it)."""
    return {"path": rel, "sha256": file_sha256(path), "bytes": path.stat().st_size}


def hash_tree(folder: str | Path, exclude: Sequence[str] = (LINEAGE_FILE,), *,
              follow_symlinks: bool = False) -> list[dict[str, Any]]:
    """``[{"path", "sha256", "bytes"}]`` for every regular file under ``folder``, sorted by path.

    ``path`` is relative to ``folder`` in POSIX form; names in ``exclude`` are skipped at the top
    level only; every other file counts, hidden ones included. Raises :class:`UserError` if
    ``folder`` is not a directory, holds a symlink or a special file, or a file cannot be read.
    ``follow_symlinks`` (for external inputs only) hashes linked files by content and enters
    linked folders instead; a link loop or a dangling link is still an error.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"not a folder: {_cut(folder)}")
    listing = _scan(folder, exclude, follow_links=follow_symlinks)
    if listing.refused:
        rel, why = listing.refused[0]
        count = len(listing.refused)
        raise UserError(f"{_cut(folder)} holds {_cut(rel)} ({why}): refused, an artifact holds regular files and "
                        f"folders only; copy the real file in ({count} such entr{'y' if count == 1 else 'ies'})")
    try:
        entries = [_entry(rel, listing.files[rel]) for rel in sorted(listing.files)]
    except OSError as exc:
        raise UserError(f"cannot read a file under {_cut(folder)}: {_cut(exc)}") from None
    flush_active()
    return entries


def tree_digest(entries: Iterable[Mapping[str, Any]]) -> str:
    """sha256 hex of the canonical JSON of a file list (``path``/``sha256``/``bytes`` per entry,
    sorted by path): one digest that pins a whole folder."""
    canon = sorted(({"path": e.get("path"), "sha256": e.get("sha256"), "bytes": e.get("bytes")}
                    for e in entries), key=lambda e: str(e["path"]))
    text = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


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


def _seal_problem(manifest: Mapping[str, Any]) -> str | None:
    """Why a sealed manifest's recorded digest does not match its content (None if it does or if
    the manifest is unsealed)."""
    if DIGEST_KEY not in manifest:
        return None
    recorded, actual = manifest.get(DIGEST_KEY), manifest_digest(manifest)
    if recorded == actual:
        return None
    return (f"manifest digest mismatch: its content hashes to {actual[:12]}… but it records "
            f"{str(recorded)[:12]}… (edited after it was written)")


def _compare(recorded: Sequence[Any], actual: Sequence[Mapping[str, Any]], refused: Iterable[str] = ()) -> list[str]:
    """Problems between a recorded file list and a freshly hashed one: changed, missing,
    unexpected (new) files, and malformed recorded entries; sorted by path within each kind. A
    recorded path at or under a ``refused`` entry (already reported) is not reported missing."""
    problems: list[str] = []
    rec: dict[str, Mapping[str, Any]] = {}
    for i, e in enumerate(recorded):
        if not (isinstance(e, Mapping) and isinstance(e.get("path"), str) and isinstance(e.get("sha256"), str)):
            problems.append(f"malformed outputs entry #{i}: {_cut(repr(e))}")
            continue
        rec[e["path"]] = e
    act = {e["path"]: e for e in actual}
    shadowed = tuple(refused)
    for rel in sorted(rec):
        r = rec[rel]
        a = act.get(rel)
        if a is None:
            if not any(rel == s or rel.startswith(s + "/") for s in shadowed):
                problems.append(f"missing: {_cut(rel)}")
        elif a["sha256"] != r["sha256"]:
            size = "" if r.get("bytes") in (None, a["bytes"]) else f"; {a['bytes']} bytes != recorded {r['bytes']}"
            problems.append(f"changed: {_cut(rel)} (sha256 {a['sha256'][:12]}… != recorded "
                            f"{str(r['sha256'])[:12]}…{size})")
    for rel in sorted(set(act) - set(rec)):
        problems.append(f"unexpected: {_cut(rel)} (new file, not in the recorded outputs)")
    return problems


# ---------------------------------------------------------------------------------------------
# writing


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
    if path.is_file():
        files = [{"path": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size}]
        flush_active()
        return {"role": inp.role, "path": shown, "sha256": tree_digest(files), "lineage": None, "files": files}
    if not path.is_dir():
        raise UserError(f"input '{_cut(inp.role, 40)}' not found: {_cut(path)} (run the stage that produces it first)")
    if not (path / LINEAGE_FILE).is_file():
        files = hash_tree(path, follow_symlinks=True)
        return {"role": inp.role, "path": shown, "sha256": tree_digest(files), "lineage": None, "files": files}
    manifest = read_lineage(path)
    files = hash_tree(path)
    problems = [p for p in [_seal_problem(manifest)] if p] + _compare(manifest.get("outputs") or [], files)
    if problems:
        raise UserError(f"input '{_cut(inp.role, 40)}' at {_cut(path)} no longer matches its lineage.json "
                        f"({len(problems)} problem(s), first: {problems[0]}); "
                        f"check it with `distillery lineage {_cut(path)} --verify` and rerun its stage")
    return {"role": inp.role, "path": shown, "sha256": tree_digest(files), "lineage": manifest}


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
    node, world size, the Slurm job id) is recorded under ``launch`` when given, and ``weights`` (a
    trained model's: its own weights or its EMA's, with decay and start step) under ``weights``. Returns the manifest
    exactly as written (read back).
    """
    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise UserError(f"artifact folder not found: {_cut(folder)}")
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
    too_deep = (f"{_cut(p)} is nested deeper than {MAX_MANIFEST_DEPTH} levels: not a lineage manifest (a whole "
                f"export chain is ~30); rerun the stage that wrote it")
    try:
        manifest = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{p} is not valid JSON ({exc}); rerun the stage that wrote it") from None
    except RecursionError:  # nested deeper than the JSON parser goes
        raise UserError(too_deep) from None
    except OSError as exc:
        raise UserError(f"cannot read {_cut(p)}: {exc.strerror or exc}") from None
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


def _shape_problem(m: Any, where: str) -> str | None:
    """Why one manifest node (not its embedded inputs) cannot be shown as a tree node, or None."""
    if not isinstance(m, Mapping):
        return f"{where or 'the manifest'}: expected an object, got {_cut(json.dumps(m, default=str), 40)}"
    at = f"{where}." if where else ""

    def got(key: str) -> str:
        return _cut(json.dumps(m.get(key), default=str), 40)

    outputs = m.get("outputs")
    if outputs is not None and not (isinstance(outputs, list) and all(_is_file_entry(e) for e in outputs)):
        return f"{at}outputs: expected a list of {{path, sha256, bytes}} entries, got {got('outputs')}"
    inputs = m.get("inputs")
    if inputs is not None and not (isinstance(inputs, list) and all(isinstance(i, Mapping) for i in inputs)):
        return f"{at}inputs: expected a list of input entries, got {got('inputs')}"
    for i, inp in enumerate(inputs or []):
        files = inp.get("files")
        if files is not None and not (isinstance(files, list) and all(_is_file_entry(e) for e in files)):
            return f"{at}inputs[{i}].files: expected a list of {{path, sha256, bytes}} entries, got {_cut(json.dumps(files, default=str), 40)}"
        if inp.get("lineage") is not None and not isinstance(inp.get("lineage"), Mapping):
            return f"{at}inputs[{i}].lineage: expected an object or null, got {_cut(json.dumps(inp.get('lineage'), default=str), 40)}"
    for key in ("code", "mlflow"):
        if m.get(key) is not None and not isinstance(m.get(key), Mapping):
            return f"{at}{key}: expected an object or null, got {got(key)}"
    commit = (m.get("code") or {}).get("git_commit")
    if commit is not None and not isinstance(commit, str):
        return f"{at}code.git_commit: expected a string or null, got {_cut(json.dumps(commit, default=str), 40)}"
    return None


def _is_file_entry(e: Any) -> bool:
    size = e.get("bytes") if isinstance(e, Mapping) else None
    return isinstance(e, Mapping) and (size is None or (isinstance(size, int) and not isinstance(size, bool)))


def manifest_shape_problem(manifest: Any) -> str | None:
    """Why ``manifest`` (and each manifest embedded in it) is not shaped as :func:`write_lineage`
    writes it, as far as :func:`lineage_tree` reads it (``outputs``/``files`` lists of file entries,
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


def _fmt_value(v: Any, limit: int = 32) -> str:
    if isinstance(v, float):
        s = f"{v:.4g}"
    elif isinstance(v, str):
        s = v
    else:
        s = json.dumps(v, default=str, ensure_ascii=False)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _fmt_pairs(d: Any, limit: int) -> str | None:
    pairs = list(flatten(d).items())
    if not pairs:
        return None
    shown = ", ".join(f"{k}={_fmt_value(v)}" for k, v in pairs[:limit])
    return shown + (f", … (+{len(pairs) - limit} more)" if len(pairs) > limit else "")


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _fmt_files(entries: Sequence[Mapping[str, Any]]) -> str:
    total = sum(int(e.get("bytes") or 0) for e in entries)
    return f"{len(entries)} file(s), {_fmt_bytes(total)}, sha256 {tree_digest(entries)[:12]}"


def _node_lines(m: Mapping[str, Any]) -> list[str]:
    """Detail lines of one artifact node (the header is printed by the caller)."""
    lines = []
    method = m.get("method")
    lines.append(f"method: {str(method).rsplit('.', 1)[-1] if method else '-'}   created: {m.get('created') or '-'}")
    params = _fmt_pairs(m.get("params"), 8)
    if params:
        lines.append(f"params: {params}")
    lines.append(f"outputs: {_fmt_files(m.get('outputs') or [])}")
    code = m.get("code") or {}
    commit = code.get("git_commit")
    dirty = code.get("dirty")
    state = "" if dirty is None else (" (dirty)" if dirty else " (clean)")
    version = f"   distillery {code['package_version']}" if code.get("package_version") else ""
    exp = code.get("experiment") if isinstance(code.get("experiment"), Mapping) else {}
    baseline = f" from {str(exp['baseline'])[:10]}" if exp.get("baseline") else ""
    named = f"   dvc experiment {_cut(exp['name'], 60)}{baseline}" if exp.get("name") else ""
    lines.append(f"code: {commit[:10] if commit else 'no git commit'}{state}{version}{named}")
    ml = m.get("mlflow") or {}
    if ml.get("run_id"):
        exp = f" (experiment {ml['experiment']})" if ml.get("experiment") else ""
        lines.append(f"mlflow: run {ml['run_id']}{exp}")
    metrics = _fmt_pairs(m.get("metrics"), 5)
    if metrics:
        lines.append(f"metrics: {metrics}")
    return lines


SHOWN_ABOVE = "(shown above)"  # a repeated input's one line in lineage_tree


def _render(m: Mapping[str, Any], head: str, first: str, rest: str, out: list[str], seen: set[tuple]) -> None:
    out.append(f"{first}{head}{m.get('stage')} [{m.get('kind')}]  {m.get('artifact')}")
    inputs = [i for i in (m.get("inputs") or []) if isinstance(i, Mapping)]
    bar = "│  " if inputs else "   "
    out.extend(f"{rest}{bar}{line}".rstrip() for line in _node_lines(m))
    for k, inp in enumerate(inputs):
        last = k == len(inputs) - 1
        child_first = rest + ("└─ " if last else "├─ ")
        child_rest = rest + ("   " if last else "│  ")
        role = f"{inp.get('role')}: "
        sub = inp.get("lineage")
        digest = str(inp.get("sha256") or "?")
        key = ("artifact", str(sub.get(DIGEST_KEY) or digest)) if isinstance(sub, Mapping) else ("external", digest)
        if key in seen:  # the same artifact (same sealed manifest, or the same external files) once more
            what = f"{sub.get('stage')} [{sub.get('kind')}]  {sub.get('artifact')}" if isinstance(sub, Mapping) \
                else f"{inp.get('path')}  (external)"
            out.append(f"{child_first}{role}{what}  {SHOWN_ABOVE}  sha256 {digest[:12]}")
            continue
        seen.add(key)
        if isinstance(sub, Mapping):
            _render(sub, role, child_first, child_rest, out, seen)
        else:
            files = inp.get("files") or []
            out.append(f"{child_first}{role}{inp.get('path')}  (external, no lineage)  "
                       f"{len(files)} file(s), {_fmt_bytes(sum(int(e.get('bytes') or 0) for e in files))}, "
                       f"sha256 {digest[:12]}")


def artifacts_once(manifest: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The artifact and every embedded input artifact, each once (by sealed manifest digest, as
    :func:`lineage_tree` counts them), depth first in input order."""
    seen: set[Any] = set()
    out: list[Mapping[str, Any]] = []

    def walk(m: Mapping[str, Any]) -> None:
        key = str(m.get(DIGEST_KEY) or id(m))
        if key in seen:
            return
        seen.add(key)
        out.append(m)
        for inp in m.get("inputs") or []:
            if isinstance(inp, Mapping) and isinstance(inp.get("lineage"), Mapping):
                walk(inp["lineage"])

    walk(manifest)
    return out


def lineage_tree(manifest: Mapping[str, Any]) -> str:
    """A readable tree of an artifact and, recursively, every embedded input: one node per
    artifact (stage, kind, path, method, created, up to 8 params, output digest, code commit,
    MLflow run, a few metrics); inputs without lineage are leaves with their digest. Each artifact
    is shown in full once, depth first; where the same one is an input again (the base under
    latents, teacher and export; the teacher as a distilled student's teacher and critic) it is one
    line ending in ``(shown above)`` with its digest. A manifest not shaped as a stage writes it
    (:func:`manifest_shape_problem`) is a one-line :class:`UserError` naming the malformed field."""
    problem = manifest_shape_problem(manifest)
    if problem:
        raise UserError(f"malformed lineage manifest: {problem} (`distillery lineage PATH --json` prints it as it is)")
    out: list[str] = []
    _render(manifest, "", "", "", out, set())
    return "\n".join(out)




# ---------------------------------------------------------------------------------------------
# verifying


def _hash_listing(listing: _Listing, *, with_md5: bool) -> tuple[list[dict[str, Any]], dict[str, str], list[str]]:
    """One read of every listed file: (``hash_tree`` entries, relative path -> md5 hex when
    ``with_md5``, relative paths that could not be read)."""
    entries: list[dict[str, Any]] = []
    md5s: dict[str, str] = {}
    unreadable: list[str] = []
    for rel in sorted(listing.files):
        path = listing.files[rel]
        sha = hashlib.sha256()
        md5 = hashlib.md5(usedforsecurity=False) if with_md5 else None
        try:
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    sha.update(chunk)
                    if md5 is not None:
                        md5.update(chunk)
            size = path.stat().st_size
        except OSError:
            unreadable.append(rel)
            continue
        entries.append({"path": rel, "sha256": sha.hexdigest(), "bytes": size})
        if md5 is not None:
            md5s[rel] = md5.hexdigest()
    return entries, md5s, unreadable


def _check_inputs(inputs: Any, chain: str, problems: list[str]) -> None:
    """Internal consistency of embedded input entries, recursively (no input path is opened):
    recorded digest == digest of the recorded file list, and each sealed embedded manifest's
    seal matches its content."""
    if not isinstance(inputs, list):
        problems.append(f"malformed inputs{' of ' + chain if chain else ''}: expected a list")
        return
    for i, inp in enumerate(inputs):
        if not isinstance(inp, Mapping):
            problems.append(f"malformed input #{i}{' of ' + chain if chain else ''}: {_cut(repr(inp))}")
            continue
        name = f"{chain}/{inp.get('role')}" if chain else str(inp.get("role"))
        label = f"input {_cut(name, 60)} ({_cut(inp.get('path'))})"
        sub = inp.get("lineage")
        if isinstance(sub, Mapping):
            entries = sub.get("outputs")
            seal_problem = _seal_problem(sub)
            if seal_problem:
                problems.append(f"{label}: embedded {seal_problem}")
        else:
            entries = inp.get("files")
        if not isinstance(entries, list):
            problems.append(f"{label}: no recorded {'outputs' if isinstance(sub, Mapping) else 'files'} list")
        else:
            digest = tree_digest(e for e in entries if isinstance(e, Mapping))
            if digest != inp.get("sha256"):
                problems.append(f"{label}: recorded sha256 {str(inp.get('sha256'))[:12]}… != digest of its "
                                f"recorded files {digest[:12]}…")
        if isinstance(sub, Mapping):
            _check_inputs(sub.get("inputs", []), name, problems)


def _index_problems(path: Path, own_pipeline: Sequence[str] | None = None) -> list[str]:
    """Entries of a ``model_index.json`` that name code from outside :data:`MODEL_LIBRARIES` —
    which diffusers imports from the folder itself (``["evil_sched", "EvilScheduler"]`` →
    ``<component>/evil_sched.py``; a ``_class_name`` given as ``[module, class]`` → ``<module>.py``) —
    but a ``_class_name`` equal to ``own_pipeline`` (an export's own, recorded pipeline)."""
    try:
        index = json.loads(path.read_text(encoding="utf-8")) if path.stat().st_size <= 1 << 20 else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return ["not readable JSON"]
    if not isinstance(index, dict):
        return ["not a JSON object"]
    problems = []
    if isinstance(index.get("_class_name"), list) and index["_class_name"] != list(own_pipeline or ()):
        problems.append(f"_class_name: {_cut(json.dumps(index['_class_name']), 80)}: a [module, class] pair, which "
                        f"diffusers would import from the folder")
    for key, value in index.items():
        if isinstance(key, str) and not key.startswith("_") and isinstance(value, list) and len(value) == 2 \
                and value[0] is not None and value[0] not in MODEL_LIBRARIES:
            problems.append(f"{_cut(key, 40)}: {_cut(json.dumps(value), 80)} names code from outside "
                            f"{'/'.join(MODEL_LIBRARIES)}, which diffusers would import from the folder")
    return problems


def _shipped_code(manifest: Mapping[str, Any]) -> dict[str, str]:
    """An export's record of the code it wrote: ``config.shipped_code`` (file → sha256), ``{}`` when absent or malformed."""
    config = manifest.get("config")
    record = config.get(EXPORT_CODE_RECORD) if isinstance(config, Mapping) else None
    if not isinstance(record, Mapping):
        return {}
    return {k: v for k, v in record.items() if isinstance(k, str) and isinstance(v, str)}


def _code_problems(listing: _Listing, manifest: Mapping[str, Any], digests: Mapping[str, str]) -> list[str]:
    """Code an artifact carries: every code file (:func:`is_code_file`) but an export's own modules
    (:data:`EXPORT_OWN_CODE`, each recorded in its ``config.shipped_code`` with the sha256 it has now:
    ``digests``, relative path → sha256), and every ``model_index.json`` entry naming code from outside the libraries."""
    export = manifest.get("kind") == "export"
    record = _shipped_code(manifest) if export else {}
    own_pipeline = EXPORT_PIPELINE_CLASS if f"{EXPORT_PIPELINE_CLASS[0]}.py" in record else None
    problems = []
    for rel in sorted(listing.files):
        if not is_code_file(rel.rsplit("/", 1)[-1]):
            continue
        if not export or rel not in EXPORT_OWN_CODE:
            problems.append(f"refused: {_cut(rel)} (a code file: an artifact carries no code"
                            f"{', an export only its own ' + ', '.join(EXPORT_OWN_CODE) if export else ''})")
        elif rel not in record:
            problems.append(f"refused: {_cut(rel)} (code the export's lineage.json does not record in "
                            f"config.{EXPORT_CODE_RECORD}: not written by the export stage)")
        elif digests.get(rel) is not None and digests[rel] != record[rel]:
            problems.append(f"refused: {_cut(rel)} (code of another digest than the export stage recorded in "
                            f"config.{EXPORT_CODE_RECORD})")
    for rel in sorted(listing.files):
        if rel.rsplit("/", 1)[-1] == _INDEX_FILE:
            problems.extend(f"refused: {_cut(rel)}: {q}" for q in
                            _index_problems(listing.files[rel], own_pipeline if rel == _INDEX_FILE else None))
    return problems


@dataclasses.dataclass
class _FolderCheck:
    """An artifact folder checked against its own lineage.json."""

    manifest: dict[str, Any]  # the manifest as read
    result: VerifyResult  # its files, its seal (and embedded inputs when asked)
    md5s: dict[str, str]  # relative path -> md5 of every readable regular file (when asked)


def _check_folder(folder: Path, *, embedded: bool, with_md5: bool = False) -> _FolderCheck:
    """Seal, refused entries (symlinks, special files), then changed / missing / unexpected
    files of ``folder`` against its lineage.json; embedded input manifests when ``embedded``."""
    manifest = read_lineage(folder)
    problems: list[str] = []
    seal_problem = _seal_problem(manifest)
    if seal_problem:
        problems.append(seal_problem)
    listing = _scan(folder, (LINEAGE_FILE,))
    problems.extend(f"refused: {_cut(rel)} ({why}; an artifact holds regular files only, never followed)"
                    for rel, why in listing.refused)
    recorded = manifest.get("outputs")
    if not isinstance(recorded, list):
        problems.append("malformed outputs: expected a list")
        recorded = []
    actual, md5s, unreadable = _hash_listing(listing, with_md5=with_md5)
    problems.extend(_code_problems(listing, manifest, {e["path"]: e["sha256"] for e in actual}))
    problems.extend(f"unreadable: {_cut(rel)}" for rel in unreadable)
    problems.extend(_compare(recorded, actual, [rel for rel, _ in listing.refused] + unreadable))
    if embedded:
        _check_inputs(manifest.get("inputs"), "", problems)
    sealed = DIGEST_KEY in manifest
    notes = [] if sealed else [
        "warning: manifest is unsealed (no manifest_sha256; written before manifests were sealed): its files are "
        "checked, its own content is not; rerun the stage that wrote it to seal it"]
    result = VerifyResult(ok=not problems, problems=problems, files=len(recorded),
                          manifest_digest=manifest_digest(manifest), sealed=sealed, notes=notes,
                          bytes_read=sum(e["bytes"] for e in actual))
    return _FolderCheck(manifest, result, md5s)


def _parse_expect(expect: str) -> str:
    want = str(expect).strip().lower().removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{64}", want):
        raise UserError(f"expected manifest digest '{_cut(expect, 80)}' is not a sha256 hex digest (64 hex "
                        f"characters, as printed after 'manifest digest:' by `distillery lineage PATH --verify`)")
    return want


# -- DVC cross-check ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DvcOut:
    """One folder out as a dvc.lock (or a ``.dvc`` file) records it."""

    stage: str | None  # the dvc.lock stage that wrote it (None in a .dvc file)
    path: str  # as recorded: relative to the folder of the lock file
    md5: str  # DVC 3 directory hash, "<md5 hex>.dir"
    nfiles: int | None  # number of files DVC counted, if recorded


def _dvc_dir_hash(md5s: Mapping[str, str]) -> str:
    listing = [{"md5": md5s[rel], "relpath": rel} for rel in sorted(md5s)]
    text = json.dumps(listing, sort_keys=True)  # DVC's own serialisation: default separators, ASCII escapes
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest() + ".dir"


def dvc_dir_md5(folder: str | Path) -> tuple[str, int]:
    """The DVC 3 directory hash of ``folder`` as it is now, and its number of files.

    DVC records a folder out as ``md5: <hex>.dir`` where ``<hex>`` is the md5 of the JSON list
    ``[{"md5": <file md5>, "relpath": <POSIX path>}, ...]`` sorted by relpath and serialised as
    ``json.dumps(list, sort_keys=True)`` (", " / ": " separators, non-ASCII as \\u escapes).
    Every regular file counts, hidden ones and ``lineage.json`` included; empty folders do not.
    A ``.dvcignore`` is not read (artifact folders must not rely on one). Raises
    :class:`UserError` on a symlink or special file (DVC would follow it; we refuse it).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"not a folder: {_cut(folder)}")
    listing = _scan(folder)
    if listing.refused:
        rel, why = listing.refused[0]
        raise UserError(f"{_cut(folder)} holds {_cut(rel)} ({why}): refused, never followed")
    _, md5s, unreadable = _hash_listing(listing, with_md5=True)
    if unreadable:
        raise UserError(f"cannot read {_cut(folder / unreadable[0])}")
    return _dvc_dir_hash(md5s), len(md5s)


def _load_lock_yaml(text: str, lock: Path) -> Any:
    """A dvc.lock / .dvc file's YAML, its nesting checked on the parser's event stream first (a
    state machine: a 5,000-deep file cannot exhaust the stack) and refused past
    :data:`_MAX_LOCK_DEPTH` levels with a one-line :class:`UserError`."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    depth = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > _MAX_LOCK_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark is not None else "?"
                raise UserError(f"{_cut(lock)}: nested deeper than {_MAX_LOCK_DEPTH} levels (line {line}): not a "
                                f"dvc.lock or .dvc file")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader


def find_dvc_out(lock_path: str | Path, folder: str | Path, recorded_artifact: str | None = None) -> DvcOut:
    """The folder out for ``folder`` in a dvc.lock (``stages: <name>: outs: [...]``) or a ``.dvc``
    file (``outs: [...]``).

    An out matches when its path (relative to the lock file's folder) resolves to ``folder``;
    failing that (a copy of the artifact elsewhere), when it equals ``recorded_artifact`` (the
    manifest's ``artifact`` path). Only DVC 3 entries (``hash: md5``) can be checked. A missing
    or unreadable file, no matching out, a file out or a DVC 2 entry raise :class:`UserError`.
    """
    import posixpath

    import yaml

    lock = Path(lock_path)
    if not lock.is_file():
        raise UserError(f"dvc lock file not found: {_cut(lock)}")
    try:
        data = _load_lock_yaml(lock.read_text(encoding="utf-8"), lock)
    except (yaml.YAMLError, UnicodeDecodeError, OSError, ValueError, TypeError, RecursionError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{_cut(lock)} is not a readable YAML file ({_cut(first, 80)})") from None
    outs: list[tuple[str | None, Mapping[str, Any]]] = []
    if isinstance(data, Mapping) and isinstance(data.get("stages"), Mapping):
        for name, stage in data["stages"].items():
            for out in (stage.get("outs") or []) if isinstance(stage, Mapping) else []:
                if isinstance(out, Mapping) and isinstance(out.get("path"), str):
                    outs.append((str(name), out))
    elif isinstance(data, Mapping) and isinstance(data.get("outs"), list):
        outs = [(None, o) for o in data["outs"] if isinstance(o, Mapping) and isinstance(o.get("path"), str)]
    else:
        raise UserError(f"{_cut(lock)} is neither a dvc.lock (no 'stages') nor a .dvc file (no 'outs')")
    base, target = lock.resolve().parent, Path(folder).resolve()
    match = next(((s, o) for s, o in outs if (base / o["path"]).resolve() == target), None)
    if match is None and recorded_artifact:
        want = posixpath.normpath(recorded_artifact)
        match = next(((s, o) for s, o in outs if posixpath.normpath(o["path"]) == want), None)
    if match is None:
        known = ", ".join(sorted({o["path"] for _, o in outs})) or "none"
        raise UserError(f"{_cut(lock)} records no out for {_cut(folder)} (outs: {_cut(known, 100)})")
    stage, out = match
    md5 = out.get("md5")
    if not (isinstance(md5, str) and md5.endswith(".dir")):
        raise UserError(f"{_cut(lock)}: out {_cut(out['path'])} is not a folder out (md5 {_cut(md5, 40)})")
    if out.get("hash") != "md5":
        raise UserError(f"{_cut(lock)}: out {_cut(out['path'])} carries DVC 2 hashes (md5-dos2unix), which cannot "
                        f"be checked; rerun its stage with DVC 3 to record 'hash: md5'")
    nfiles = out.get("nfiles")
    return DvcOut(stage, out["path"], md5, nfiles if isinstance(nfiles, int) else None)


def _check_dvc(folder: Path, lock: str | Path, check: _FolderCheck, problems: list[str], notes: list[str]) -> None:
    recorded = check.manifest.get("artifact")
    out = find_dvc_out(lock, folder, recorded if isinstance(recorded, str) else None)
    md5s = dict(check.md5s)
    lineage_file = folder / LINEAGE_FILE
    if lineage_file.is_file() and not lineage_file.is_symlink():
        md5s[LINEAGE_FILE] = hashlib.md5(lineage_file.read_bytes(), usedforsecurity=False).hexdigest()
    actual = _dvc_dir_hash(md5s)
    where = f"{_cut(lock)}" + (f" (stage {_cut(out.stage, 40)})" if out.stage else "")
    if actual != out.md5:
        counts = "" if out.nfiles in (None, len(md5s)) else f"; {len(md5s)} files now, {out.nfiles} recorded"
        problems.append(f"dvc: {_cut(folder)} hashes to {actual} but {where} records {out.md5} for "
                        f"{_cut(out.path)}{counts} (changed after DVC recorded it)")
    else:
        notes.append(f"dvc: {_cut(folder)} matches {out.md5} recorded for {_cut(out.path)} in {where}")


# -- upstream inputs present in the workspace ---------------------------------------------------


def _iter_inputs(inputs: Any, chain: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(role chain, entry) of every embedded input, depth first."""
    if not isinstance(inputs, list):
        return
    for inp in inputs:
        if not isinstance(inp, Mapping):
            continue
        name = f"{chain}/{inp.get('role')}" if chain else str(inp.get("role"))
        yield name, inp
        sub = inp.get("lineage")
        if isinstance(sub, Mapping):
            yield from _iter_inputs(sub.get("inputs"), name)


def _outside_tree(p: Path, root: Path) -> bool:
    """Whether ``p``, every link resolved, lies outside the folder ``root`` (resolved)."""
    real = _real(p)
    return real != root and root not in real.parents


def _check_present_input(name: str, inp: Mapping[str, Any], problems: list[str], notes: list[str]) -> None:
    """Check one recorded input where it is — only inside the tree being verified (the current directory):
    a crafted lineage naming ``/``, ``/etc`` or ``/proc/kmsg`` gets a note and nothing is opened; an input
    inside it that is not a folder or a regular file (a FIFO, a device) is a problem, never read."""
    path = str(inp.get("path"))
    label = f"input {_cut(name, 60)} ({_cut(path)})"
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        notes.append(f"{label}: not present, checked from the embedded manifest only")
        return
    root = _real(Path.cwd())
    if _outside_tree(p, root):
        notes.append(f"{label}: outside the tree being verified ({_cut(str(root))}): not opened, checked from the "
                     "embedded manifest only (verify it where it is)")
        return
    try:
        mode = os.stat(p).st_mode
    except OSError as exc:
        problems.append(f"{label}: cannot be read ({exc.strerror or exc}; a symbolic link loop?)")
        return
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        problems.append(f"{label}: is {file_kind(mode)}, not an artifact: not read")
        return
    sub = inp.get("lineage")
    if isinstance(sub, Mapping):
        if not (p / LINEAGE_FILE).is_file():
            problems.append(f"{label}: present but holds no {LINEAGE_FILE}")
            return
        try:
            check = _check_folder(p, embedded=False)
        except UserError as exc:
            problems.append(f"{label}: {exc}")
            return
        res, expected = check.result, manifest_digest(sub)
        problems.extend(f"{label}: {q}" for q in res.problems)
        if res.manifest_digest != expected:
            problems.append(f"{label}: its manifest digest {res.manifest_digest[:12]}… != {expected[:12]}… "
                            f"embedded here (changed or rerun after this artifact was made)")
        elif res.ok:
            notes.append(f"{label}: verified: {res.files} files, manifest matches the embedded one")
        return
    files = inp.get("files")
    if not isinstance(files, list):
        return  # reported by _check_inputs
    if p.is_file():
        listing = _Listing({p.name: p}, [])
    else:
        listing = _scan(p, (LINEAGE_FILE,), follow_links=True)
    actual, _, unreadable = _hash_listing(listing, with_md5=False)
    found = [f"refused: {_cut(rel)} ({why})" for rel, why in listing.refused]
    found += [f"unreadable: {_cut(rel)}" for rel in unreadable]
    found += _compare(files, actual, [rel for rel, _ in listing.refused] + unreadable)
    problems.extend(f"{label}: {q}" for q in found)
    if not found:
        notes.append(f"{label}: verified: {len(files)} files (external, no lineage)")


def _check_upstream(manifest: Mapping[str, Any], problems: list[str], notes: list[str]) -> None:
    """Each embedded input found at its recorded path (relative to the current directory):
    its files against its own manifest and that manifest against the embedded one (external
    inputs: their files against the recorded list). Each (path, embedded content) once."""
    seen: set[tuple[str, str]] = set()
    for name, inp in _iter_inputs(manifest.get("inputs"), ""):
        if not isinstance(inp.get("path"), str) or not inp["path"]:
            continue
        sub = inp.get("lineage")
        key = (inp["path"], manifest_digest(sub) if isinstance(sub, Mapping) else str(inp.get("sha256")))
        if key in seen:
            continue
        seen.add(key)
        _check_present_input(name, inp, problems, notes)


def verify_lineage(artifact_dir: str | Path, *, expect: str | None = None, dvc_lock: str | Path | None = None,
                   recursive: bool = False) -> VerifyResult:
    """Check an artifact folder against its own lineage.json, offline and path-independent.

    Always: recomputes the manifest digest and checks the seal (``manifest_sha256``); reports
    each symlink or special file (``refused``, never followed) and each ``changed``, ``missing``
    or ``unexpected`` file by relative path, hidden files included; checks every embedded input
    manifest for internal consistency (digest of its recorded file list, its seal). An unsealed
    manifest (written before seals) adds a warning note instead of a problem.

    ``expect``: the manifest digest must equal this sha256 hex (an unsealed manifest never
    does). ``dvc_lock``: the DVC 3 directory hash recorded for this folder in that dvc.lock (or
    .dvc file) must match the folder as it is now, ``lineage.json`` included. These two catch
    files and manifest rewritten consistently, which the seal alone cannot (see the module
    docstring). ``recursive``: also check each upstream input present at its recorded path
    (relative to the current directory) against its own manifest, and that manifest's digest
    against the one embedded here; absent inputs get a note. Raises :class:`UserError` if
    there is no readable manifest, ``expect`` is not a digest, or the dvc.lock is unusable.
    """
    want = _parse_expect(expect) if expect is not None else None
    folder = Path(artifact_dir)
    if folder.is_file() and folder.name == LINEAGE_FILE:
        folder = folder.parent
    check = _check_folder(folder, embedded=True, with_md5=dvc_lock is not None)
    res = check.result
    if want is not None:
        if not res.sealed:
            res.problems.append("manifest is unsealed (no manifest_sha256), so it cannot match the expected digest")
        elif res.manifest_digest != want:
            res.problems.append(f"manifest digest {res.manifest_digest[:12]}… != expected {want[:12]}… "
                                f"(not the manifest that was recorded)")
        else:
            res.notes.append("manifest digest matches the expected one")
    if dvc_lock is not None:
        _check_dvc(folder, dvc_lock, check, res.problems, res.notes)
    if recursive:
        _check_upstream(check.manifest, res.problems, res.notes)
    res.ok = not res.problems
    return res


# -- the whole chain, before it ships ---------------------------------------------------------


@dataclasses.dataclass
class ChainCheck:
    """Outcome of :func:`verify_chain`: ``ok`` iff ``problems`` is empty."""

    problems: list[str]  # one line per problem, each naming the artifact by its path
    failed: list[str]  # the path of each artifact with a problem, in the order found
    digests: dict[str, str]  # normalised path of each artifact checked -> its manifest digest
    contents: dict[str, str] = dataclasses.field(default_factory=dict)  # same paths -> tree_digest of its outputs
    files: int = 0  # files rehashed
    bytes_read: int = 0  # bytes read to rehash them
    seconds: float = 0.0  # wall time of the check
    not_present: list[str] = dataclasses.field(default_factory=list)  # upstream artifacts absent here (not read)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_chain(folders: Sequence[str | Path]) -> ChainCheck:
    """Read every byte of each artifact in ``folders`` and of every upstream artifact their
    manifests embed that is present at its recorded path (relative to the current directory), and
    check each against its own lineage.json (seal, files, code files; as ``--verify``, never the
    hash cache), and its recorded files against those of the manifest embedded downstream: an
    upstream artifact whose content is not what its consumer was made from is a problem; one whose
    record alone differs (an older copy of the same bytes: other times and run ids) is not.

    Each artifact folder is read once however often the chain names it (the base under latents,
    teacher and export). Inputs without a lineage (an external base folder, a user's videos) are not
    read: the artifact made from them pins their digest. A listed folder that is absent or holds no
    lineage.json is a problem; an absent upstream one is listed in ``not_present``."""
    import time

    started = time.perf_counter()
    check = ChainCheck(problems=[], failed=[], digests={})

    def fail(path: str, problem: str) -> None:
        check.problems.append(problem)
        if path not in check.failed:
            check.failed.append(path)

    def content(manifest: Mapping[str, Any]) -> str:
        outputs = manifest.get("outputs")
        return tree_digest(e for e in outputs if isinstance(e, Mapping)) if isinstance(outputs, list) else "?"

    queue: list[tuple[str, str, str | None, str]] = [(str(f), os.path.normpath(f), None, "") for f in folders]
    while queue:
        shown, key, expected, made_into = queue.pop(0)
        if key not in check.digests:
            p = Path(key)
            if not (p / LINEAGE_FILE).is_file() or p.is_symlink():
                if expected is None or p.exists() or p.is_symlink():
                    fail(shown, f"{_cut(shown)}: no {LINEAGE_FILE} (not an artifact of this pipeline)")
                elif key not in check.not_present:
                    check.not_present.append(key)
                continue
            try:
                folder = _check_folder(p, embedded=True)
            except UserError as exc:
                fail(shown, f"{_cut(shown)}: {exc}")
                continue
            check.digests[key] = folder.result.manifest_digest
            check.contents[key] = content(folder.manifest)
            check.files += folder.result.files
            check.bytes_read += folder.result.bytes_read
            found = folder.result.problems
            if found:
                more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
                fail(shown, f"{_cut(shown)} does not match its {LINEAGE_FILE}: {found[0]}{more}")
            for inp in folder.manifest.get("inputs") or []:
                if isinstance(inp, Mapping) and isinstance(inp.get("lineage"), Mapping) and isinstance(inp.get("path"), str):
                    queue.append((inp["path"], os.path.normpath(inp["path"]), content(inp["lineage"]), shown))
        if expected is not None and key in check.contents and check.contents[key] != expected:
            fail(shown, f"{_cut(shown)}: its files (sha256 {check.contents[key][:12]}…) are not the ones "
                        f"{_cut(made_into)} was made from ({expected[:12]}…): rerun or replaced after it")
    check.problems = list(dict.fromkeys(check.problems))
    check.seconds = time.perf_counter() - started
    return check
