"""``distillery lineage PATH [--json] [--verify]``: show or check an artifact's lineage, offline.

- default: the lineage tree (the artifact and, recursively, every input it was made from).
- ``--json``: the manifest itself (lineage.json, pretty-printed).
- ``--verify``: rehash the artifact's files against the manifest; prints ``verified: N files``
  and exits 0, or prints each problem on its own line, then ``lineage check failed: N
  problem(s)``, and exits 2.

PATH is an artifact folder or its lineage.json. A missing or unreadable manifest is a user
error (one line, exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from distillery.errors import UserError


def add_lineage_command(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``lineage`` command to a top-level subparsers object (``func`` returns the exit code)."""
    p = subparsers.add_parser("lineage", help="show or verify which data, models, configs and code made an artifact")
    p.add_argument("path", metavar="PATH", help="artifact folder (or its lineage.json)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--json", action="store_true", help="print the manifest as JSON instead of the tree")
    mode.add_argument("--verify", action="store_true", help="rehash the artifact's files against its manifest")
    p.set_defaults(func=run_lineage)


def run_lineage(args: argparse.Namespace) -> int:
    """Entry point of ``distillery lineage``; returns 0, or 2 when ``--verify`` finds problems."""
    from distillery.lineage import lineage_tree, read_lineage, verify_lineage

    if args.verify:
        result = verify_lineage(args.path)
        if result.ok:
            sys.stdout.write(f"verified: {result.files} files\n")
            return 0
        for problem in result.problems:
            sys.stdout.write(problem + "\n")
        sys.stdout.write(f"lineage check failed: {len(result.problems)} problem(s)\n")
        return UserError.exit_code
    manifest = read_lineage(args.path)
    if args.json:
        sys.stdout.write(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(lineage_tree(manifest) + "\n")
    return 0
