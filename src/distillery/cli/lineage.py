"""``distillery lineage PATH [--json | --verify [--expect DIGEST] [--dvc-lock PATH] [--recursive]]``:
show or check an artifact's lineage, offline.

- default: the lineage tree (the artifact and, recursively, every input it was made from).
- ``--json``: the manifest itself (lineage.json, pretty-printed).
- ``--verify``: rehash the artifact's files and recompute the manifest digest (its seal). Prints
  ``manifest digest: <sha256 hex>``, then notes (``warning: manifest is unsealed ...`` for a
  manifest written before seals; what ``--dvc-lock`` / ``--recursive`` checked), then either
  ``verified: N files`` (exit 0) or each problem on its own line and ``lineage check failed: N
  problem(s)`` (exit 2).
- ``--expect DIGEST``: also fail unless the manifest digest equals DIGEST (a value kept
  elsewhere: published with the artifact, or embedded in a downstream manifest).
- ``--dvc-lock PATH``: also fail unless the DVC directory hash that PATH (a dvc.lock or .dvc file)
  records for the artifact folder matches the folder as it is now.
- ``--recursive``: also verify each upstream input present at its recorded path (relative to the
  current directory) and match its manifest against the one embedded in PATH's. An input outside the current
  directory is not opened; the last line then says how many were not checked (``not all verified: ...``).
- ``--outside`` (with ``--recursive``): also rehash the inputs read from outside ``artifacts/`` where they are (a
  given teacher, one's own videos, a prompts file: recorded file by file), outside the current directory too.

The seal alone catches edits of the manifest; files and manifest rewritten consistently are caught
only by ``--expect`` or ``--dvc-lock``. PATH is an artifact folder or its lineage.json. A missing,
unreadable or absurdly deep manifest, one the tree cannot show (``"outputs": 5``), a malformed DIGEST
or an unusable (or absurdly deep) dvc.lock is a user error (one line, exit 2). ``--verify`` also
refuses any code file in an artifact (an export: any but its own modules, each with the digest its manifest
records in ``config.shipped_code``) and any
``model_index.json`` entry naming code from outside diffusers/transformers.
"""

from __future__ import annotations

import argparse
import json
import sys

from distillery.common.errors import UserError


def add_command(subparsers: argparse._SubParsersAction, name: str, help: str) -> None:  # noqa: A002
    """Add the ``lineage`` command to a top-level subparsers object (``func`` returns the exit code)."""
    p = subparsers.add_parser(name, help=help)
    p.add_argument("path", metavar="PATH", help="artifact folder (or its lineage.json)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--json", action="store_true", help="print the manifest as JSON instead of the tree")
    mode.add_argument("--verify", action="store_true",
                      help="rehash the artifact's files and check the manifest's own digest")
    p.add_argument("--expect", metavar="DIGEST", default=None,
                   help="--verify: fail unless the manifest digest equals DIGEST (sha256 hex)")
    p.add_argument("--dvc-lock", metavar="LOCK", default=None,
                   help="--verify: check the folder against the DVC directory hash LOCK (dvc.lock or .dvc) records")
    p.add_argument("--recursive", action="store_true",
                   help="--verify: also verify upstream inputs present at their recorded paths")
    p.add_argument("--outside", action="store_true",
                   help="--verify --recursive: also rehash inputs read from outside the tree (a given model, your videos)")
    p.set_defaults(func=run_lineage)


def run_lineage(args: argparse.Namespace) -> int:
    """Entry point of ``distillery lineage``; returns 0, or 2 when ``--verify`` finds problems."""
    from distillery.lineage.manifest import read_lineage
    from distillery.lineage.render import lineage_tree
    from distillery.lineage.verify import verify_lineage

    extras = [flag for flag, on in (("--expect", args.expect is not None), ("--dvc-lock", args.dvc_lock is not None),
                                    ("--recursive", args.recursive), ("--outside", args.outside)) if on]
    if extras and not args.verify:
        verb = "applies" if len(extras) == 1 else "apply"
        raise UserError(f"{', '.join(extras)} only {verb} with --verify: "
                        f"distillery lineage PATH --verify {' '.join(extras)} ...")
    if args.verify:
        if args.outside and not args.recursive:
            raise UserError("--outside only applies with --recursive: distillery lineage PATH --verify --recursive --outside")
        result = verify_lineage(args.path, expect=args.expect, dvc_lock=args.dvc_lock, recursive=args.recursive,
                                outside=args.outside)
        lines = [f"manifest digest: {result.manifest_digest}", *result.notes]
        if result.ok and result.not_checked:
            n = len(result.not_checked)
            lines.append(f"not all verified: {result.files} files of the artifact verified; {n} input{'s' if n > 1 else ''} "
                         f"outside this folder not checked ({result.not_checked[0]}{', …' if n > 1 else ''}): --outside "
                         f"rehashes those read from outside artifacts/")
        elif result.ok:
            lines.append(f"verified: {result.files} files")
        else:
            lines.extend(result.problems)
            lines.append(f"lineage check failed: {len(result.problems)} problem(s)")
        sys.stdout.write("\n".join(lines) + "\n")
        return 0 if result.ok else UserError.exit_code
    manifest = read_lineage(args.path)
    if args.json:
        sys.stdout.write(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    else:
        try:
            tree = lineage_tree(manifest)
        except UserError as exc:
            raise UserError(f"{args.path}: {exc}") from None
        sys.stdout.write(tree + "\n")
    return 0
