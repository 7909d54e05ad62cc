"""``distillery stage NAME [--params FILE]``: run one pipeline stage (what ``dvc.yaml`` calls)."""

from __future__ import annotations

import argparse


def add_command(sub: argparse._SubParsersAction, name: str, help: str) -> None:  # noqa: A002
    """``stage`` on the top-level subparsers; the stage names come from the runner's table (no stage is imported)."""
    from distillery.pipeline.launch.runner import STAGES

    p = sub.add_parser(name, help=help)
    p.add_argument("name", help=" | ".join(STAGES))
    p.add_argument("--params", default="params.yaml", help="the pipeline's params file (validated whole first)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from distillery.pipeline.launch.runner import run_stage

    return run_stage(args.name, args.params)
