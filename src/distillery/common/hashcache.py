"""Hash once: a file-content digest cache keyed by what the file system says about the file.

A pipeline stage hashes its inputs for lineage and for its resume key, and a frozen role's weights
for checkpoint metadata; the stage that produced those files hashed the same bytes when it wrote
its own lineage. :func:`file_sha256` returns a recorded digest instead of reading the file again
when the file still has the device, inode, size and modification time (ns) recorded with that
digest — the same test git's index and DVC's state database use — and hashes it otherwise.

- The cache is active only in processes whose environment names it (``DISTILLERY_HASH_CACHE``: a
  JSON file; the pipeline's stage runner sets it to ``runs/.hash_cache.json``, and the trainer
  processes it launches inherit it). Without it every digest is computed from the bytes.
- Keys survive a rename (a stage's staging folder renamed into place keeps its inodes); a copy, a
  rewrite or a ``dvc checkout`` makes a new inode or mtime, hence a miss and a fresh read.
- ``distillery lineage --verify`` never consults it: verification always reads every byte. Like
  git and DVC, the cache trusts the file system's metadata: content changed with its mtime restored
  on purpose is caught by ``--verify``, not by the next stage.
- Writes merge under an exclusive ``flock`` and replace the file atomically, so concurrent stages
  (a Prefect run of independent stages) keep each other's entries.
- It is only a cache: the file is opened non-blocking and read only when it is a regular file of
  the expected shape (:func:`valid_entries`; size and nesting bounded before parsing). Anything
  else — a FIFO, a folder, a symbolic link, deep JSON, a digest that is not 64 hex digits, any file
  that is not a cache (``params.yaml`` named by mistake) — is ignored with one warning line per process,
  every digest is read from the bytes, and the file is left exactly as it is: the cache writes only
  where there is nothing yet or a cache already (docs/reliability.md: distillery overwrites only its own files).
- A digest from the cache is trusted for lineage and keys, but not to throw work away: a stage
  that would discard a run folder because an input's digest changed first re-hashes that input
  from its bytes (:func:`from_bytes`), which also corrects a wrong entry (:data:`CORRECTED`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distillery.common.fsutil import file_kind, read_json_file
from distillery.common.log import get_logger

log = get_logger("hashcache")

ENV_VAR = "DISTILLERY_HASH_CACHE"
_CHUNK = 1 << 20
MAX_ENTRIES = 200_000  # oldest entries are dropped beyond this (stale inodes accumulate otherwise)
MAX_FILE_BYTES = 256 << 20  # a full cache of MAX_ENTRIES is ~20 MB
_KEY = re.compile(r"^[0-9]+:[0-9]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def read_sha256(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes, read in 1 MiB chunks (constant memory); never cached."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}"


@dataclass
class HashStats:
    """Bytes this process hashed from disk vs. took from the cache (for the stage's log line)."""

    read_bytes: int = 0
    cached_bytes: int = 0
    files_read: int = 0
    files_cached: int = 0


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def valid_entries(data: Any) -> dict[str, list] | None:
    """``data`` (a parsed cache file) when it has the cache's shape — ``{"<dev>:<ino>": [size,
    mtime_ns, sha256 hex]}`` — else ``None``: one bad entry makes the whole file suspect."""
    if not isinstance(data, dict):
        return None
    for key, value in data.items():
        if not (_KEY.match(key) and isinstance(value, list) and len(value) == 3 and _is_count(value[0])
                and _is_count(value[1]) and isinstance(value[2], str) and _SHA256.match(value[2])):
            return None
    return data


@dataclass
class HashCache:
    """The cache file at ``path``: ``{"<dev>:<ino>": [size, mtime_ns, sha256]}``."""

    path: Path
    entries: dict[str, list] = field(default_factory=dict)
    pending: dict[str, list] = field(default_factory=dict)
    usable: bool = True  # False when ``path`` is not a regular file: never written then
    warned: bool = False  # this process said once that the file was ignored

    def __post_init__(self) -> None:
        entries = "a symbolic link" if os.path.islink(self.path) else self._load()
        if isinstance(entries, str):  # not a cache file: never written, whatever it is (it may be the user's)
            self.usable = False
            self._warn(f"is {entries}", "left as it is; every digest is read from the files (remove it, or name "
                       f"another file in {ENV_VAR}, to get a cache again)")
            entries = {}
        self.entries = entries

    def _warn(self, why: str, then: str) -> None:
        if not self.warned:
            self.warned = True
            log.warning("hash cache %s %s: ignored, %s", self.path, why, then)

    def _load(self) -> dict[str, list] | str:
        """The file's entries (``{}`` when there is no file), or why it is not a cache."""
        try:
            data = read_json_file(self.path, MAX_FILE_BYTES)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            return f"unreadable ({exc.strerror or exc})"
        except ValueError as exc:
            return str(exc)
        entries = valid_entries(data)
        return entries if entries is not None else "not a hash cache (entries of another shape)"

    def sha256(self, path: str | Path, *, trust: bool = True) -> str:
        """The digest of ``path``'s bytes: recorded when the file's identity and mtime still match
        (``trust=False``: always read, and a recorded digest that differs is replaced and counted)."""
        st = os.stat(path)
        key, want = _key(st), [st.st_size, st.st_mtime_ns]
        hit = self.pending.get(key) or self.entries.get(key)
        if trust and hit is not None and hit[:2] == want:
            STATS.files_cached += 1
            STATS.cached_bytes += st.st_size
            return hit[2]
        digest = _counted_read(path, st.st_size)
        after = os.stat(path)
        if [after.st_size, after.st_mtime_ns] == want and _key(after) == key:  # not rewritten while we read it
            if hit is not None and hit[:2] == want and hit[2] != digest:
                CORRECTED.append(str(path))
            self.pending[key] = [*want, digest]
        return digest

    def flush(self) -> None:
        """Merge this process's new entries into the file (under a lock, atomically replaced).
        Nothing is written when the cache file is not a regular file; a write that fails (a
        read-only or full disk) is one warning line, never an error: the digests are all known."""
        if not self.pending or not self.usable:
            return
        try:
            self._write()
        except OSError as exc:
            what = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
            self._warn(f"cannot be written ({what})", "this process's digests are not kept for the next stage")
            self.usable = False

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO there never blocks the stage
        lock = os.open(self.path.with_name(self.path.name + ".lock"), flags | os.O_NOFOLLOW, 0o644)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            if not stat.S_ISREG(os.fstat(lock).st_mode):
                raise OSError(f"its lock file is {file_kind(os.fstat(lock).st_mode)}")
            fcntl.flock(lock, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISREG(mode := os.lstat(self.path).st_mode):
                    raise OSError(f"it became {file_kind(mode)}")
            on_disk = self._load()  # another stage's entries
            if isinstance(on_disk, str):  # replaced since it was read by something that is not a cache: left alone
                raise OSError(f"it became {on_disk}")
            merged = {**on_disk, **self.pending}
            if len(merged) > MAX_ENTRIES:
                merged = dict(list(merged.items())[-MAX_ENTRIES:])
            tmp.write_text(json.dumps(merged, separators=(",", ":")), encoding="utf-8")
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
            os.close(lock)
        self.entries = merged
        self.pending = {}


_ACTIVE: HashCache | None = None
STATS = HashStats()  # this process's totals, cache or not
CORRECTED: list[str] = []  # files whose recorded digest differed from their bytes (found by from_bytes)
_FROM_BYTES = False


def _counted_read(path: str | Path, size: int) -> str:
    STATS.files_read += 1
    STATS.read_bytes += size
    return read_sha256(path)


def active_cache() -> HashCache | None:
    """This process's cache, when ``DISTILLERY_HASH_CACHE`` names one (created on first use)."""
    global _ACTIVE
    where = os.environ.get(ENV_VAR)
    if not where:
        return None
    if _ACTIVE is None or _ACTIVE.path != Path(where):
        _ACTIVE = HashCache(Path(where))
    return _ACTIVE


def file_sha256(path: str | Path) -> str:
    """sha256 of ``path``: through the active cache when there is one, else read in full."""
    cache = active_cache()
    if cache is None:
        return _counted_read(path, os.stat(path).st_size)
    return cache.sha256(path, trust=not _FROM_BYTES)


@contextlib.contextmanager
def from_bytes() -> Iterator[None]:
    """Within the block, :func:`file_sha256` reads every file and records what it read: for a
    decision a cached digest must not make alone (discarding a run). A recorded digest that
    differed from the bytes is replaced (written by the next flush) and its file appended to
    :data:`CORRECTED`."""
    global _FROM_BYTES
    was, _FROM_BYTES = _FROM_BYTES, True
    try:
        yield
    finally:
        _FROM_BYTES = was


def copy_hashed(source: str | Path, target: str | Path) -> str:
    """Copy ``source`` to ``target`` (bytes and mode/times, as ``shutil.copy2``) reading it once, and
    return the sha256 of what was written; with an active cache the digest is recorded for both files
    (the source only when it did not change while it was read), so hashing the copy for its artifact's
    lineage and the source for its input manifest reads neither again. Usable as ``copytree``'s
    ``copy_function``; a symlinked source is copied by content."""
    before = os.stat(source)
    h = hashlib.sha256()
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(_CHUNK * 16):
            h.update(chunk)
            dst.write(chunk)
    shutil.copystat(source, target)
    digest = h.hexdigest()
    STATS.files_read += 1
    STATS.read_bytes += before.st_size
    cache = active_cache()
    if cache is not None:
        after, written = os.stat(source), os.stat(target)
        if [after.st_size, after.st_mtime_ns, _key(after)] == [before.st_size, before.st_mtime_ns, _key(before)]:
            cache.pending[_key(after)] = [after.st_size, after.st_mtime_ns, digest]
            cache.pending[_key(written)] = [written.st_size, written.st_mtime_ns, digest]
    return str(target)


def flush_active() -> None:
    """Write the active cache's new entries (no-op without one)."""
    if _ACTIVE is not None:
        _ACTIVE.flush()


def folder_sha256(folder: str | Path) -> str | None:
    """sha256 over a folder's files (relative name + content digest, in name order); None when it holds none (what
    :meth:`distillery.models.base.ModelBase.source` records of a role's weights, and a LoRA export checks its base
    against)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    for path in files:
        digest.update(f"{path.relative_to(folder).as_posix()}\0{file_sha256(path)}\n".encode())
    flush_active()
    return digest.hexdigest() if files else None
