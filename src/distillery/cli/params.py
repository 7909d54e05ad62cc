"""``distillery params check [--params params.yaml]``: everything a stage refuses on ``params.yaml`` alone."""

from __future__ import annotations

import argparse
import sys


def add_command(sub: argparse._SubParsersAction, name: str, help: str) -> None:  # noqa: A002
    """``params check`` on the top-level subparsers."""
    params = sub.add_parser(name, help=help)
    params_sub = params.add_subparsers(dest="params_command", required=True, metavar="COMMAND")
    check = params_sub.add_parser("check", help="check params.yaml as DVC and every stage read it, in one line per "
                                  "problem (exit 2); run it before `dvc repro`, which hangs on an alias bomb")
    check.add_argument("--params", default="params.yaml", help="the params file to check")
    check.set_defaults(func=_check_params)


def _check_params(args: argparse.Namespace) -> int:
    """Bounds (alias bombs, merge chains), a value DVC reads differently, the schema, a folder it names that its
    stage would refuse (``base.path`` not a model folder, ``latents.data`` without captions), a buffer no stage
    here could hold. Run it before ``dvc repro``, which parses the file with DVC's own parser first."""
    from distillery.stages.params import Params
    from distillery.stages.preflight import check_memory, check_paths
    from distillery.stages.runner import STAGES

    params = Params.load(args.params)
    check_paths(params)
    for stage in STAGES:
        check_memory(stage, params)
    sys.stdout.write(f"{args.params}: ok: DVC and the stages read the same values, each within its bounds, "
                     f"the folders it names are what their stages read, and every stage's buffers fit this machine\n")
    return 0
