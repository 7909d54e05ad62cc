"""Training entry point: ``distillery train --config X`` (one process) or
``torchrun --nproc_per_node N -m distillery.cli.train --config X`` (FSDP2 over N ranks).

Arguments: ``--config PATH``, ``--dry-run`` (build everything, print the resolved config, train
nothing), ``--allow-target-prefix PREFIX`` (repeatable), ``--allow-checkpoint PATH`` (repeatable:
grants ``training.checkpoint.resume`` a checkpoint outside the run's output folder), then dotted overrides
(``--training.loop.max_train_steps 10``). A user error prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

OVERRIDES_HELP = """\
overrides:
  After the options above, any key of the run config as a dotted option sets it, e.g.
    --training.loop.max_train_steps 10  --training.optimizer.learning_rate 1e-4
    --models.student.init_from PATH     --method.chunk_size=3
  The key must exist in the config (a key that does not is one error line naming the valid keys, exit 2);
  the value is YAML read as DVC reads it, 1.2 (10, 1e-4, true, null, [1, 2], {a: 1}; other text is a string);
  a value YAML 1.1 reads otherwise (010, yes, 1:30) is one error line saying how to write it."""


def build_parser() -> argparse.ArgumentParser:
    """``distillery train``'s options (the dotted overrides are the unknown arguments left after them)."""
    from distillery.cli.parser import Parser

    parser = Parser(prog="distillery train", description="Train from a run config in one process.\n`torchrun --nproc_per_node N -m "
                    "distillery.cli.train --config X` runs FSDP2 over N ranks (same options).", epilog=OVERRIDES_HELP,
                    usage="%(prog)s --config PATH [options] [--a.b.c VALUE ...]")
    parser.formatter_class = type("TrainHelp", (parser.formatter_class, argparse.RawDescriptionHelpFormatter), {})
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--dry-run", action="store_true", help="build everything, print the resolved config, train nothing")
    parser.add_argument("--allow-target-prefix", action="append", default=[], metavar="PREFIX",
                        help="also allow _target_ callables under this module prefix (repeatable; default: only distillery.)")
    parser.add_argument("--allow-checkpoint", action="append", default=[], metavar="PATH",
                        help="allow training.checkpoint.resume to load this checkpoint (or any under this folder) "
                             "from outside the run's output folder, once its checksums verify (repeatable; also "
                             "DISTILLERY_ALLOWED_CHECKPOINTS=a:b; default: none)")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    return build_parser().parse_known_args(argv)


def run_training(argv: list[str]) -> int:
    """Parse, load, build and train; returns the process exit code."""
    from distillery.common.log import setup_logging
    from distillery.config import allowed_prefixes, dump_run_config, load_run_config, parse_override_args

    args, rest = parse_args(argv)
    setup_logging()
    prefixes = allowed_prefixes(args.allow_target_prefix)
    from distillery.components.checkpoint.trust import grant_checkpoints

    grant_checkpoints(args.allow_checkpoint)
    config = load_run_config(args.config, parse_override_args(rest), prefixes)  # the roles: checked once, by build_run
    from distillery.components.distributed import init_distributed, shutdown

    env = init_distributed(config.training.distributed)
    setup_logging(env.rank)
    try:
        if args.dry_run:
            from distillery.engine.builder import build_run, check_data_path

            build_run(config, env)
            check_data_path(config.training.data.path)
            if env.is_main:
                sys.stdout.write(dump_run_config(config))
            return 0
        from distillery.engine.assemble import build_trainer

        result = build_trainer(config, env).fit()
        if env.is_main:
            from distillery.components.checkpoint.checksums import saved_at

            when = saved_at(result.checkpoint) if result.checkpoint is not None else None
            checkpoint = f"checkpoint {result.checkpoint}" + (f" (saved {when})" if when else "")  # a stale run shows
            if result.history:
                loss = result.history[-1].get("total_loss")
                shown = f"; loss {loss:.5f}" if loss is not None else ""
                sys.stdout.write(f"trained to step {result.final_step}; {checkpoint}{shown}\n")
            else:  # resumed a finished run: nothing trained, no loss to show
                sys.stdout.write(f"already complete at step {result.final_step}; {checkpoint}\n")
        return 0
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    from distillery.cli.guard import run_guarded

    if os.environ.get("TORCHELASTIC_RUN_ID"):  # a torchrun worker: never outlive the agent that started it
        from distillery.common.procutil import die_with_parent

        die_with_parent(signal.SIGKILL)

    from distillery.common.procutil import stop_on_sigterm

    with stop_on_sigterm():  # a stopped run ends its MLflow run KILLED (the trainer's `finally`), not RUNNING forever
        return run_guarded(lambda: run_training(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    from distillery.common.procutil import exit_now

    exit_now(main())
