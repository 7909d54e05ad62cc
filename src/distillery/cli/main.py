"""The ``distillery`` command.

    distillery train --config X [--dry-run] [--allow-target-prefix P] [--a.b.c VALUE ...]
    distillery base make-tiny --out DIR [--seed N] [--overwrite]
    distillery base make-tiny --fit --out DIR [--seed N] [--vae-seconds S] [--dit-steps N]
    distillery clips make --out DIR [--seed N] ...
    distillery preprocess --base MODEL --data DATA --out DIR [--frames N --height H --width W --fps F]
    distillery latents demo --out DIR [--num-samples N] [--seed N]
    distillery export-weights CHECKPOINT --role student --out DIR [--ema NAME]
    distillery params check [--params params.yaml]

User errors (bad config, missing file, wrong checkpoint) print one line and exit with code 2
(:func:`distillery.cli.guard.run_guarded`). Every parser is a :class:`Parser`: each option's help shows
its default (:class:`HelpFormatter`); tests/test_cli_help.py walks them all.
"""

from __future__ import annotations

import argparse
import sys

from distillery.common.errors import UserError
from distillery.cli.guard import run_guarded


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends each option with ``(default: X)``; not for required options, flags (``store_true``:
    off unless given), a default of None or an empty list (repeatable, none given): there the help text
    says what leaving the option out does."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default in (None, []) or isinstance(action, argparse._StoreTrueAction):
            return action.help or ""
        return super()._get_help_string(action) or ""


class Parser(argparse.ArgumentParser):
    """The CLI's parser: :class:`HelpFormatter` by default, for its subcommands too (``add_subparsers``
    makes them of this class)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 (argparse's own signature)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

def _make_tiny(args: argparse.Namespace) -> int:
    from pathlib import Path

    command = " ".join(["distillery", *sys.argv[1:]]) if sys.argv[1:2] == ["base"] else None
    if args.fit and args.shipped:
        raise UserError("choose one of --fit and --shipped")
    if args.shipped:
        from distillery.tinybase.shipped import copy_shipped_tiny_base

        out = copy_shipped_tiny_base(Path(args.out), overwrite=args.overwrite)
        sys.stdout.write(f"copied the shipped fitted tiny Wan base to {out} (model card: {out / 'README.md'})\n")
        return 0
    if args.fit:
        from distillery.tinybase.fit import FitConfig, fit_tiny_base

        cfg = FitConfig(seed=args.seed, vae_seconds=args.vae_seconds)
        if args.dit_steps is not None:
            cfg.dit.steps = args.dit_steps
        if args.vae_steps is not None:
            cfg.vae_steps = args.vae_steps
            cfg.vae_warmup_steps = min(cfg.vae_warmup_steps, max(1, args.vae_steps // 4))
        if args.eval_prompts is not None:
            cfg.eval.max_prompts = args.eval_prompts
        if args.eval_steps is not None:
            cfg.eval.num_inference_steps = args.eval_steps
        if args.num_train_clips is not None:
            cfg.num_train_clips = args.num_train_clips
        if args.num_validation_clips is not None:
            cfg.num_validation_clips = args.num_validation_clips
        if args.batch_size is not None:
            cfg.dit.batch_size = args.batch_size
        out = fit_tiny_base(Path(args.out), cfg, overwrite=args.overwrite, command=command,
                            work_dir=Path(args.work_dir) if args.work_dir else None)
        sys.stdout.write(f"wrote fitted tiny Wan base model to {out} (model card: {out / 'README.md'})\n")
        return 0
    from distillery.tinybase.tiny import make_tiny_base

    out = make_tiny_base(Path(args.out), seed=args.seed, overwrite=args.overwrite, command=command)
    sys.stdout.write(f"wrote tiny Wan base model to {out}\n")
    return 0


def _demo_latents(args: argparse.Namespace) -> int:
    from pathlib import Path

    from distillery.data.demo import make_demo_latents

    out = make_demo_latents(Path(args.out), num_samples=args.num_samples, seed=args.seed)
    sys.stdout.write(f"wrote {args.num_samples} demo latent samples to {out}\n")
    return 0


def _export_weights(args: argparse.Namespace) -> int:
    from distillery.export.weights import export_weights

    out = export_weights(args.checkpoint, args.role, args.out, ema=args.ema)
    sys.stdout.write(f"wrote {out}\n")
    return 0


def _check_params(args: argparse.Namespace) -> int:
    """Everything a stage refuses on ``params.yaml`` alone: bounds (alias bombs, merge chains), a value DVC
    reads differently, the schema, a buffer no stage here could hold. Run it before ``dvc repro``,
    which parses the file with DVC's own parser first and hangs on an alias bomb."""
    from distillery.stages.params import Params
    from distillery.stages.preflight import check_memory
    from distillery.stages.runner import STAGES

    params = Params.load(args.params)
    for stage in STAGES:
        check_memory(stage, params)
    sys.stdout.write(f"{args.params}: ok: DVC and the stages read the same values, each within its bounds, "
                     f"and every stage's buffers fit this machine\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="distillery", description="train and distill video diffusion models")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("train", help="train from a run config, with dotted overrides (--training.loop.max_train_steps 10); "
                   "`distillery train --help` for its options (one process; torchrun -m distillery.cli.train for N)",
                   add_help=False)
    base = sub.add_parser("base", help="base models")
    base_sub = base.add_subparsers(dest="base_command", required=True, metavar="COMMAND")
    tiny = base_sub.add_parser("make-tiny", help="write a tiny Wan 2.1 T2V model in diffusers layout")
    tiny.add_argument("--out", required=True, help="folder to write the model into")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (and of the fit)")
    tiny.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    tiny.add_argument("--fit", action="store_true", help="fit VAE and transformer to synthetic clips (minutes on a CPU)")
    tiny.add_argument("--shipped", action="store_true", help="copy the fitted tiny base shipped with distillery (made by --fit)")
    tiny.add_argument("--vae-steps", type=int, default=None, help="--fit: VAE optimizer steps (default: the fit recipe's)")
    tiny.add_argument("--vae-seconds", type=float, default=None, help="--fit: optional wall-clock cap on the VAE fit "
                      "(default: no cap)")
    tiny.add_argument("--dit-steps", type=int, default=None, help="--fit: transformer SFT steps (default: the fit recipe's)")
    tiny.add_argument("--batch-size", type=int, default=None, help="--fit: transformer SFT batch size (default: the fit "
                      "recipe's)")
    tiny.add_argument("--num-train-clips", type=int, default=None, help="--fit: synthetic training clips (default: the "
                      "fit recipe's)")
    tiny.add_argument("--num-validation-clips", type=int, default=None, help="--fit: synthetic validation clips "
                      "(default: the fit recipe's)")
    tiny.add_argument("--eval-prompts", type=int, default=None, help="--fit: adherence on at most this many prompts "
                      "(default: the fit recipe's)")
    tiny.add_argument("--eval-steps", type=int, default=None, help="--fit: sampling steps of the adherence check "
                      "(default: the fit recipe's)")
    tiny.add_argument("--work-dir", default=None, help="--fit: keep clips, latents and runs here (default: a temporary "
                      "folder, removed)")
    tiny.set_defaults(func=_make_tiny)
    from distillery.cli.preprocess import add_preprocess_command

    add_preprocess_command(sub)
    from distillery.cli.clips import add_clips_commands
    from distillery.cli.lineage import add_lineage_command
    from distillery.stages.runner import add_stage_command

    add_clips_commands(sub)
    add_lineage_command(sub)
    add_stage_command(sub)
    latents = sub.add_parser("latents", help="latent datasets")
    latents_sub = latents.add_subparsers(dest="latents_command", required=True, metavar="COMMAND")
    demo = latents_sub.add_parser("demo", help="write a small synthetic latent set that fits the tiny base model")
    demo.add_argument("--out", required=True, help="folder to write the parquet shards into")
    demo.add_argument("--num-samples", type=int, default=16, help="latent samples to write")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random latents and embeddings")
    demo.set_defaults(func=_demo_latents)
    exp = sub.add_parser("export-weights", help="write a checkpoint role's transformer as a diffusers folder")
    exp.add_argument("checkpoint", help="a checkpoint folder (runs/<stage>/checkpoint-<step>)")
    exp.add_argument("--role", default="student", help="the trainable role whose weights to export")
    exp.add_argument("--out", required=True, help="folder to write the diffusers transformer folder into")
    exp.add_argument("--ema", default=None, metavar="CALLBACK", help="export the shadow weights of this EMA callback "
                     "(default: the trained weights)")
    exp.set_defaults(func=_export_weights)
    params = sub.add_parser("params", help="the pipeline's params.yaml")
    params_sub = params.add_subparsers(dest="params_command", required=True, metavar="COMMAND")
    check = params_sub.add_parser("check", help="check params.yaml as DVC and every stage read it, in one line per "
                                  "problem (exit 2); run it before `dvc repro`, which hangs on an alias bomb")
    check.add_argument("--params", default="params.yaml", help="the params file to check")
    check.set_defaults(func=_check_params)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        from distillery.cli.train import run_training

        return run_guarded(lambda: run_training(argv[1:]))
    args = build_parser().parse_args(argv)
    from distillery.common.log import setup_logging

    setup_logging()
    return run_guarded(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
