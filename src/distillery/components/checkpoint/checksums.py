"""Checksums of a checkpoint folder: recorded at save, verified before a checkpoint is trusted.

``checksums.json`` lists every file of the checkpoint (relative POSIX path → size and sha256)
except itself and ``metadata.json``, and under ``"metadata"`` the digest of ``metadata.json``'s
content without its ``"checksums"`` record (:func:`metadata_digest`: canonical JSON). It is written
before ``metadata.json``, the last-written completeness marker, which records the size and sha256
of ``checksums.json`` under ``"checksums"``: so one chain of digests covers every byte of the
folder and every value of its metadata. (A ``checksums.json`` of an earlier distillery has no
``"metadata"`` digest: its metadata is then checked for types only.)

``metadata.json`` is read bounded (size and nesting, :func:`distillery.common.fsutil.read_json_file`) and
its values checked for type (:func:`metadata_problem`): a metadata file of wrong types is damage,
like a corrupt shard, so resume falls back past it.

Hashing streams 1 MiB chunks (memory stays flat for a 16 GB Wan-1.3B checkpoint) over a few
threads (hashlib releases the GIL); files are hashed at save (each rank its own shards) and when a
checkpoint is verified (resume, export), never on an ordinary read. Sizes are compared before
any hashing, so a truncated or missing file is found at once.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from distillery.common.fsutil import read_json_file

CHECKSUMS_FILE = "checksums.json"
METADATA_FILE = "metadata.json"
CHUNK_BYTES = 1 << 20
HASH_THREADS = 4
MAX_METADATA_BYTES = 1 << 20  # metadata.json (a few hundred bytes written)
MAX_CHECKSUMS_BYTES = 64 << 20  # checksums.json: ~100 bytes per file


@dataclass(frozen=True)
class FileDigest:
    size: int  # bytes
    sha256: str  # hex

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class Damage:
    """Why a checkpoint is not intact: the first bad file (relative path) and what is wrong with it."""

    file: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


def hash_file(path: Path) -> FileDigest:
    """Size and sha256 of ``path``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])
            size += n
    return FileDigest(size, digest.hexdigest())


def hash_files(root: Path, rels: Iterable[str]) -> dict[str, FileDigest]:
    """``{rel: digest}`` for files under ``root``, hashed on up to :data:`HASH_THREADS` threads."""
    rels = sorted(rels)
    if not rels:
        return {}
    workers = max(1, min(HASH_THREADS, os.cpu_count() or 1, len(rels)))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(rels, pool.map(lambda r: hash_file(Path(root) / r), rels)))


def list_files(root: Path) -> tuple[list[str], list[str]]:
    """(regular files, symbolic links) under ``root`` as sorted relative POSIX paths."""
    files, links = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in [*dirnames, *filenames]:
            p = here / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                links.append(rel)
            elif p.is_file():
                files.append(rel)
    return sorted(files), sorted(links)


def metadata_digest(meta: dict[str, Any]) -> str:
    """sha256 of ``metadata.json``'s content as JSON values, without its ``"checksums"`` record
    (canonical: sorted keys, no spaces), so the digest does not depend on how the file is laid out."""
    content = {k: v for k, v in meta.items() if k != "checksums"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_checksums(folder: Path, known: dict[str, FileDigest] | None = None,
                    metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``folder/checksums.json`` over every file but itself and ``metadata.json``, and the
    digest of ``metadata`` (the JSON content ``metadata.json`` will hold; default: the one it holds).

    ``known`` holds digests already computed (other ranks' shards); the rest are hashed here.
    Returns the record of ``checksums.json`` itself for ``metadata.json`` (``file``, ``size``, ``sha256``).
    """
    folder = Path(folder)
    files, _ = list_files(folder)
    files = [f for f in files if f not in (CHECKSUMS_FILE, METADATA_FILE)]
    known = {k: v for k, v in (known or {}).items() if k in files}
    digests = {**known, **hash_files(folder, [f for f in files if f not in known])}
    if metadata is None:
        metadata = read_json_file(folder / METADATA_FILE, MAX_METADATA_BYTES)
    doc = {"algorithm": "sha256", "files": {rel: digests[rel].to_json() for rel in sorted(digests)},
           "metadata": {"file": METADATA_FILE, "sha256": metadata_digest(metadata)}}
    (folder / CHECKSUMS_FILE).write_text(json.dumps(doc, indent=1))
    own = hash_file(folder / CHECKSUMS_FILE)
    return {"file": CHECKSUMS_FILE, **own.to_json()}


def _valid_rel(rel: object) -> bool:
    if not isinstance(rel, str) or not rel or "\\" in rel:
        return False
    p = PurePosixPath(rel)
    return not p.is_absolute() and all(part not in ("", ".", "..") for part in p.parts)


def _expected(entry: object) -> FileDigest | None:
    if not isinstance(entry, dict):
        return None
    size, sha = entry.get("size"), entry.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(sha, str) or len(sha) != 64:
        return None
    return FileDigest(size, sha.lower())


def _is_int(v: object, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _optional_str(v: object) -> bool:
    return v is None or isinstance(v, str)


def _frozen_roles_ok(v: object) -> bool:
    return isinstance(v, dict) and all(isinstance(role, str) and isinstance(src, dict) and _optional_str(src.get("path"))
                                       and _optional_str(src.get("sha256")) for role, src in v.items())


# metadata.json key → (its check, what it must be); a key absent is not checked (but step is required)
_METADATA_TYPES: dict[str, tuple[Any, str]] = {
    "step": (lambda v: _is_int(v, 0), "an integer >= 0"),
    "world_size": (lambda v: _is_int(v, 1), "an integer >= 1"),
    "format": (lambda v: _is_int(v, 0), "an integer"),
    "roles": (lambda v: isinstance(v, list) and all(isinstance(r, str) for r in v), "a list of role names"),
    "frozen_roles": (_frozen_roles_ok, "a mapping of role → {path, sha256}"),
    "method": (_optional_str, "a string"),
    "mlflow_run_id": (_optional_str, "a string or null"),
    "created": (_optional_str, "a string"),
    "checksums": (lambda v: isinstance(v, dict), "a mapping"),
}


def _shown(value: object, limit: int = 40) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def metadata_problem(meta: object) -> str | None:
    """``None`` when ``meta`` (parsed ``metadata.json``) has the keys and types distillery writes,
    else a short phrase naming the first bad key."""
    if not isinstance(meta, dict):
        return f"not a JSON object ({type(meta).__name__})"
    if "step" not in meta:
        return "no step"
    for key, (ok, what) in _METADATA_TYPES.items():
        if key in meta and not ok(meta[key]):
            return f"{key} is {_shown(meta[key])}, not {what}"
    return None


def read_metadata(folder: Path) -> tuple[dict[str, Any] | None, Damage | None]:
    """``metadata.json`` as a dict, or the damage that makes it unusable (missing, not a regular
    file, too large or deep, not JSON, a key of the wrong type: :func:`metadata_problem`)."""
    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        return None, Damage(METADATA_FILE, "missing")
    try:
        meta = read_json_file(path, MAX_METADATA_BYTES)
    except OSError as exc:
        return None, Damage(METADATA_FILE, f"unreadable ({exc.strerror or type(exc).__name__})")
    except ValueError as exc:
        return None, Damage(METADATA_FILE, f"unreadable ({exc})")
    problem = metadata_problem(meta)
    if problem:
        return None, Damage(METADATA_FILE, f"invalid ({problem})")
    return meta, None


def saved_at(folder: Path) -> str | None:
    """When checkpoint ``folder`` was saved, ISO 8601 in UTC (``2026-12-07T23:31:05Z``), from its ``metadata.json``'s
    ``created`` (written in local time with its offset); ``None`` when the metadata is unusable or says no time."""
    from datetime import datetime, timezone

    meta, _ = read_metadata(folder)
    created = meta.get("created") if meta else None
    try:
        when = datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z") if isinstance(created, str) else None
    except ValueError:
        return None
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if when else None


def verify_checkpoint(folder: Path) -> Damage | None:
    """``None`` when every file of ``folder`` matches its recorded size and sha256, else the first
    damage found: metadata.json or checksums.json missing/invalid, a listed file missing or
    different, a file that is not listed, a symbolic link."""
    folder = Path(folder)
    meta, damage = read_metadata(folder)
    if damage:
        return damage
    record = meta.get("checksums")
    own = _expected(record)
    if own is None or not isinstance(record, dict) or record.get("file") != CHECKSUMS_FILE:
        return Damage(METADATA_FILE, "records no checksums (written by an older distillery, or not by distillery)")
    listing = folder / CHECKSUMS_FILE
    if not listing.is_file():
        return Damage(CHECKSUMS_FILE, "missing")
    if hash_file(listing) != own:
        return Damage(CHECKSUMS_FILE, "differs from the digest in metadata.json")
    try:
        doc = read_json_file(listing, MAX_CHECKSUMS_BYTES)
    except (OSError, ValueError):
        return Damage(CHECKSUMS_FILE, "invalid")
    entries = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        return Damage(CHECKSUMS_FILE, "invalid")
    if "metadata" in doc:  # absent: written before metadata.json was covered (types checked only)
        recorded = doc["metadata"]
        sha = recorded.get("sha256") if isinstance(recorded, dict) else None
        if not isinstance(sha, str) or len(sha) != 64:
            return Damage(CHECKSUMS_FILE, "invalid entry 'metadata'")
        if metadata_digest(meta) != sha.lower():
            return Damage(METADATA_FILE, "its content differs from the digest recorded in checksums.json")
    expected: dict[str, FileDigest] = {}
    for rel, entry in entries.items():
        digest = _expected(entry)
        if not _valid_rel(rel) or digest is None or rel in (CHECKSUMS_FILE, METADATA_FILE):
            return Damage(CHECKSUMS_FILE, f"invalid entry {str(rel)[:80]!r}")
        expected[rel] = digest
    files, links = list_files(folder)
    if links:
        return Damage(links[0], "is a symbolic link")
    present = set(files) - {CHECKSUMS_FILE, METADATA_FILE}
    problems = [Damage(rel, "missing") for rel in expected if rel not in present]
    problems += [Damage(rel, "not listed in checksums.json") for rel in present if rel not in expected]
    for rel, d in expected.items():
        if rel in present and (size := (folder / rel).stat().st_size) != d.size:
            problems.append(Damage(rel, f"{size} bytes, {d.size} recorded"))
    if problems:
        return min(problems, key=lambda d: d.file)
    try:
        actual = hash_files(folder, expected)
    except OSError as exc:
        name = Path(os.path.relpath(exc.filename, folder)).as_posix() if exc.filename else "a file"
        return Damage(name, f"unreadable ({exc.strerror or exc})")
    for rel in sorted(expected):
        if actual[rel].sha256 != expected[rel].sha256:
            return Damage(rel, "sha256 differs from the one recorded at save")
    return None
