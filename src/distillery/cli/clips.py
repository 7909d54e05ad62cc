"""``distillery clips ...`` commands: make a synthetic clip set, measure prompt adherence of a clip folder.

    distillery clips make --out DIR [--seed N] [--num-train N] [--num-validation N] [--frames N]
                          [--size N] [--overwrite]
    distillery clips analyze --data DIR

``analyze`` takes a clip-set root (with ``train/`` and/or ``validation/``) or one split folder
(``videos/`` + ``captions.jsonl``) and prints ``{"<split>": {"colour": acc, "shape": acc,
"direction": acc, "all": acc, "num_clips": n}}`` as JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from distillery.common.errors import UserError


def add_command(subparsers: argparse._SubParsersAction, name: str, help: str) -> None:  # noqa: A002
    """Add the ``clips`` command group (``make``, ``analyze``) to a top-level subparsers object."""
    clips = subparsers.add_parser(name, help=help)
    clips_sub = clips.add_subparsers(dest="clips_command", required=True, metavar="COMMAND")
    make = clips_sub.add_parser("make", help="write a deterministic synthetic captioned clip set")
    make.add_argument("--out", required=True, help="folder to create (must be absent or empty)")
    make.add_argument("--seed", type=int, default=0, help="seed of the clip set (colours, shapes, motions, captions)")
    make.add_argument("--num-train", type=int, default=96, help="clips in train/")
    make.add_argument("--num-validation", type=int, default=24, help="clips in validation/")
    make.add_argument("--frames", type=int, default=17, help="frames per clip")
    make.add_argument("--size", type=int, default=32, help="frame height and width in pixels")
    make.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    make.set_defaults(func=_make)
    analyze = clips_sub.add_parser("analyze", help="print analyzer accuracies of a clip folder against its captions")
    analyze.add_argument("--data", required=True, help="clip-set root or one split folder with captions.jsonl")
    analyze.set_defaults(func=_analyze)


def _make(args: argparse.Namespace) -> int:
    from distillery.clips.synthetic import ClipSetConfig, make_clip_set

    cfg = ClipSetConfig(num_train=args.num_train, num_validation=args.num_validation, num_frames=args.frames,
                        height=args.size, width=args.size, seed=args.seed)
    out = make_clip_set(Path(args.out), cfg, overwrite=args.overwrite)
    sys.stdout.write(f"wrote {cfg.num_train} train + {cfg.num_validation} validation clips to {out}\n")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from distillery.clips.analyzer import evaluate
    from distillery.clips.video_io import iter_captioned_videos

    data = Path(args.data)
    if (data / "captions.jsonl").is_file():
        splits = {data.name or ".": data}
    else:
        splits = {p.name: p for p in sorted(data.iterdir()) if (p / "captions.jsonl").is_file()} if data.is_dir() else {}
    if not splits:
        raise UserError(f"no captions.jsonl in {data} or its sub-folders")
    report = {name: evaluate(iter_captioned_videos(folder)) for name, folder in splits.items()}
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0
