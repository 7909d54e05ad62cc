"""``distillery latents demo --out DIR``: a small synthetic latent set that fits the tiny base (no VAE needed)."""

from __future__ import annotations

import argparse
import sys


def add_command(sub: argparse._SubParsersAction, name: str, help: str) -> None:  # noqa: A002
    """``latents demo`` on the top-level subparsers."""
    latents = sub.add_parser(name, help=help)
    latents_sub = latents.add_subparsers(dest="latents_command", required=True, metavar="COMMAND")
    demo = latents_sub.add_parser("demo", help="write a small synthetic latent set that fits the tiny base model")
    demo.add_argument("--out", required=True, help="folder to write the parquet shards into")
    demo.add_argument("--num-samples", type=int, default=16, help="latent samples to write")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random latents and embeddings")
    demo.set_defaults(func=_demo_latents)


def _demo_latents(args: argparse.Namespace) -> int:
    from pathlib import Path

    from distillery.data.demo import make_demo_latents

    out = make_demo_latents(Path(args.out), num_samples=args.num_samples, seed=args.seed)
    sys.stdout.write(f"wrote {args.num_samples} demo latent samples to {out}\n")
    return 0
