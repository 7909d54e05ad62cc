"""``distillery preprocess`` arguments (kept apart so building the CLI parser imports no torch)."""

from __future__ import annotations

import argparse
from typing import Any


def _run(args: Any) -> int:
    from distillery.data.preprocess import main_preprocess

    return main_preprocess(args)


def add_command(sub: argparse._SubParsersAction, name: str, help: str) -> None:  # noqa: A002
    p = sub.add_parser(name, help=help)
    p.add_argument("--base", required=True, help="diffusers Wan folder (VAE, text encoder, tokenizer)")
    p.add_argument("--data", required=True, help="videos/ + captions.jsonl, or train/ and validation/ such folders")
    p.add_argument("--out", required=True, help="folder of the latent dataset (a rerun keeps only the shards made with the same "
                   "settings from the same inputs, and redoes the rest)")
    p.add_argument("--frames", type=int, default=17, help="video frames per clip (4k+1 for the Wan VAE)")
    p.add_argument("--height", type=int, default=32, help="clip height in pixels after resizing")
    p.add_argument("--width", type=int, default=32, help="clip width in pixels after resizing")
    p.add_argument("--fps", type=float, default=8.0, help="frame rate the clips are resampled to")
    p.add_argument("--rows-per-shard", type=int, default=32, help="caption entries per parquet shard")
    p.add_argument("--batch-size", type=int, default=8, help="clips per VAE encode call")
    p.add_argument("--max-bad-fraction", type=float, default=0.5,
                   help="fail (exit 2) when more than this fraction of a split's entries is unusable")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="prompt tokens (default: the base model card's, else its tokenizer's)")
    p.add_argument("--device", default="cpu", help="where the VAE and text encoder run (cpu, cuda, cuda:1, ...)")
    p.set_defaults(func=_run)
