"""Validate's VBench score cache: a headline candidate's per-video VBench scores, kept by what determines them.

:func:`distillery.evaluation.vbench.validation.score_candidates` given a :class:`ScoreCache` scores a candidate's
videos only when no entry with its **key** is in the cache or the entry does not check out; a validate rerun that
leaves a candidate's videos as they were (another teacher step count, the CLIP folder, a sparser NFE curve, VBench
turned on after the videos were cached) does not score them again. The key is the sha256 of the canonical JSON of its
*material* (:func:`material`):

- per video, in scoring order: its name, the prompt it is scored against, the dimensions it serves and the sha256 of
  **every byte** of its MP4 (the file VBench decodes: a video sampled again into other frames is a new key);
- every model folder the dimensions read, file by file with its sha256 (the lineage's pin of it:
  :func:`distillery.lineage.manifest.pin_input`);
- the digest of the sources that decode and score (:func:`~distillery.evaluation.sample_cache.code_digest`: the
  ``evaluation`` and ``clips`` packages among them), the machine and library facts a score's bits depend on
  (:func:`~distillery.evaluation.sample_cache.machine_facts` on the scoring device, and transformers' version) and
  :data:`CACHE_FORMAT`.

The candidate's name is not part of it. What is cached is each video's score on each dimension and its weight (the
rows ``videos.jsonl`` lists); the candidate's aggregate, quality score, report and metrics are computed from them every
run, so a reused candidate's numbers are bitwise the ones scoring its files again on the same machine gives (JSON keeps
a float's every bit).

Layout (``root``, the stage's ``runs/validate/vbench_cache/``: not a DVC out; ``rm -rf`` it to score everything
again): ``root/<key>.json`` — ``{"format", "key", "candidate" (name when stored), "material", "rows", "seal"}`` (seal:
the sha256 of the canonical JSON of the other keys). An entry is used only when it is a regular file within bounds
that parses, its seal matches, it holds exactly the expected key and material, and its rows are exactly one finite
score and weight per video and dimension of the material. Anything else is one log line naming the candidate and why,
and the videos are scored again (the fresh entry replaces the bad one). Like the sample cache's, an entry rewritten
consistently (rows and seal) is believed: whoever can write ``runs/`` can rewrite the artifacts too. Entries are
written to a temporary sibling and renamed; a write that fails is a warning. :meth:`ScoreCache.prune` keeps the run's
entries and the :data:`KEEP_ENTRIES` most recently used others.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distillery.common.log import get_logger
from distillery.evaluation.sample_cache import canonical, code_digest, entry_key, file_digests, machine_facts
from distillery.evaluation.vbench.dimensions import VideoScore

log = get_logger(__name__)

CACHE_FORMAT = 1  # bump when what an entry holds, or how a key is made, changes
MAX_ENTRY_BYTES = 64 << 20
KEEP_ENTRIES = 512  # entries of other runs kept, most recently used first (a few KB each)
FIELDS = ("format", "key", "candidate", "material", "rows", "seal")


def material(videos: Sequence[tuple[Any, Path]], models: Mapping[str, Sequence[Mapping[str, Any]]],
             device: str) -> dict[str, Any]:
    """What a candidate's scores depend on (module doc): ``videos`` ((:class:`~.protocol.VideoSpec`, mp4 path), in
    scoring order), ``models`` (model key → its folder's pinned files, ``[{"path", "sha256", ...}]``), ``device``."""
    import importlib.metadata

    import torch

    return {"format": CACHE_FORMAT,
            "videos": [{"name": spec.name, "prompt": spec.entry.prompt, "dimensions": list(spec.entry.dimensions),
                        "sha256": file_digests([path], path.parent)[path.name]} for spec, path in videos],
            "models": {key: sorted([str(f["path"]), str(f["sha256"])] for f in files) for key, files in sorted(models.items())},
            "code": code_digest(),
            "machine": {**machine_facts(torch.device(device), torch.float32),
                        "transformers": importlib.metadata.version("transformers")}}


class Unusable(Exception):
    """Why an entry cannot be used (one short phrase)."""


class ScoreCache:
    """The entries under ``root`` (module doc)."""

    def __init__(self, root: Path, keep_entries: int = KEEP_ENTRIES) -> None:
        self.root = Path(root)
        self.keep_entries = keep_entries

    def load(self, name: str, want: Mapping[str, Any]) -> list[VideoScore] | None:
        """The rows of the entry for ``want`` (a :func:`material`), or None (logged when an entry was there but did not
        check out)."""
        key = entry_key(want)
        path = self.root / f"{key}.json"
        try:
            rows = self._check(path, key, want)
        except FileNotFoundError:
            return None
        except Unusable as why:
            log.warning("validate %s: VBench score cache entry %s unusable (%s): scoring its videos again", name, key[:12], why)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used: kept longest by prune
        return rows

    @staticmethod
    def _check(path: Path, key: str, want: Mapping[str, Any]) -> list[VideoScore]:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_ENTRY_BYTES:
            raise Unusable("not a regular file within bounds")
        try:
            entry = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise Unusable(f"unreadable: {type(exc).__name__}") from None
        if not isinstance(entry, dict) or sorted(entry) != sorted(FIELDS):
            raise Unusable("not an entry")
        try:
            sealed = entry_key({k: v for k, v in entry.items() if k != "seal"})
        except ValueError:
            raise Unusable("not an entry") from None
        if entry["seal"] != sealed:
            raise Unusable("its seal does not match")
        if entry["key"] != key or entry["material"] != json.loads(canonical(want)):
            raise Unusable("another key's entry")
        expected = [(v["name"], d) for v in want["videos"] for d in v["dimensions"]]
        rows = entry["rows"]
        if not isinstance(rows, list) or len(rows) != len(expected):
            raise Unusable("not one row per video and dimension")
        out = []
        for (name, dimension), row in zip(expected, rows):
            ok = isinstance(row, list) and len(row) == 4 and row[:2] == [name, dimension]
            if not ok or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in row[2:]):
                raise Unusable(f"a row that is not {name}'s {dimension} score")
            out.append(VideoScore(name, dimension, float(row[2]), float(row[3])))
        return out

    def store(self, name: str, want: Mapping[str, Any], rows: Sequence[VideoScore]) -> None:
        """Write ``rows`` (in :func:`material`'s video × dimension order) as the entry for ``want``; a failure is a
        warning."""
        entry: dict[str, Any] = {"format": CACHE_FORMAT, "key": entry_key(want), "candidate": name,
                                 "material": json.loads(canonical(want)),
                                 "rows": [[r.name, r.dimension, r.value, r.weight] for r in rows]}
        entry["seal"] = entry_key(entry)
        tmp = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".entry-", dir=self.root)
            with os.fdopen(fd, "w") as f:
                f.write(canonical(entry))
            os.replace(tmp, self.root / f"{entry['key']}.json")
        except OSError as exc:
            log.warning("validate %s: its VBench scores not cached (%s)", name, exc)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def prune(self, keep: set[str]) -> None:
        """Remove entries neither in ``keep`` (keys) nor among the most recently used others (module doc)."""
        if not self.root.is_dir():
            return
        others = sorted((p for p in self.root.iterdir() if p.suffix == ".json" and p.stem not in keep),
                        key=lambda p: p.lstat().st_mtime, reverse=True)
        for path in others[self.keep_entries:]:
            with contextlib.suppress(OSError):
                path.unlink()
