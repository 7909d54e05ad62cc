"""Hashing an artifact's files: listing a folder without following links (:func:`scan`), hashing every
regular file (:func:`hash_tree`, through the stages' hash cache; :func:`hash_listing`, one uncached read
for verification), pinning a file list with one digest (:func:`tree_digest`) and comparing a recorded
file list with a freshly hashed one (:func:`compare_files`).

An artifact holds regular files and folders only: a symlink (to a file or a folder) or a special file
anywhere in it is refused (:func:`hash_tree` raises :class:`UserError`; :func:`scan` lists it as
``refused``); it is never followed, but for an external input (``follow_links``, e.g. a Hugging Face
cache snapshot), whose links are hashed by content.

Stdlib only (+ :mod:`distillery.common`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.common.hashcache import file_sha256, flush_active, read_sha256
from distillery.lineage.contract import LINEAGE_FILE, cut

_CHUNK = 1 << 20  # bytes read per hashing step


def hash_file(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes, read in 1 MiB chunks (constant memory); never cached."""
    return read_sha256(path)


@dataclasses.dataclass
class Listing:
    """What :func:`scan` found under a folder."""

    files: dict[str, Path]  # relative POSIX path -> path of each regular file
    refused: list[tuple[str, str]]  # (relative path, why) of each symlink / special file, not followed


def real_path(path: str | Path) -> Path:
    """``path`` with every symbolic link resolved, never raising on a loop (``Path.resolve`` raises
    ``RuntimeError``; a loop stays unresolved here and is refused by the caller as a link it cannot follow)."""
    return Path(os.path.realpath(path))


def scan(folder: Path, exclude: Iterable[str] = (), *, follow_links: bool = False) -> Listing:
    """Every entry under ``folder``.

    Regular files are listed by relative POSIX path (hidden ones included); ``exclude`` names are
    skipped at the top level only, and only when they are regular files. By default a symlink (to
    a file or a folder) is ``refused`` and never followed; special files (FIFOs, sockets,
    devices) always are. ``follow_links`` (external inputs only, e.g. a Hugging Face cache
    snapshot) lists a linked file as that file and enters a linked folder, refusing a link that
    leads back into its own ancestors (a loop) or nowhere.
    """
    excluded = set(exclude)
    listing = Listing({}, [])
    stack: list[tuple[str, Path, tuple[Path, ...]]] = [("", folder, (real_path(folder),) if follow_links else ())]
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
                real = real_path(e.path) if follow_links else None
                if real is not None and os.path.isdir(e.path) and real not in ancestors:
                    stack.append((rel + "/", Path(e.path), (*ancestors, real)))
                    continue
                try:
                    target = os.readlink(e.path)
                except OSError:
                    target = "?"
                loop = "; a loop" if real is not None and real in ancestors else ""
                listing.refused.append((rel, f"symlink -> {cut(target, limit=60)}{loop}"))
            elif e.is_dir(follow_symlinks=False):
                real = (real_path(e.path),) if follow_links else ()
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
        raise UserError(f"not a folder: {cut(folder)}")
    listing = scan(folder, exclude, follow_links=follow_symlinks)
    if listing.refused:
        rel, why = listing.refused[0]
        count = len(listing.refused)
        entries = f"{count} such entr{'y' if count == 1 else 'ies'}"
        if follow_symlinks:  # a folder of the user's (a stage's input read from outside artifacts/), not an artifact
            raise UserError(f"{cut(folder)} holds {cut(rel)} ({why}): it cannot be read as an input (links are followed "
                            f"to files and folders, never around a loop or to nothing); remove or fix it ({entries}); "
                            "nothing was read or written")
        raise UserError(f"{cut(folder)} holds {cut(rel)} ({why}): refused, an artifact holds regular files and "
                        f"folders only; copy the real file in ({entries})")
    try:
        entries = [_entry(rel, listing.files[rel]) for rel in sorted(listing.files)]
    except OSError as exc:
        raise UserError(f"cannot read a file under {cut(folder)}: {cut(exc)}") from None
    flush_active()
    return entries


def tree_digest(entries: Iterable[Mapping[str, Any]]) -> str:
    """sha256 hex of the canonical JSON of a file list (``path``/``sha256``/``bytes`` per entry,
    sorted by path): one digest that pins a whole folder."""
    canon = sorted(({"path": e.get("path"), "sha256": e.get("sha256"), "bytes": e.get("bytes")}
                    for e in entries), key=lambda e: str(e["path"]))
    text = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def compare_files(recorded: Sequence[Any], actual: Sequence[Mapping[str, Any]], refused: Iterable[str] = ()) -> list[str]:
    """Problems between a recorded file list and a freshly hashed one: changed, missing,
    unexpected (new) files, and malformed recorded entries; sorted by path within each kind. A
    recorded path at or under a ``refused`` entry (already reported) is not reported missing."""
    problems: list[str] = []
    rec: dict[str, Mapping[str, Any]] = {}
    for i, e in enumerate(recorded):
        if not (isinstance(e, Mapping) and isinstance(e.get("path"), str) and isinstance(e.get("sha256"), str)):
            problems.append(f"malformed outputs entry #{i}: {cut(repr(e))}")
            continue
        rec[e["path"]] = e
    act = {e["path"]: e for e in actual}
    shadowed = tuple(refused)
    for rel in sorted(rec):
        r = rec[rel]
        a = act.get(rel)
        if a is None:
            if not any(rel == s or rel.startswith(s + "/") for s in shadowed):
                problems.append(f"missing: {cut(rel)}")
        elif a["sha256"] != r["sha256"]:
            size = "" if r.get("bytes") in (None, a["bytes"]) else f"; {a['bytes']} bytes != recorded {r['bytes']}"
            problems.append(f"changed: {cut(rel)} (sha256 {a['sha256'][:12]}… != recorded "
                            f"{str(r['sha256'])[:12]}…{size})")
    for rel in sorted(set(act) - set(rec)):
        problems.append(f"unexpected: {cut(rel)} (new file, not in the recorded outputs)")
    return problems


# ---------------------------------------------------------------------------------------------
# writing


def hash_listing(listing: Listing, *, with_md5: bool) -> tuple[list[dict[str, Any]], dict[str, str], list[str]]:
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
