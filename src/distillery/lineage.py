"""Artifact lineage: the ``lineage.json`` manifest every stage writes into its artifact folder.

Contract (DESIGN §2.1)::

    {"artifact", "kind", "created", "stage", "method", "config", "params", "code",
     "inputs", "outputs", "mlflow", "metrics"}

- ``outputs`` is :func:`hash_tree` of the artifact folder: every regular file (relative POSIX
  path, sha256, size in bytes), sorted by path, ``lineage.json`` itself excluded.
- each ``inputs`` entry is ``{"role", "path", "sha256", "lineage"}`` where ``sha256`` is
  :func:`tree_digest` of the input's files and ``lineage`` is the input's own manifest embedded
  whole (recursively embedding its inputs), so an export alone answers the whole chain. An input
  without a ``lineage.json`` (an external base model) gets ``"lineage": null`` and a ``"files"``
  list so it is still pinned file by file.
- :func:`verify_lineage` needs only the artifact folder: it rehashes the artifact's own files by
  relative path and checks embedded input manifests for internal consistency (recorded digest ==
  digest of the recorded file list); it never opens the original input paths, so a copy of the
  folder on another machine verifies the same.

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
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from distillery.errors import UserError

logger = logging.getLogger("distillery")

LINEAGE_FILE = "lineage.json"
MANIFEST_KEYS = ("artifact", "kind", "created", "stage", "method", "config", "params", "code",
                 "inputs", "outputs", "mlflow", "metrics")
_REQUIRED_KEYS = ("artifact", "kind", "stage", "inputs", "outputs")
_CHUNK = 1 << 20  # bytes read per hashing step
_TMP_MARK = ".tmp"  # hidden temp files look like ".<name>.tmp..." and are never hashed


@dataclasses.dataclass(frozen=True)
class Input:
    """One input artifact of a stage: its role in the stage (``data``, ``student_init``,
    ``teacher``, ``base``, ...) and its folder (or single file)."""

    role: str  # what the stage uses it for
    path: str | Path  # the input folder as the stage saw it (recorded as given)


@dataclasses.dataclass
class VerifyResult:
    """Outcome of :func:`verify_lineage`: ``ok`` iff ``problems`` is empty; ``files`` is the
    number of output files the manifest records (each rehashed)."""

    ok: bool  # no problem found
    problems: list[str]  # one readable line per problem, naming the file by relative path
    files: int = 0  # output files recorded in the manifest


# ---------------------------------------------------------------------------------------------
# hashing


def hash_file(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes, read in 1 MiB chunks (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _is_hidden_temp(name: str) -> bool:
    return name.startswith(".") and _TMP_MARK in name


def _list_files(folder: Path, exclude: Iterable[str]) -> dict[str, Path]:
    """Relative POSIX path -> path of every regular file under ``folder`` (symlinked files
    followed, symlinked directories not entered), minus ``exclude`` names at the top level and
    hidden temp files anywhere."""
    excluded = set(exclude)
    files: dict[str, Path] = {}
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        root_path = Path(root)
        rel_root = root_path.relative_to(folder)
        for name in names:
            if _is_hidden_temp(name) or (rel_root == Path(".") and name in excluded):
                continue
            p = root_path / name
            if p.is_file():
                files[(rel_root / name).as_posix()] = p
    return files


def hash_tree(folder: str | Path, exclude: Sequence[str] = (LINEAGE_FILE,)) -> list[dict[str, Any]]:
    """``[{"path", "sha256", "bytes"}]`` for every regular file under ``folder``, sorted by path.

    ``path`` is relative to ``folder`` in POSIX form; names in ``exclude`` are skipped at the top
    level only; hidden temp files (``.name.tmp...``) are skipped everywhere. Raises
    :class:`UserError` if ``folder`` is not a directory.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"not a folder: {folder}")
    files = _list_files(folder, exclude)
    return [{"path": rel, "sha256": hash_file(files[rel]), "bytes": files[rel].stat().st_size}
            for rel in sorted(files)]


def tree_digest(entries: Iterable[Mapping[str, Any]]) -> str:
    """sha256 hex of the canonical JSON of a file list (``path``/``sha256``/``bytes`` per entry,
    sorted by path): one digest that pins a whole folder."""
    canon = sorted(({"path": e.get("path"), "sha256": e.get("sha256"), "bytes": e.get("bytes")}
                    for e in entries), key=lambda e: str(e["path"]))
    text = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _compare(recorded: Sequence[Any], actual: Sequence[Mapping[str, Any]]) -> list[str]:
    """Problems between a recorded file list and a freshly hashed one: changed, missing,
    unexpected (new) files, and malformed recorded entries; sorted by path within each kind."""
    problems: list[str] = []
    rec: dict[str, Mapping[str, Any]] = {}
    for i, e in enumerate(recorded):
        if not (isinstance(e, Mapping) and isinstance(e.get("path"), str) and isinstance(e.get("sha256"), str)):
            problems.append(f"malformed outputs entry #{i}: {e!r}")
            continue
        rec[e["path"]] = e
    act = {e["path"]: e for e in actual}
    for rel in sorted(rec):
        r = rec[rel]
        a = act.get(rel)
        if a is None:
            problems.append(f"missing: {rel}")
        elif a["sha256"] != r["sha256"]:
            size = "" if r.get("bytes") in (None, a["bytes"]) else f"; {a['bytes']} bytes != recorded {r['bytes']}"
            problems.append(f"changed: {rel} (sha256 {a['sha256'][:12]}… != recorded {r['sha256'][:12]}…{size})")
    for rel in sorted(set(act) - set(rec)):
        problems.append(f"unexpected: {rel} (new file, not in the recorded outputs)")
    return problems


# ---------------------------------------------------------------------------------------------
# writing


def code_info() -> dict[str, Any]:
    """``{"git_commit", "dirty", "package_version"}`` of the code that runs now.

    Git is asked about the current working directory (``git rev-parse HEAD``, ``git status
    --porcelain``, without taking git's optional index lock); outside a git checkout, or without
    git, commit and dirty are ``None``. The version is ``distillery.__version__``.
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
    status = git("status", "--porcelain") if commit is not None else None
    return {"git_commit": commit.strip() if commit else None,
            "dirty": None if status is None else bool(status.strip()),
            "package_version": __version__}


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
    lineage.json is embedded after checking that its files still match it."""
    path = Path(inp.path)
    shown = _display_path(inp.path)
    if path.is_file():
        files = [{"path": path.name, "sha256": hash_file(path), "bytes": path.stat().st_size}]
        return {"role": inp.role, "path": shown, "sha256": tree_digest(files), "lineage": None, "files": files}
    if not path.is_dir():
        raise UserError(f"input '{inp.role}' not found: {path} (run the stage that produces it first)")
    files = hash_tree(path)
    if not (path / LINEAGE_FILE).is_file():
        return {"role": inp.role, "path": shown, "sha256": tree_digest(files), "lineage": None, "files": files}
    manifest = read_lineage(path)
    problems = _compare(manifest.get("outputs") or [], files)
    if problems:
        raise UserError(f"input '{inp.role}' at {path} no longer matches its lineage.json "
                        f"({len(problems)} problem(s), first: {problems[0]}); "
                        f"check it with `distillery lineage {path} --verify` and rerun its stage")
    return {"role": inp.role, "path": shown, "sha256": tree_digest(files), "lineage": manifest}


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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
) -> dict[str, Any]:
    """Build the DESIGN §2.1 manifest of a finished artifact folder and write it as
    ``artifact_dir/lineage.json`` atomically (hidden temp file + ``os.replace``).

    Call it last, after every payload file is in place: ``outputs`` hashes the folder as it is
    now. Each input is hashed and its own lineage.json embedded; an input whose files no longer
    match its lineage.json, or a missing input, raises :class:`UserError` and nothing is written.
    ``config``/``params``/``metrics`` must be JSON-serialisable (dataclasses, paths, enums and
    numpy/torch scalars are converted). Returns the manifest exactly as written (read back).
    """
    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise UserError(f"artifact folder not found: {folder}")
    manifest = {
        "artifact": _display_path(artifact_dir),
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
    }
    text = json.dumps(manifest, indent=2, default=_json_default, ensure_ascii=False) + "\n"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{LINEAGE_FILE}{_TMP_MARK}-")
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
    logger.info("wrote %s: %d output file(s), %d input(s)", folder / LINEAGE_FILE,
                len(manifest["outputs"]), len(manifest["inputs"]))
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
    try:
        manifest = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{p} is not valid JSON ({exc}); rerun the stage that wrote it") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{p} is not a lineage manifest (expected a JSON object)")
    missing = [k for k in _REQUIRED_KEYS if k not in manifest]
    if missing:
        raise UserError(f"{p} is not a lineage manifest: missing key(s) {', '.join(missing)} "
                        f"(expected {', '.join(MANIFEST_KEYS)})")
    return manifest


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, Mapping) and d:
        out: list[tuple[str, Any]] = []
        for k, v in d.items():
            out.extend(_flatten(v, f"{prefix}{k}."))
        return out
    return [(prefix[:-1], d)] if prefix else []


def _fmt_value(v: Any, limit: int = 32) -> str:
    if isinstance(v, float):
        s = f"{v:.4g}"
    elif isinstance(v, str):
        s = v
    else:
        s = json.dumps(v, default=str, ensure_ascii=False)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _fmt_pairs(d: Any, limit: int) -> str | None:
    pairs = _flatten(d)
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
    lines.append(f"code: {commit[:10] if commit else 'no git commit'}{state}{version}")
    ml = m.get("mlflow") or {}
    if ml.get("run_id"):
        exp = f" (experiment {ml['experiment']})" if ml.get("experiment") else ""
        lines.append(f"mlflow: run {ml['run_id']}{exp}")
    metrics = _fmt_pairs(m.get("metrics"), 5)
    if metrics:
        lines.append(f"metrics: {metrics}")
    return lines


def _render(m: Mapping[str, Any], head: str, first: str, rest: str, out: list[str]) -> None:
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
        if isinstance(sub, Mapping):
            _render(sub, role, child_first, child_rest, out)
        else:
            files = inp.get("files") or []
            digest = str(inp.get("sha256") or "?")[:12]
            out.append(f"{child_first}{role}{inp.get('path')}  (external, no lineage)  "
                       f"{len(files)} file(s), {_fmt_bytes(sum(int(e.get('bytes') or 0) for e in files))}, "
                       f"sha256 {digest}")


def lineage_tree(manifest: Mapping[str, Any]) -> str:
    """A readable tree of an artifact and, recursively, every embedded input: one node per
    artifact (stage, kind, path, method, created, up to 8 params, output digest, code commit,
    MLflow run, a few metrics); inputs without lineage are leaves with their digest."""
    out: list[str] = []
    _render(manifest, "", "", "", out)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# verifying


def _check_inputs(inputs: Any, chain: str, problems: list[str]) -> None:
    """Internal consistency of embedded input entries, recursively (no input path is opened)."""
    if not isinstance(inputs, list):
        problems.append(f"malformed inputs{' of ' + chain if chain else ''}: expected a list")
        return
    for i, inp in enumerate(inputs):
        if not isinstance(inp, Mapping):
            problems.append(f"malformed input #{i}{' of ' + chain if chain else ''}: {inp!r}")
            continue
        name = f"{chain}/{inp.get('role')}" if chain else str(inp.get("role"))
        label = f"input {name} ({inp.get('path')})"
        sub = inp.get("lineage")
        if isinstance(sub, Mapping):
            entries = sub.get("outputs")
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


def verify_lineage(artifact_dir: str | Path) -> VerifyResult:
    """Check an artifact folder against its own lineage.json, offline and path-independent.

    Rehashes every file under the folder and reports each ``changed``, ``missing`` or
    ``unexpected`` (new) file by relative path; checks every embedded input manifest for
    internal consistency (recorded digest == digest of its recorded file list). A folder copied
    elsewhere verifies the same. Raises :class:`UserError` if there is no readable manifest.
    """
    folder = Path(artifact_dir)
    if folder.is_file() and folder.name == LINEAGE_FILE:
        folder = folder.parent
    manifest = read_lineage(folder)
    recorded = manifest.get("outputs")
    problems: list[str] = []
    if not isinstance(recorded, list):
        problems.append("malformed outputs: expected a list")
        recorded = []
    problems.extend(_compare(recorded, hash_tree(folder)))
    _check_inputs(manifest.get("inputs"), "", problems)
    return VerifyResult(ok=not problems, problems=problems, files=len(recorded))
