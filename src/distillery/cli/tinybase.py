"""``distillery base make-tiny --out DIR [--fit | --shipped | --family cosmos|hunyuan15] ...``: a tiny Wan 2.1 T2V model in
diffusers layout (random weights, fitted on synthetic clips, or the fitted one shipped in the package), or a tiny model of
another family (Cosmos Predict 2.5, HunyuanVideo 1.5: random weights from a seed)."""

from __future__ import annotations

import argparse
import sys

from distillery.common.errors import UserError

#: ``--family`` → (the maker's module, its function, the family's name in messages): tiny models made from a seed alone
OTHER_FAMILIES = {"cosmos": ("distillery.tinybase.cosmos", "make_tiny_cosmos", "Cosmos Predict 2.5"),
                  "hunyuan15": ("distillery.tinybase.hunyuan15", "make_tiny_hunyuan15", "HunyuanVideo 1.5")}


def add_command(sub: argparse._SubParsersAction, name: str, help: str) -> None:  # noqa: A002 (argparse's word)
    """``base make-tiny`` on the top-level subparsers."""
    base = sub.add_parser(name, help=help)
    base_sub = base.add_subparsers(dest="base_command", required=True, metavar="COMMAND")
    tiny = base_sub.add_parser("make-tiny", help="write a tiny Wan 2.1 T2V model in diffusers layout")
    tiny.add_argument("--out", required=True, help="folder to write the model into")
    tiny.add_argument("--family", choices=("wan", *OTHER_FAMILIES), default="wan", help="wan: the tiny Wan 2.1 (default); "
                      "cosmos: a tiny Cosmos Predict 2.5 (random transformer and text encoder, the fitted tiny Wan VAE); "
                      "hunyuan15: a tiny HunyuanVideo 1.5 (every weight random)")
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


def _make_tiny(args: argparse.Namespace) -> int:
    from pathlib import Path

    command = " ".join(["distillery", *sys.argv[1:]]) if sys.argv[1:2] == ["base"] else None
    if args.fit and args.shipped:
        raise UserError("choose one of --fit and --shipped")
    if args.family in OTHER_FAMILIES:
        import importlib

        module, function, words = OTHER_FAMILIES[args.family]
        if args.fit or args.shipped:
            raise UserError(f"--family {args.family} makes the tiny {words} from its seed; --fit and --shipped are the "
                            "tiny Wan's")
        out = Path(args.out)
        if args.overwrite and out.is_dir():
            raise UserError(f"{out}: --family {args.family} writes into an absent or empty folder (no --overwrite)")
        getattr(importlib.import_module(module), function)(out, seed=args.seed, command=command)
        sys.stdout.write(f"wrote tiny {words} model to {out}\n")
        return 0
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
