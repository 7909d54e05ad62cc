"""``distillery params check [--params params.yaml]``: everything a stage refuses on ``params.yaml`` alone;
``distillery params profile FILE``: a profile's overrides as ``dvc exp run -S`` arguments."""

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
    profile = params_sub.add_parser("profile", help="print a profile's overrides (docs/profiles/*.yaml) as `dvc exp run` "
                                    "arguments, after checking them against params.yaml: dvc exp run $(distillery params profile FILE)")
    profile.add_argument("file", help="the profile: a YAML file with an `overrides:` mapping of dotted params.yaml keys")
    profile.add_argument("--params", default="params.yaml", help="the params file the overrides apply to")
    profile.set_defaults(func=_print_profile)
    from distillery.components.memory_plan import SHAPES

    memory = params_sub.add_parser("memory", help="each training stage's memory per GPU, estimated from the one-GPU peaks "
                                   "measured (docs/gpus.md), for params.yaml or a profile over it")
    memory.add_argument("profile", nargs="?", help="a profile (docs/profiles/*.yaml) applied over --params first")
    memory.add_argument("--model", required=True, choices=sorted(SHAPES), help="the shape of every role")
    memory.add_argument("--teacher-model", choices=sorted(SHAPES), help="the frozen teacher's shape, where it is another "
                        "(teacher.source base with teacher.path); default: --model")
    memory.add_argument("--params", default="params.yaml", help="the params file")
    memory.set_defaults(func=_print_memory)


def _check_params(args: argparse.Namespace) -> int:
    """Bounds (alias bombs, merge chains), a value DVC reads differently, the schema, a folder it names that its
    stage would refuse (``base.path`` not a model folder, ``latents.data`` without captions), a buffer no stage
    here could hold. Run it before ``dvc repro``, which parses the file with DVC's own parser first."""
    from distillery.pipeline.launch.preflight import check_batch, check_memory, check_paths, check_recipe_families
    from distillery.pipeline.launch.runner import STAGES
    from distillery.pipeline.launch.sparse_preflight import check_attention
    from distillery.pipeline.params.reader import Params
    from distillery.pipeline.publish.artifacts import ARTIFACTS

    params = Params.load(args.params)
    check_paths(params)
    check_recipe_families(params)  # a recipe the base's model family builds no student for
    check_batch("", params, ARTIFACTS, stages=tuple(STAGES), label=args.params)  # before any video is encoded
    for stage in STAGES:
        check_memory(stage, params)
    check_attention(params)  # every training stage's sparse student, on the video it trains on
    sys.stdout.write(f"{args.params}: ok: DVC and the stages read the same values, each within its bounds, "
                     f"the folders it names are what their stages read, every training batch fits the data, every "
                     f"stage's buffers fit this machine, and every sparse student can train so\n")
    from distillery.pipeline.params.recipes import chain_notes

    for note in chain_notes(params.typed, params.recipes):  # a chain that runs but is no recipe: said, not refused
        sys.stdout.write(f"note: {note}\n")
    return 0


def _print_profile(args: argparse.Namespace) -> int:
    """One line of ``-S key=value`` arguments (no quoting needed: a value with whitespace is refused)."""
    from distillery.pipeline.params.profile import dvc_set_args, load_profile

    sys.stdout.write(" ".join(dvc_set_args(load_profile(args.file, args.params))) + "\n")
    return 0


def _print_memory(args: argparse.Namespace) -> int:
    """One line per training stage: GiB per GPU and what they are made of (``pipeline/params/memory.py``)."""
    from distillery.components.memory_plan import SHAPES
    from distillery.pipeline.params.memory import format_rows, stage_memory

    if args.profile:
        from distillery.pipeline.params.profile import profiled_params

        typed = profiled_params(args.profile, args.params)[1]
    else:
        from distillery.pipeline.params.reader import Params

        typed = Params.load(args.params).typed
    shape, teacher = SHAPES[args.model], SHAPES[args.teacher_model] if args.teacher_model else None
    sys.stdout.write("\n".join(format_rows(stage_memory(typed, shape, teacher), shape, teacher)) + "\n")
    return 0
