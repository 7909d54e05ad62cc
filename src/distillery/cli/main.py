"""The ``distillery`` command: a table of subcommands, each built by its own module only when it runs.

    distillery train --config X [--dry-run] [--allow-target-prefix P] [--a.b.c VALUE ...]
    distillery stage NAME [--params FILE]
    distillery base make-tiny --out DIR [--fit | --shipped] [--seed N] [--overwrite]
    distillery clips make --out DIR [--seed N] ... | clips analyze --data DIR
    distillery preprocess --base MODEL --data DATA --out DIR [--frames N --height H --width W --fps F]
    distillery latents demo --out DIR [--num-samples N] [--seed N]
    distillery params check [--params params.yaml]
    distillery lineage PATH [--json | --verify ...]
    distillery export-weights CHECKPOINT --role student --out DIR [--ema NAME]
    distillery import-weights FILE --like MODEL --out DIR [--key NAME]
    distillery vbench prompts --config FILE [--out FILE] | vbench score --config FILE --videos DIR --out DIR

``distillery stage teacher`` imports the stage command's module and no other command's (so a
stage's ``dvc.yaml`` code deps hold only what it runs: editing ``lineage``'s CLI reruns nothing).
User errors (bad config, missing file, wrong checkpoint) print one line and exit with code 2
(:func:`distillery.cli.guard.run_guarded`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

from distillery.cli.guard import run_guarded
from distillery.cli.parser import Parser

# name -> (the module whose ``add_command(sub, name, help)`` builds it, the one-line help of ``distillery --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("distillery.cli.train", "train from a run config, with dotted overrides (--training.loop.max_train_steps "
              "10); `distillery train --help` for its options (one process; torchrun -m distillery.cli.train for N)"),
    "stage": ("distillery.cli.stage", "run one pipeline stage (what dvc.yaml calls)"),
    "base": ("distillery.cli.tinybase", "base models"),
    "clips": ("distillery.cli.clips", "synthetic captioned clips and prompt-adherence analysis"),
    "preprocess": ("distillery.cli.preprocess", "encode captioned videos into parquet latent shards"),
    "latents": ("distillery.cli.latents", "latent datasets"),
    "params": ("distillery.cli.params", "the pipeline's params.yaml (`distillery params check`: before `dvc repro`)"),
    "lineage": ("distillery.cli.lineage", "show or verify which data, models, configs and code made an artifact"),
    "export-weights": ("distillery.cli.export", "write a checkpoint role's transformer as a diffusers folder"),
    "vbench": ("distillery.cli.vbench", "VBench's quality dimensions and quality score of a folder of videos, as VBench "
               "computes them (`distillery vbench prompts` lists the videos a protocol needs)"),
    "import-weights": ("distillery.cli.import_weights", "a published Wan checkpoint (original key layout, e.g. "
                       "Self-Forcing's ode_init.pt) as a diffusers model folder"),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with every subcommand listed; only ``commands`` (default: all) are built
    in full, by importing their modules. ``train`` parses its own options (a stub here)."""
    wanted = set(COMMANDS) if commands is None else set(commands)
    parser = Parser(prog="distillery", description="train and distill video diffusion models")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if name == "train" or name not in wanted:
            sub.add_parser(name, help=help_text, add_help=False)
        else:
            importlib.import_module(module).add_command(sub, name, help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        from distillery.cli.train import run_training

        return run_guarded(lambda: run_training(argv[1:]))
    args = build_parser(argv[:1] if argv[:1] and argv[0] in COMMANDS else None).parse_args(argv)
    from distillery.common.log import setup_logging

    setup_logging()
    return run_guarded(lambda: args.func(args))


def entry() -> None:
    """The ``distillery`` console script: :func:`main`, then the process ends (:func:`~distillery.common.procutil.exit_now`)."""
    from distillery.common.procutil import exit_now

    exit_now(main())


if __name__ == "__main__":
    entry()
