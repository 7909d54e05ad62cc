"""Checksums of a checkpoint folder: recorded at save, verified before a checkpoint is trusted.

``checksums.json`` lists every file of the checkpoint (relative POSIX path → size and sha256)
except itself and ``metadata.json``. It is written before ``metadata.json``, the last-written
completeness marker, which records the size and sha256 of ``checksums.json`` under
``"checksums"``: so one chain of digests covers every byte of the folder.

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

CHECKSUMS_FILE = "checksums.json"
METADATA_FILE = "metadata.json"
CHUNK_BYTES = 1 << 20
HASH_THREADS = 4


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


def write_checksums(folder: Path, known: dict[str, FileDigest] | None = None) -> dict[str, Any]:
    """Write ``folder/checksums.json`` over every file but itself and ``metadata.json``.

    ``known`` holds digests already computed (other ranks' shards); the rest are hashed here.
    Returns the record of ``checksums.json`` itself for ``metadata.json`` (``file``, ``size``, ``sha256``).
    """
    folder = Path(folder)
    files, _ = list_files(folder)
    files = [f for f in files if f not in (CHECKSUMS_FILE, METADATA_FILE)]
    known = {k: v for k, v in (known or {}).items() if k in files}
    digests = {**known, **hash_files(folder, [f for f in files if f not in known])}
    doc = {"algorithm": "sha256", "files": {rel: digests[rel].to_json() for rel in sorted(digests)}}
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


def read_metadata(folder: Path) -> tuple[dict[str, Any] | None, Damage | None]:
    """``metadata.json`` as a dict, or the damage that makes it unusable (missing, not JSON, no step)."""
    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        return None, Damage(METADATA_FILE, "missing")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, Damage(METADATA_FILE, f"unreadable ({type(exc).__name__})")
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        return None, Damage(METADATA_FILE, "invalid (no step)")
    return meta, None


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
        doc = json.loads(listing.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return Damage(CHECKSUMS_FILE, "invalid")
    entries = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        return Damage(CHECKSUMS_FILE, "invalid")
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
