"""Verifying artifacts against their lineage.json: one artifact (:func:`verify_lineage`, ``distillery
lineage --verify``) and a whole chain before it ships (:func:`verify_chain`).

Trust model of :func:`verify_lineage`:

- offline and path-independent: it rehashes the artifact's own files by relative path, recomputes
  the manifest digest, and checks embedded input manifests for internal consistency (recorded
  files digest and seal); a copy of the folder on another machine verifies the same.
- the seal catches any edit of the manifest that does not also recompute the digest (changed
  params, a file's hash edited to match a changed file, an entry deleted with its file). It holds
  no secret: someone who edits files AND rewrites the manifest consistently, seal included,
  passes the self-check. That is caught only against a value recorded elsewhere: ``expect`` (the
  manifest digest published with the artifact, or the one embedded in a downstream manifest) or
  ``dvc_lock`` (the DVC directory hash that ``dvc repro`` recorded for the artifact folder,
  ``lineage.json`` included).
- ``recursive`` also checks each upstream input found at its recorded path (relative to the
  current directory) against its own manifest, and that manifest against the one embedded here.
- manifests written before the seal existed verify with a warning (``unsealed``), and never
  satisfy ``expect``.
- an artifact carries no code (:mod:`distillery.lineage.artifact_code`): a code file anywhere in it is
  ``refused`` — but an export's own recorded modules —, and so is a ``model_index.json`` entry naming a
  module outside diffusers/transformers — but an export's own recorded pipeline.

:func:`verify_chain` (the export stage, before it publishes) reads every byte of its input
artifacts and of every upstream artifact present, against their own manifests and the embedded
ones: the stages' hash cache, like DVC, trusts size and mtime, and this does not.

Stdlib (+ PyYAML to read a dvc.lock) only; it never imports DVC or Prefect.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.common.fsutil import file_kind
from distillery.lineage.artifact_code import code_problems
from distillery.lineage.contract import DIGEST_KEY, LINEAGE_FILE, cut
from distillery.lineage.dvc_outs import dvc_dir_hash, find_dvc_out
from distillery.lineage.hashing import Listing, compare_files, hash_listing, real_path, scan, tree_digest
from distillery.lineage.manifest import manifest_digest, read_lineage, seal_problem


@dataclasses.dataclass
class VerifyResult:
    """Outcome of :func:`verify_lineage`: ``ok`` iff ``problems`` is empty."""

    ok: bool  # no problem found
    problems: list[str]  # one readable line per problem, naming the file by relative path
    files: int = 0  # output files recorded in the manifest (each rehashed)
    manifest_digest: str = ""  # manifest_digest() of lineage.json as it is now
    sealed: bool = False  # the manifest records its own digest (manifest_sha256)
    notes: list[str] = dataclasses.field(default_factory=list)  # informational lines and warnings
    bytes_read: int = 0  # bytes of the artifact's own files read to rehash them
    # --recursive: inputs read from outside this tree (a given model, one's own videos) whose files were not read here
    not_checked: list[str] = dataclasses.field(default_factory=list)


def _check_inputs(inputs: Any, chain: str, problems: list[str]) -> None:
    """Internal consistency of embedded input entries, recursively (no input path is opened):
    recorded digest == digest of the recorded file list, and each sealed embedded manifest's
    seal matches its content."""
    if not isinstance(inputs, list):
        problems.append(f"malformed inputs{' of ' + chain if chain else ''}: expected a list")
        return
    for i, inp in enumerate(inputs):
        if not isinstance(inp, Mapping):
            problems.append(f"malformed input #{i}{' of ' + chain if chain else ''}: {cut(repr(inp))}")
            continue
        name = f"{chain}/{inp.get('role')}" if chain else str(inp.get("role"))
        label = f"input {cut(name, limit=60)} ({cut(inp.get('path'))})"
        sub = inp.get("lineage")
        if isinstance(sub, Mapping):
            entries = sub.get("outputs")
            broken_seal = seal_problem(sub)
            if broken_seal:
                problems.append(f"{label}: embedded {broken_seal}")
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


@dataclasses.dataclass
class _FolderCheck:
    """An artifact folder checked against its own lineage.json."""

    manifest: dict[str, Any]  # the manifest as read
    result: VerifyResult  # its files, its seal (and embedded inputs when asked)
    md5s: dict[str, str]  # relative path -> md5 of every readable regular file (when asked)


def _check_folder(folder: Path, *, embedded: bool, with_md5: bool = False) -> _FolderCheck:
    """Seal, refused entries (symlinks, special files), then changed / missing / unexpected
    files of ``folder`` against its lineage.json; embedded input manifests when ``embedded``."""
    manifest = read_lineage(folder)
    problems: list[str] = []
    broken_seal = seal_problem(manifest)
    if broken_seal:
        problems.append(broken_seal)
    listing = scan(folder, (LINEAGE_FILE,))
    problems.extend(f"refused: {cut(rel)} ({why}; an artifact holds regular files only, never followed)"
                    for rel, why in listing.refused)
    recorded = manifest.get("outputs")
    if not isinstance(recorded, list):
        problems.append("malformed outputs: expected a list")
        recorded = []
    actual, md5s, unreadable = hash_listing(listing, with_md5=with_md5)
    problems.extend(code_problems(listing, manifest, {e["path"]: e["sha256"] for e in actual}))
    problems.extend(f"unreadable: {cut(rel)}" for rel in unreadable)
    problems.extend(compare_files(recorded, actual, [rel for rel, _ in listing.refused] + unreadable))
    if embedded:
        _check_inputs(manifest.get("inputs"), "", problems)
    sealed = DIGEST_KEY in manifest
    notes = [] if sealed else [
        "warning: manifest is unsealed (no manifest_sha256; written before manifests were sealed): its files are "
        "checked, its own content is not; rerun the stage that wrote it to seal it"]
    result = VerifyResult(ok=not problems, problems=problems, files=len(recorded),
                          manifest_digest=manifest_digest(manifest), sealed=sealed, notes=notes,
                          bytes_read=sum(e["bytes"] for e in actual))
    return _FolderCheck(manifest, result, md5s)


def _parse_expect(expect: str) -> str:
    want = str(expect).strip().lower().removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{64}", want):
        raise UserError(f"expected manifest digest '{cut(expect, limit=80)}' is not a sha256 hex digest "
                        "(64 hex characters, as printed after 'manifest digest:' by `distillery lineage PATH "
                        "--verify`)")
    return want


def _check_dvc(folder: Path, lock: str | Path, check: _FolderCheck, problems: list[str], notes: list[str]) -> None:
    recorded = check.manifest.get("artifact")
    out = find_dvc_out(lock, folder, recorded if isinstance(recorded, str) else None)
    md5s = dict(check.md5s)
    lineage_file = folder / LINEAGE_FILE
    if lineage_file.is_file() and not lineage_file.is_symlink():
        md5s[LINEAGE_FILE] = hashlib.md5(lineage_file.read_bytes(), usedforsecurity=False).hexdigest()
    actual = dvc_dir_hash(md5s)
    where = f"{cut(lock)}" + (f" (stage {cut(out.stage, limit=40)})" if out.stage else "")
    if actual != out.md5:
        counts = "" if out.nfiles in (None, len(md5s)) else f"; {len(md5s)} files now, {out.nfiles} recorded"
        problems.append(f"dvc: {cut(folder)} hashes to {actual} but {where} records {out.md5} for "
                        f"{cut(out.path)}{counts} (changed after DVC recorded it)")
    else:
        notes.append(f"dvc: {cut(folder)} matches {out.md5} recorded for {cut(out.path)} in {where}")


# -- upstream inputs present in the workspace ---------------------------------------------------


def _iter_inputs(inputs: Any, chain: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(role chain, entry) of every embedded input, depth first."""
    if not isinstance(inputs, list):
        return
    for inp in inputs:
        if not isinstance(inp, Mapping):
            continue
        name = f"{chain}/{inp.get('role')}" if chain else str(inp.get("role"))
        yield name, inp
        sub = inp.get("lineage")
        if isinstance(sub, Mapping):
            yield from _iter_inputs(sub.get("inputs"), name)


def _outside_tree(p: Path, root: Path) -> bool:
    """Whether ``p``, every link resolved, lies outside the folder ``root`` (resolved)."""
    real = real_path(p)
    return real != root and root not in real.parents


def _check_present_input(name: str, inp: Mapping[str, Any], problems: list[str], notes: list[str],
                         outside: bool = False, not_checked: list[str] | None = None) -> None:
    """Check one recorded input where it is — only inside the tree being verified (the current directory):
    a crafted lineage naming ``/``, ``/etc`` or ``/proc/kmsg`` gets a note and nothing is opened (its path is added to
    ``not_checked``); an input inside it that is not a folder or a regular file (a FIFO, a device) is a problem, never
    read. ``outside`` (``--outside``: asked for): an input without a lineage read from outside the tree — a given
    teacher, one's own videos — is opened there too (a folder or a regular file only, never a FIFO or a device)."""
    path = str(inp.get("path"))
    label = f"input {cut(name, limit=60)} ({cut(path)})"
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        notes.append(f"{label}: not present, checked from the embedded manifest only")
        return
    root = real_path(Path.cwd())
    if _outside_tree(p, root) and not (outside and not isinstance(inp.get("lineage"), Mapping)):
        if not_checked is not None:
            not_checked.append(path)
        notes.append(f"{label}: outside the tree being verified ({cut(str(root))}): not opened, checked from the "
                     "embedded manifest only (verify it where it is)")
        return
    try:
        mode = os.stat(p).st_mode
    except OSError as exc:
        problems.append(f"{label}: cannot be read ({exc.strerror or exc}; a symbolic link loop?)")
        return
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        problems.append(f"{label}: is {file_kind(mode)}, not an artifact: not read")
        return
    sub = inp.get("lineage")
    if isinstance(sub, Mapping):
        if not (p / LINEAGE_FILE).is_file():
            problems.append(f"{label}: present but holds no {LINEAGE_FILE}")
            return
        try:
            check = _check_folder(p, embedded=False)
        except UserError as exc:
            problems.append(f"{label}: {exc}")
            return
        res, expected = check.result, manifest_digest(sub)
        problems.extend(f"{label}: {q}" for q in res.problems)
        if res.manifest_digest != expected:
            problems.append(f"{label}: its manifest digest {res.manifest_digest[:12]}… != {expected[:12]}… "
                            f"embedded here (changed or rerun after this artifact was made)")
        elif res.ok:
            notes.append(f"{label}: verified: {res.files} files, manifest matches the embedded one")
        return
    files = inp.get("files")
    if not isinstance(files, list):
        return  # reported by _check_inputs
    if p.is_file():
        listing = Listing({p.name: p}, [])
    else:
        listing = scan(p, (LINEAGE_FILE,), follow_links=True)
    actual, _, unreadable = hash_listing(listing, with_md5=False)
    found = [f"refused: {cut(rel)} ({why})" for rel, why in listing.refused]
    found += [f"unreadable: {cut(rel)}" for rel in unreadable]
    found += compare_files(files, actual, [rel for rel, _ in listing.refused] + unreadable)
    problems.extend(f"{label}: {q}" for q in found)
    if not found:
        notes.append(f"{label}: verified: {len(files)} files (external, no lineage)")


def _check_upstream(manifest: Mapping[str, Any], problems: list[str], notes: list[str], outside: bool = False,
                    not_checked: list[str] | None = None) -> None:
    """Each embedded input found at its recorded path (relative to the current directory):
    its files against its own manifest and that manifest against the embedded one (external
    inputs: their files against the recorded list). Each (path, embedded content) once."""
    seen: set[tuple[str, str]] = set()
    for name, inp in _iter_inputs(manifest.get("inputs"), ""):
        if not isinstance(inp.get("path"), str) or not inp["path"]:
            continue
        sub = inp.get("lineage")
        key = (inp["path"], manifest_digest(sub) if isinstance(sub, Mapping) else str(inp.get("sha256")))
        if key in seen:
            continue
        seen.add(key)
        _check_present_input(name, inp, problems, notes, outside, not_checked)


def verify_lineage(artifact_dir: str | Path, *, expect: str | None = None, dvc_lock: str | Path | None = None,
                   recursive: bool = False, outside: bool = False) -> VerifyResult:
    """Check an artifact folder against its own lineage.json, offline and path-independent.

    Always: recomputes the manifest digest and checks the seal (``manifest_sha256``); reports
    each symlink or special file (``refused``, never followed) and each ``changed``, ``missing``
    or ``unexpected`` file by relative path, hidden files included; checks every embedded input
    manifest for internal consistency (digest of its recorded file list, its seal). An unsealed
    manifest (written before seals) adds a warning note instead of a problem.

    ``expect``: the manifest digest must equal this sha256 hex (an unsealed manifest never
    does). ``dvc_lock``: the DVC 3 directory hash recorded for this folder in that dvc.lock (or
    .dvc file) must match the folder as it is now, ``lineage.json`` included. These two catch
    files and manifest rewritten consistently, which the seal alone cannot (see the module
    docstring). ``recursive``: also check each upstream input present at its recorded path
    (relative to the current directory) against its own manifest, and that manifest's digest
    against the one embedded here; absent inputs get a note; an input outside the current directory is not opened
    (``not_checked``) unless ``outside`` asks for the ones without a lineage (read from outside ``artifacts/``). Raises :class:`UserError` if
    there is no readable manifest, ``expect`` is not a digest, or the dvc.lock is unusable.
    """
    want = _parse_expect(expect) if expect is not None else None
    folder = Path(artifact_dir)
    if folder.is_file() and folder.name == LINEAGE_FILE:
        folder = folder.parent
    check = _check_folder(folder, embedded=True, with_md5=dvc_lock is not None)
    res = check.result
    if want is not None:
        if not res.sealed:
            res.problems.append("manifest is unsealed (no manifest_sha256), so it cannot match the expected digest")
        elif res.manifest_digest != want:
            res.problems.append(f"manifest digest {res.manifest_digest[:12]}… != expected {want[:12]}… "
                                f"(not the manifest that was recorded)")
        else:
            res.notes.append("manifest digest matches the expected one")
    if dvc_lock is not None:
        _check_dvc(folder, dvc_lock, check, res.problems, res.notes)
    if recursive:
        _check_upstream(check.manifest, res.problems, res.notes, outside, res.not_checked)
    res.ok = not res.problems
    return res


# -- the whole chain, before it ships ---------------------------------------------------------


@dataclasses.dataclass
class ChainCheck:
    """Outcome of :func:`verify_chain`: ``ok`` iff ``problems`` is empty."""

    problems: list[str]  # one line per problem, each naming the artifact by its path
    failed: list[str]  # the path of each artifact with a problem, in the order found
    digests: dict[str, str]  # normalised path of each artifact checked -> its manifest digest
    contents: dict[str, str] = dataclasses.field(default_factory=dict)  # same paths -> tree_digest of its outputs
    files: int = 0  # files rehashed
    bytes_read: int = 0  # bytes read to rehash them
    seconds: float = 0.0  # wall time of the check
    not_present: list[str] = dataclasses.field(default_factory=list)  # upstream artifacts absent here (not read)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_chain(folders: Sequence[str | Path]) -> ChainCheck:
    """Read every byte of each artifact in ``folders`` and of every upstream artifact their
    manifests embed that is present at its recorded path (relative to the current directory), and
    check each against its own lineage.json (seal, files, code files; as ``--verify``, never the
    hash cache), and its recorded files against those of the manifest embedded downstream: an
    upstream artifact whose content is not what its consumer was made from is a problem; one whose
    record alone differs (an older copy of the same bytes: other times and run ids) is not.

    Each artifact folder is read once however often the chain names it (the base under latents,
    teacher and export). Inputs without a lineage (an external base folder, a user's videos) are not
    read: the artifact made from them pins their digest. A listed folder that is absent or holds no
    lineage.json is a problem; an absent upstream one is listed in ``not_present``."""
    import time

    started = time.perf_counter()
    check = ChainCheck(problems=[], failed=[], digests={})

    def fail(path: str, problem: str) -> None:
        check.problems.append(problem)
        if path not in check.failed:
            check.failed.append(path)

    def content(manifest: Mapping[str, Any]) -> str:
        outputs = manifest.get("outputs")
        return tree_digest(e for e in outputs if isinstance(e, Mapping)) if isinstance(outputs, list) else "?"

    queue: list[tuple[str, str, str | None, str]] = [(str(f), os.path.normpath(f), None, "") for f in folders]
    while queue:
        shown, key, expected, made_into = queue.pop(0)
        if key not in check.digests:
            p = Path(key)
            if not (p / LINEAGE_FILE).is_file() or p.is_symlink():
                if expected is None or p.exists() or p.is_symlink():
                    fail(shown, f"{cut(shown)}: no {LINEAGE_FILE} (not an artifact of this pipeline)")
                elif key not in check.not_present:
                    check.not_present.append(key)
                continue
            try:
                folder = _check_folder(p, embedded=True)
            except UserError as exc:
                fail(shown, f"{cut(shown)}: {exc}")
                continue
            check.digests[key] = folder.result.manifest_digest
            check.contents[key] = content(folder.manifest)
            check.files += folder.result.files
            check.bytes_read += folder.result.bytes_read
            found = folder.result.problems
            if found:
                more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
                fail(shown, f"{cut(shown)} does not match its {LINEAGE_FILE}: {found[0]}{more}")
            for inp in folder.manifest.get("inputs") or []:
                if isinstance(inp, Mapping) and isinstance(inp.get("lineage"), Mapping) and isinstance(inp.get("path"), str):
                    queue.append((inp["path"], os.path.normpath(inp["path"]), content(inp["lineage"]), shown))
        if expected is not None and key in check.contents and check.contents[key] != expected:
            fail(shown, f"{cut(shown)}: its files (sha256 {check.contents[key][:12]}…) are not the ones "
                        f"{cut(made_into)} was made from ({expected[:12]}…): rerun or replaced after it")
    check.problems = list(dict.fromkeys(check.problems))
    check.seconds = time.perf_counter() - started
    return check
