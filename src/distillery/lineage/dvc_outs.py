"""The folder outs that DVC records: finding an artifact folder's out in a dvc.lock or a ``.dvc`` file
(:func:`find_dvc_out`) and DVC 3's directory hash (:func:`dvc_dir_hash`), which
:func:`distillery.lineage.verify.verify_lineage` recomputes for ``--dvc-lock``.

Stdlib + PyYAML (imported when a lock file is read); it never imports DVC.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.lineage.contract import cut

_MAX_LOCK_DEPTH = 64  # YAML nesting of a dvc.lock / .dvc file (real ones: ~6)


@dataclasses.dataclass(frozen=True)
class DvcOut:
    """One folder out as a dvc.lock (or a ``.dvc`` file) records it."""

    stage: str | None  # the dvc.lock stage that wrote it (None in a .dvc file)
    path: str  # as recorded: relative to the folder of the lock file
    md5: str  # DVC 3 directory hash, "<md5 hex>.dir"
    nfiles: int | None  # number of files DVC counted, if recorded


def dvc_dir_hash(md5s: Mapping[str, str]) -> str:
    listing = [{"md5": md5s[rel], "relpath": rel} for rel in sorted(md5s)]
    text = json.dumps(listing, sort_keys=True)  # DVC's own serialisation: default separators, ASCII escapes
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest() + ".dir"


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
                raise UserError(f"{cut(lock)}: nested deeper than {_MAX_LOCK_DEPTH} levels (line {line}): not a "
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
        raise UserError(f"dvc lock file not found: {cut(lock)}")
    try:
        data = _load_lock_yaml(lock.read_text(encoding="utf-8"), lock)
    except (yaml.YAMLError, UnicodeDecodeError, OSError, ValueError, TypeError, RecursionError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{cut(lock)} is not a readable YAML file ({cut(first, limit=80)})") \
            from None
    outs: list[tuple[str | None, Mapping[str, Any]]] = []
    if isinstance(data, Mapping) and isinstance(data.get("stages"), Mapping):
        for name, stage in data["stages"].items():
            for out in (stage.get("outs") or []) if isinstance(stage, Mapping) else []:
                if isinstance(out, Mapping) and isinstance(out.get("path"), str):
                    outs.append((str(name), out))
    elif isinstance(data, Mapping) and isinstance(data.get("outs"), list):
        outs = [(None, o) for o in data["outs"] if isinstance(o, Mapping) and isinstance(o.get("path"), str)]
    else:
        raise UserError(f"{cut(lock)} is neither a dvc.lock (no 'stages') nor a .dvc file (no 'outs')")
    base, target = lock.resolve().parent, Path(folder).resolve()
    match = next(((s, o) for s, o in outs if (base / o["path"]).resolve() == target), None)
    if match is None and recorded_artifact:
        want = posixpath.normpath(recorded_artifact)
        match = next(((s, o) for s, o in outs if posixpath.normpath(o["path"]) == want), None)
    if match is None:
        known = ", ".join(sorted({o["path"] for _, o in outs})) or "none"
        raise UserError(f"{cut(lock)} records no out for {cut(folder)} "
                        f"(outs: {cut(known, limit=100)})")
    stage, out = match
    md5 = out.get("md5")
    if not (isinstance(md5, str) and md5.endswith(".dir")):
        raise UserError(f"{cut(lock)}: out {cut(out['path'])} is not a folder out "
                        f"(md5 {cut(md5, limit=40)})")
    if out.get("hash") != "md5":
        raise UserError(f"{cut(lock)}: out {cut(out['path'])} carries DVC 2 hashes (md5-dos2unix), which cannot "
                        f"be checked; rerun its stage with DVC 3 to record 'hash: md5'")
    nfiles = out.get("nfiles")
    return DvcOut(stage, out["path"], md5, nfiles if isinstance(nfiles, int) else None)
