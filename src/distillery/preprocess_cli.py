"""``distillery preprocess`` arguments (kept apart so building the CLI parser imports no torch)."""

from __future__ import annotations

from typing import Any


def _run(args: Any) -> int:
    from distillery.preprocess import main_preprocess

    return main_preprocess(args)


def add_preprocess_command(sub: Any) -> None:
    p = sub.add_parser("preprocess", help="encode captioned videos into parquet latent shards")
    p.add_argument("--base", required=True, help="diffusers Wan folder (VAE, text encoder, tokenizer)")
    p.add_argument("--data", required=True, help="videos/ + captions.jsonl, or train/ and validation/ such folders")
    p.add_argument("--out", required=True)
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--height", type=int, default=32)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--fps", type=float, default=8.0)
    p.add_argument("--rows-per-shard", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-bad-fraction", type=float, default=0.5)
    p.add_argument("--max-sequence-length", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_run)
