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
  (a Prefect run of independent stages) keep each other's entries; a corrupt or unreadable cache
  file is treated as empty.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

ENV_VAR = "DISTILLERY_HASH_CACHE"
_CHUNK = 1 << 20
MAX_ENTRIES = 200_000  # oldest entries are dropped beyond this (stale inodes accumulate otherwise)


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


@dataclass
class HashCache:
    """The cache file at ``path``: ``{"<dev>:<ino>": [size, mtime_ns, sha256]}``."""

    path: Path
    entries: dict[str, list] = field(default_factory=dict)
    pending: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.entries = self._read()

    def _read(self) -> dict[str, list]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, list) and len(v) == 3} if isinstance(data, dict) else {}

    def sha256(self, path: str | Path) -> str:
        """The digest of ``path``'s bytes: recorded when the file's identity and mtime still match."""
        st = os.stat(path)
        key, want = _key(st), [st.st_size, st.st_mtime_ns]
        hit = self.pending.get(key) or self.entries.get(key)
        if hit is not None and hit[:2] == want:
            STATS.files_cached += 1
            STATS.cached_bytes += st.st_size
            return hit[2]
        digest = _counted_read(path, st.st_size)
        after = os.stat(path)
        if [after.st_size, after.st_mtime_ns] == want and _key(after) == key:  # not rewritten while we read it
            self.pending[key] = [*want, digest]
        return digest

    def flush(self) -> None:
        """Merge this process's new entries into the file (under a lock, atomically replaced)."""
        if not self.pending:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            merged = {**self._read(), **self.pending}
            if len(merged) > MAX_ENTRIES:
                merged = dict(list(merged.items())[-MAX_ENTRIES:])
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(merged, separators=(",", ":")), encoding="utf-8")
            os.replace(tmp, self.path)
        self.entries = merged
        self.pending = {}


_ACTIVE: HashCache | None = None
STATS = HashStats()  # this process's totals, cache or not


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
    return cache.sha256(path) if cache is not None else _counted_read(path, os.stat(path).st_size)


def flush_active() -> None:
    """Write the active cache's new entries (no-op without one)."""
    if _ACTIVE is not None:
        _ACTIVE.flush()
