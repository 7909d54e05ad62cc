"""Which checkpoints of an output folder distillery wrote: ``<output_dir>/checkpoints.json``.

A folder named ``checkpoint-<N>`` proves nothing about who made it: it may be copied in, left by
another tool, or belong to an earlier run of an older distillery. Resuming (``resume: latest``) and
pruning (``keep_last``) act only on the checkpoints this record names, so a run never deletes a
folder it did not write and never resumes one by its name alone (docs/reliability.md). A checkpoint
the record does not name is left alone and said once in one warning line; it can still be resumed on
purpose by naming its path (``training.checkpoint.resume``).

Format: ``{"written": ["checkpoint-4", "checkpoint-8"]}``, rewritten atomically by rank 0. A name is
added *before* its folder is renamed into place, so a crash between the two leaves a name whose
folder is absent or incomplete (never counted: a checkpoint needs its ``metadata.json``), never a
complete checkpoint the record forgot. A name is removed after its folder is deleted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from distillery.common.fsutil import read_json_file, write_text_atomic
from distillery.common.log import get_logger

log = get_logger("checkpoint")

RECORD_FILE = "checkpoints.json"
MAX_RECORD_BYTES = 4 << 20
_NAME = re.compile(r"^checkpoint-\d+$")
_WARNED: set[tuple[str, str]] = set()  # (folder, name) this process already reported


def written(output_dir: str | Path) -> set[str]:
    """The checkpoint folder names the record of ``output_dir`` lists (empty when it has none). A
    record that is unreadable or of another shape lists nothing, said in one warning line: nothing is
    then resumed or pruned by name (the next save rewrites it)."""
    path = Path(output_dir) / RECORD_FILE
    try:
        data = read_json_file(path, MAX_RECORD_BYTES)
    except FileNotFoundError:
        return set()
    except (OSError, ValueError) as exc:
        _warn_once(str(path), "record", f"checkpoint record {path} is unreadable ({exc}): no checkpoint of "
                   f"{output_dir} is resumed or pruned by name; the next save rewrites it")
        return set()
    names = data.get("written") if isinstance(data, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) and _NAME.match(n) for n in names):
        _warn_once(str(path), "record", f"checkpoint record {path} is not a list of checkpoint names: no checkpoint "
                   f"of {output_dir} is resumed or pruned by name; the next save rewrites it")
        return set()
    return set(names)


def _write(output_dir: Path, names: set[str]) -> None:
    ordered = sorted(names, key=lambda n: int(n.split("-", 1)[1]))
    write_text_atomic(output_dir / RECORD_FILE, json.dumps({"written": ordered}, indent=1) + "\n")


def add(output_dir: str | Path, name: str) -> None:
    """Record ``name`` (before its folder is renamed into place)."""
    output_dir = Path(output_dir)
    _write(output_dir, written(output_dir) | {name})


def forget(output_dir: str | Path, names: set[str]) -> None:
    """Drop ``names`` from the record (after their folders were deleted)."""
    output_dir = Path(output_dir)
    before = written(output_dir)
    if before & names:
        _write(output_dir, before - names)


def report_foreign(output_dir: str | Path, names: list[str]) -> None:
    """One warning line per checkpoint-named folder of ``output_dir`` that the record does not name."""
    for name in names:
        _warn_once(str(output_dir), name, f"{Path(output_dir) / name} was not written by a run of this folder (no entry in "
                   f"{RECORD_FILE}): left alone — not resumed, not pruned; to start from it, name its path in "
                   "training.checkpoint.resume")


def _warn_once(where: str, what: str, message: str) -> None:
    if (where, what) not in _WARNED:
        _WARNED.add((where, what))
        log.warning("%s", message)
