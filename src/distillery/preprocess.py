"""Latent preprocessing: captioned videos → parquet latent shards (DESIGN.md §2).

``distillery preprocess --base MODEL --data DATA --out OUT`` decodes each split's videos
(``distillery.data.videos``), encodes them with the base model's VAE (normalised posterior mean)
and the prompts with its text encoder (unpadded, with length), and writes::

    OUT/train/shard-00000.parquet …       zstd, rows_per_shard caption entries per shard
    OUT/train/shard-00000.json …          per-shard record: rows written, items skipped (written last)
    OUT/validation/…                      the same for the validation split (if the data has one)
    OUT/empty_prompt.safetensors          the "" prompt embedding (classifier-free guidance)
    OUT/skipped.jsonl                     every skipped item with its reason
    OUT/preprocess.json                   manifest: settings, base model, counts, shapes, timing

Shard ``k`` of a split always covers caption entries ``[k·R, (k+1)·R)`` (R = rows_per_shard), so
the assignment is known before decoding: a shard is complete when its ``.json`` exists, a killed
run redoes only missing shards, and under ``torchrun`` rank ``r`` takes the shards with
``k % world_size == r``. Shard files are written to a temp name and renamed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distillery.data.dataset import write_empty_prompt_embedding
from distillery.data.encoders import BaseEncoders
from distillery.data.videos import ClipItem, IngestConfig, find_splits, load_entry, read_entries
from distillery.engine.distributed import barrier, shutdown
from distillery.data.writer import LatentRecord, shard_path, write_shard
from distillery.errors import UserError
from distillery.fsutil import write_text_atomic
from distillery.log import get_logger
from distillery.progress import Progress

log = get_logger("preprocess")


@dataclass
class PreprocessConfig:
    num_frames: int = 17  # video frames per clip (4k+1 for the Wan VAE)
    height: int = 32  # pixels
    width: int = 32  # pixels
    fps: float = 8.0  # target frame rate the clips are resampled to
    rows_per_shard: int = 32  # caption entries per parquet shard
    batch_size: int = 8  # clips per VAE encode call
    max_bad_fraction: float = 0.5  # fail when more than this fraction of entries is unusable
    max_sequence_length: int | None = None  # prompt tokens; None: the base model card / tokenizer decides
    device: str = "cpu"  # where the VAE and text encoder run

    def ingest(self) -> IngestConfig:
        return IngestConfig(num_frames=self.num_frames, height=self.height, width=self.width, fps=self.fps,
                            max_bad_fraction=self.max_bad_fraction)


def _shard_record_path(out: Path, split: str, index: int) -> Path:
    return shard_path(out, split, index).with_suffix(".json")


def process_shard(
    encoders: BaseEncoders,
    split_dir: Path,
    entries: list[Any],
    cfg: PreprocessConfig,
    out: Path,
    split: str,
    index: int,
) -> dict[str, Any]:
    """Decode, encode and write one shard (its caption entries); return its record."""
    ingest = cfg.ingest()
    items: list[ClipItem] = []
    skipped: list[dict[str, Any]] = []
    for entry in entries:
        result = load_entry(split_dir, entry, ingest)
        if isinstance(result, ClipItem):
            items.append(result)
        else:
            skipped.append({"split": split, **result.to_json()})
    records: list[LatentRecord] = []
    for start in range(0, len(items), cfg.batch_size):
        chunk = items[start : start + cfg.batch_size]
        latents = encoders.encode_videos(np.stack([c.frames for c in chunk]))
        texts = encoders.encode_prompts([c.caption for c in chunk])
        for clip, latent, text in zip(chunk, latents, texts):
            records.append(LatentRecord(
                id=clip.id, caption=clip.caption, latent=latent.contiguous(), text_embedding=text,
                num_frames=cfg.num_frames, height=cfg.height, width=cfg.width, fps=float(cfg.fps),
                source=f"{split}/{clip.path}",
            ))
    if records:
        write_shard(records, shard_path(out, split, index))
    record = {"shard": index, "rows": len(records), "entries": len(entries), "skipped": skipped}
    write_text_atomic(_shard_record_path(out, split, index), json.dumps(record))
    return record


def preprocess(base: Path, data: Path, out: Path, cfg: PreprocessConfig, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Run this rank's share of the missing shards; rank 0 then writes the summary files.

    Returns the manifest (rank 0; other ranks return their own counts). Raises UserError when a
    split has no usable clip or too large a bad fraction.
    """
    started = time.perf_counter()
    base, data, out = Path(base), Path(data), Path(out)
    if cfg.rows_per_shard < 1 or cfg.batch_size < 1:
        raise UserError("preprocess: rows_per_shard and batch_size must be >= 1")
    splits = find_splits(data)
    encoders = BaseEncoders(base, cfg.device, cfg.max_sequence_length)
    plan: list[tuple[str, Path, int, list[Any]]] = []
    totals: dict[str, int] = {}
    for split, split_dir in splits.items():
        entries = read_entries(split_dir)
        totals[split] = len(entries)
        for k in range(0, max(1, -(-len(entries) // cfg.rows_per_shard))):
            plan.append((split, split_dir, k, entries[k * cfg.rows_per_shard : (k + 1) * cfg.rows_per_shard]))
    todo = [p for i, p in enumerate(plan) if i % world_size == rank and not _shard_record_path(out, p[0], p[2]).is_file()]
    done_before = sum(1 for p in plan if _shard_record_path(out, p[0], p[2]).is_file())
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        log.info("%d shards in %s (%d already done); this run writes %d", len(plan), out, done_before, len(todo))
    for split in splits:
        (out / split).mkdir(parents=True, exist_ok=True)
    clips_done = 0
    with Progress(len(todo), "preprocess", "shard", enabled=rank == 0) as bar:  # a bar on a terminal, else sparse lines
        for split, split_dir, k, entries in todo:
            rec = process_shard(encoders, split_dir, entries, cfg, out, split, k)
            clips_done += rec["rows"]
            bar.update(1, clips=clips_done)
    barrier()
    if rank != 0:
        return {"rank": rank, "clips": clips_done}
    write_empty_prompt_embedding(out, encoders.encode_prompts([""])[0])
    manifest = _summarise(plan, out, splits, totals, cfg, base, data, encoders, time.perf_counter() - started, clips_done)
    return manifest


def _summarise(plan, out: Path, splits, totals, cfg, base, data, encoders, seconds: float, clips_this_run: int) -> dict[str, Any]:
    counts: dict[str, dict[str, Any]] = {}
    skipped_all: list[dict[str, Any]] = []
    for split, _, k, _ in plan:
        rec = json.loads(_shard_record_path(out, split, k).read_text())
        c = counts.setdefault(split, {"entries": totals[split], "rows": 0, "skipped": 0, "reasons": {}})
        c["rows"] += rec["rows"]
        c["skipped"] += len(rec["skipped"])
        for s in rec["skipped"]:
            c["reasons"][s["reason"]] = c["reasons"].get(s["reason"], 0) + 1
        skipped_all.extend(rec["skipped"])
    write_text_atomic(out / "skipped.jsonl", "".join(json.dumps(s) + "\n" for s in skipped_all))
    for split, c in counts.items():
        bad = c["skipped"] / max(1, c["entries"])
        if c["rows"] == 0 or bad > cfg.max_bad_fraction:
            top = ", ".join(f"{r} {n}" for r, n in sorted(c["reasons"].items(), key=lambda kv: -kv[1])[:3])
            raise UserError(
                f"preprocess: {split}: {c['skipped']} of {c['entries']} items unusable ({top}); "
                f"limit max_bad_fraction={cfg.max_bad_fraction}; see {out / 'skipped.jsonl'}"
            )
    manifest = {
        "settings": asdict(cfg) | {"max_sequence_length": encoders.max_sequence_length},
        "base": str(base),
        "data": str(data),
        "splits": counts,
        "latent_channels": encoders.z_dim,
        "text_dim": encoders.text_dim,
        "normalisation": "latents = (posterior_mean - vae.latents_mean) / vae.latents_std",
    }
    write_text_atomic(out / "preprocess.json", json.dumps(manifest, indent=2))  # the same inputs give the same bytes
    manifest.update(seconds_this_run=round(seconds, 3), clips_this_run=clips_this_run)  # facts of this run only
    log.info("preprocessed %s", ", ".join(f"{s}: {c['rows']} clips ({c['skipped']} skipped)" for s, c in counts.items()))
    return manifest


def main_preprocess(args: Any) -> int:
    """CLI adapter: ``distillery preprocess`` (also under torchrun: ranks split the shards)."""
    import sys

    cfg = PreprocessConfig(
        num_frames=args.frames, height=args.height, width=args.width, fps=args.fps,
        rows_per_shard=args.rows_per_shard, batch_size=args.batch_size, max_bad_fraction=args.max_bad_fraction,
        max_sequence_length=args.max_sequence_length, device=args.device,
    )
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    try:
        torch.set_grad_enabled(False)
        manifest = preprocess(Path(args.base), Path(args.data), Path(args.out), cfg, rank, world)
    finally:
        shutdown()
    if rank == 0:
        rows = ", ".join(f"{s}: {c['rows']}" for s, c in manifest["splits"].items())
        sys.stdout.write(f"wrote latents to {args.out} ({rows}; {manifest['clips_this_run']} clips encoded this run "
                         f"in {manifest['seconds_this_run']:.1f} s)\n")
    return 0
