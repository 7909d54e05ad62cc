"""Crash-safe file-system publishing: outputs are written to a temporary sibling, then renamed.

A reader (or a rerun after a kill) sees either the previous complete output or the new complete
output, never a half-written one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def replace_dir(staging: Path, final: Path) -> Path:
    """Rename the folder ``staging`` to ``final`` (same file system), replacing a folder there.

    The old folder is first moved aside into a temporary sibling and deleted only after the rename
    succeeded; if the rename fails it is put back. Returns ``final``.
    """
    staging, final = Path(staging), Path(final)
    if not final.exists():
        os.replace(staging, final)
        return final
    trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    os.replace(final, trash / "old")
    try:
        os.replace(staging, final)
    except BaseException:
        os.replace(trash / "old", final)
        raise
    finally:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
