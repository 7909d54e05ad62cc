"""``distillery export-weights CHECKPOINT --role student --out DIR [--ema NAME] [--lora merged|adapter|both]``: a
checkpoint role's transformer as a diffusers folder (the checkpoint's checksums are verified first); a role that
trained a LoRA adapter: merged into it and/or as a diffusers LoRA folder."""

from __future__ import annotations

import argparse
import sys


def add_command(sub: argparse._SubParsersAction, name: str, help: str) -> None:  # noqa: A002
    """``export-weights`` on the top-level subparsers."""
    exp = sub.add_parser(name, help=help)
    exp.add_argument("checkpoint", help="a checkpoint folder (runs/<stage>/checkpoint-<step>)")
    exp.add_argument("--role", default="student", help="the trainable role whose weights to export")
    exp.add_argument("--out", required=True, help="folder to write the diffusers transformer folder into")
    exp.add_argument("--ema", default=None, metavar="CALLBACK", help="export the shadow weights of this EMA callback "
                     "(default: the trained weights)")
    exp.add_argument("--lora", default="both", choices=["merged", "adapter", "both"],
                     help="a role that trained a LoRA adapter: write transformer/ with it merged, lora/ (the diffusers LoRA "
                          "file stock load_lora_weights reads, and base.json naming its base), or both (default)")
    exp.set_defaults(func=_export_weights)


def _export_weights(args: argparse.Namespace) -> int:
    from distillery.export.weights import export_weights

    out = export_weights(args.checkpoint, args.role, args.out, ema=args.ema, lora=args.lora)
    sys.stdout.write(f"wrote {out}\n")
    return 0
