"""Latent preprocessing: captioned videos → parquet latent shards (docs/architecture.md §2).

``distillery preprocess --base MODEL --data DATA --out OUT`` decodes each split's videos
(``distillery.data.videos``), encodes them with the base model's VAE (normalised posterior mean)
and the prompts with its text encoder (unpadded, with length), and writes::

    OUT/train/shard-00000.parquet …       zstd, rows_per_shard caption entries per shard
    OUT/train/shard-00000.json …          per-shard record: rows, items skipped, latent shape, settings,
                                          input digest (written last)
    OUT/validation/…                      the same for the validation split (if the data has one)
    OUT/empty_prompt.safetensors          the "" prompt embedding (classifier-free guidance, caption dropout)
    OUT/negative_prompt.safetensors       the negative prompt's embedding (the CFG unconditional of the
                                          stages that ask for it), when ``negative_prompt`` is not empty
    OUT/skipped.jsonl                     every skipped item with its reason
    OUT/preprocess.json                   manifest: settings, base model, counts, latent_shape, text_dim
    OUT/written_files.json                the shard files preprocess wrote here (only those are ever removed)

Before anything is loaded or written the whole data folder is scanned (:func:`read_entries`: every
entry's captions line, path, caption and file type, with ``lstat``/``stat`` only): a split whose
entries are already too often unusable (``max_bad_fraction``) fails then, one line, nothing written.

Shard ``k`` of a split always covers caption entries ``[k·R, (k+1)·R)`` (R = rows_per_shard), so
the assignment is known before decoding. Each shard's record holds the settings it was made with
(:func:`shard_settings`) and the digest of its inputs (:func:`shard_inputs_digest`: the base
model's VAE, text encoder and tokenizer files, and each entry's path, caption and video bytes). A
shard counts as done only when its record's settings and digest are this run's and its parquet
holds the rows the record says; any other shard is redone, and the log says why. A killed run thus
redoes only the shards it did not finish; a rerun into the same ``OUT`` with other settings or
changed videos redoes what they change. Shard files an earlier run wrote (its ledger) that this run's
plan has no place for (a split or a shard index beyond it) are removed — a shard-named file no run of
ours wrote is never touched — and ``preprocess.json`` is removed before any shard is
rewritten, so it never describes shards it did not summarise. Under ``torchrun`` rank ``r`` takes
the shards with ``k % world_size == r``. Shard files are written to a temp name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from distillery.common.errors import UserError
from distillery.common.fsutil import read_json_file, write_text_atomic
from distillery.common.hashcache import file_sha256
from distillery.common.log import get_logger
from distillery.common.progress import Progress
from distillery.components.distributed import barrier, shutdown
from distillery.data.dataset import EMPTY_PROMPT_FILE, MANIFEST_FILE, NEGATIVE_PROMPT_FILE, shard_record_path, write_empty_prompt_embedding
from distillery.data.encoders import BaseEncoders
from distillery.data.latent_format import stream_records
from distillery.data.video_folder import SkippedItem, find_splits, read_entries
from distillery.data.videos import ClipItem, IngestConfig, load_entry
from distillery.data.writer import LatentRecord, shard_path, write_shard

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
    negative_prompt: str = ""  # encoded to negative_prompt.safetensors when not empty (the shards do not depend on it)

    def ingest(self) -> IngestConfig:
        return IngestConfig(num_frames=self.num_frames, height=self.height, width=self.width, fps=self.fps,
                            max_bad_fraction=self.max_bad_fraction)


#: One planned shard: (split, split folder, shard index, its caption entries).
Shard = tuple[str, Path, int, list[Any]]
#: The files of a shard (and their temp files): what :func:`_remove_unplanned` may delete.
_SHARD_FILE = re.compile(r"^\.?shard-(\d{5,})\.(parquet|json)(\..*\.tmp|\.tmp-\d+)?$")
#: The ledger of the shard files preprocess runs wrote into ``out`` (only those are ever removed).
LEDGER_FILE = "written_files.json"
_LEDGER_ENTRY = re.compile(r"^([^/]+/shard-\d{5,}\.(parquet|json)|(empty|negative)_prompt\.safetensors)$")
#: The parts of a base model folder the latents depend on (an image-to-video base's transformer config says so,
#: and its image encoder makes the image embeddings; a text-to-video base has neither image folder).
_ENCODER_PARTS = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "image_encoder", "image_processor")


def _shard_record_path(out: Path, split: str, index: int) -> Path:
    return shard_record_path(shard_path(out, split, index))


def shard_settings(cfg: PreprocessConfig, max_sequence_length: int) -> dict[str, Any]:
    """The settings a shard's bytes depend on, as recorded in its record (``max_bad_fraction`` only
    decides whether the run fails; the device counts by type: ``cuda:0`` and ``cuda:1`` compute alike)."""
    return {"num_frames": cfg.num_frames, "height": cfg.height, "width": cfg.width, "fps": float(cfg.fps),
            "rows_per_shard": cfg.rows_per_shard, "batch_size": cfg.batch_size,
            "max_sequence_length": int(max_sequence_length), "device": torch.device(cfg.device).type}


def encoders_digest(base: Path) -> str:
    """sha256 over every file of the base's ``vae/``, ``text_encoder/`` and ``tokenizer/`` (relative path
    and content digest, through the hash cache when one is active)."""
    h = hashlib.sha256()
    if (base / "image_encoder").is_dir() or (base / "image_processor").is_dir() or _is_i2v(base):
        config = base / "transformer" / "config.json"  # its in_channels say whether the shards carry first frames
        h.update(f"i2v\0{file_sha256(config) if config.is_file() else ''}\n".encode())
    for part in _ENCODER_PARTS:
        for path in sorted(p for p in (base / part).rglob("*") if p.is_file()):
            h.update(f"{path.relative_to(base).as_posix()}\0{file_sha256(path)}\n".encode())
    return h.hexdigest()


def _is_i2v(base: Path) -> bool:
    from distillery.data.encoders import first_frame_mask_channels

    return first_frame_mask_channels(base) is not None


def _entry_fingerprint(split_dir: Path, entry: Any) -> list[Any]:
    """What one caption entry contributes to its shard: a skip as (path, reason, detail); a usable
    entry as (where, path, caption, the video's sha256, or why it could not be read)."""
    if isinstance(entry, SkippedItem):
        return ["skipped", entry.path, entry.reason, entry.detail]
    try:
        content = file_sha256(split_dir / entry.path)  # a regular file: read_entries checked with stat
    except OSError as e:
        content = f"unreadable: {e.strerror or e}"
    return ["entry", entry.label, entry.path, entry.caption, content]


def shard_inputs_digest(encoders: str, split_dir: Path, entries: list[Any]) -> str:
    """sha256 of a shard's inputs: the encoders' digest and each entry's fingerprint, in order."""
    payload = {"encoders": encoders, "entries": [_entry_fingerprint(split_dir, e) for e in entries]}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def _settings_change(old: Any, new: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "the record has no settings"
    changed = [f"{k} {old.get(k, '(none)')} → {v}" for k, v in new.items() if old.get(k) != v]
    return ", ".join(changed)


def stale_reason(out: Path, split: str, index: int, settings: dict[str, Any], digest: str) -> str | None:
    """Why shard ``index`` of ``split`` must be (re)done; None when its record and files are this
    run's: the same settings and input digest, and a parquet holding the recorded rows (none for 0)."""
    record_path = _shard_record_path(out, split, index)
    if not record_path.is_file():
        return "not done"
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        rows = int(record["rows"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its record is unreadable ({type(e).__name__})"
    change = _settings_change(record.get("settings"), settings)
    if change:
        return f"settings differ ({change})"
    if record.get("inputs_sha256") != digest:
        return "inputs differ (a video, a caption or the base model's encoders changed)"
    parquet = shard_path(out, split, index)
    if rows == 0:
        return f"its record says 0 rows but {parquet.name} exists" if parquet.exists() else None
    try:
        held = pq.ParquetFile(parquet).metadata.num_rows
    except (OSError, pa.ArrowException) as e:
        return f"{parquet.name} is unreadable ({type(e).__name__})"
    return None if held == rows else f"{parquet.name} holds {held} rows, its record says {rows}"


def process_shard(
    encoders: BaseEncoders,
    split_dir: Path,
    entries: list[Any],
    cfg: PreprocessConfig,
    out: Path,
    split: str,
    index: int,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Decode, encode and write one shard (its caption entries); return its record.

    The old record goes first and the new one is written last, so a record always describes the
    parquet beside it; a shard with no usable row leaves no parquet. ``provenance`` (``settings``,
    ``inputs_sha256``) is stored in the record."""
    record_path = _shard_record_path(out, split, index)
    record_path.unlink(missing_ok=True)
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
        frames = np.stack([c.frames for c in chunk])
        latents = encoders.encode_videos(frames)
        texts = encoders.encode_prompts([c.caption for c in chunk])
        firsts = encoders.encode_first_frames(frames) if encoders.image_to_video else [None] * len(chunk)
        images = encoders.encode_images(frames) if encoders.image_to_video else None
        for i, (clip, latent, text) in enumerate(zip(chunk, latents, texts)):
            records.append(LatentRecord(
                id=clip.id, caption=clip.caption, latent=latent.contiguous(), text_embedding=text,
                num_frames=cfg.num_frames, height=cfg.height, width=cfg.width, fps=float(cfg.fps),
                source=f"{split}/{clip.path}",
                first_frame=None if firsts[i] is None else firsts[i].contiguous(),
                image_embedding=None if images is None else images[i].contiguous(),
            ))
    if records:
        write_shard(records, shard_path(out, split, index), encoders.text_streams)
    else:
        shard_path(out, split, index).unlink(missing_ok=True)  # a stale one from another run
    record = {"shard": index, "rows": len(records), "entries": len(entries), "skipped": skipped,
              "latent_shape": list(records[0].latent.shape) if records else None, **(provenance or {})}
    write_text_atomic(record_path, json.dumps(record))
    return record


def _scan(splits: dict[str, Path], cfg: PreprocessConfig) -> dict[str, list[Any]]:
    """Every split's entries with the checks that need no decoding (:func:`read_entries`); a
    :class:`UserError` when a split lists nothing, or when its entries already unusable are more
    than ``max_bad_fraction`` of it (before anything is loaded or written)."""
    entries: dict[str, list[Any]] = {}
    for split, split_dir in splits.items():
        found = read_entries(split_dir)
        if not found:
            raise UserError(f"preprocess: {split}: the captions file of {split_dir} lists no videos")
        bad = [e for e in found if isinstance(e, SkippedItem)]
        if len(bad) == len(found) or len(bad) > cfg.max_bad_fraction * len(found):
            top = ", ".join(f"{r} {n}" for r, n in Counter(b.reason for b in bad).most_common(3))
            raise UserError(
                f"preprocess: {split}: {len(bad)} of {len(found)} items unusable before any decoding ({top}); "
                f"limit max_bad_fraction={cfg.max_bad_fraction}; first: {bad[0].detail[:160]}; nothing was written"
            )
        entries[split] = found
    return entries


def _planned_files(out: Path, plan: list[Shard]) -> set[str]:
    """The shard files (parquet and record) ``plan`` writes, relative to ``out`` (posix)."""
    names = set()
    for split, _, k, _ in plan:
        for path in (shard_path(out, split, k), _shard_record_path(out, split, k)):
            names.add(path.relative_to(out).as_posix())
    return names


def _written_files(out: Path) -> set[str]:
    """The shard files the ledger of ``out`` says a preprocess run wrote (empty when none, or when the
    ledger is not one of ours: then nothing is deleted by name)."""
    try:
        data = read_json_file(out / LEDGER_FILE, 64 << 20)
    except FileNotFoundError:
        return set()
    except (OSError, ValueError) as exc:
        log.warning("%s is unreadable (%s): no earlier shard file of %s is removed; it is rewritten", out / LEDGER_FILE, exc, out)
        return set()
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) and _LEDGER_ENTRY.match(f) for f in files):
        log.warning("%s does not list shard files: no earlier shard file of %s is removed; it is rewritten", out / LEDGER_FILE, out)
        return set()
    return set(files)


def _remove_unplanned(out: Path, plan: list[Shard]) -> None:
    """Delete the shard files under ``out`` that an earlier run wrote (its ledger, :data:`LEDGER_FILE`) and
    this run's plan has no place for (another split, an index beyond the split's shards: logged), and killed
    writes' temp files of those shards; then record this plan's files as written. A shard-named file no run
    wrote (the user's, another tool's), a symbolic link, a folder the plan does not use: never touched, said
    in one warning line. Rank 0 calls it before any rank writes."""
    planned, earlier = _planned_files(out, plan), _written_files(out)
    ours = planned | earlier
    foreign = []
    for folder in sorted(p for p in out.iterdir() if p.is_dir() and not p.is_symlink()):
        for path in sorted(folder.iterdir()):
            m = _SHARD_FILE.match(path.name)
            if not m:
                continue
            rel = f"{folder.name}/{path.name}"
            final = f"{folder.name}/shard-{m.group(1)}.{m.group(2)}"
            if path.is_symlink() or not path.is_file() or final not in ours:
                foreign.append(rel)
            elif m.group(3):
                path.unlink()
                log.debug("removed %s, a killed write's temp file", path)
            elif rel not in planned:
                path.unlink()
                log.warning("removed %s: this run's plan has no such shard", rel)
    if foreign:
        log.warning("%s holds %d shard-named file(s) no preprocess run wrote there (%s): left alone", out, len(foreign),
                    ", ".join(foreign[:3]) + (", …" if len(foreign) > 3 else ""))
    _write_ledger(out, planned | {e for e in earlier if "/" not in e})  # the prompt embeddings stay recorded


def _write_ledger(out: Path, files: set[str]) -> None:
    write_text_atomic(out / LEDGER_FILE, json.dumps({"files": sorted(files)}, indent=1) + "\n")


def _write_prompt_embeddings(out: Path, encoders: BaseEncoders, negative_prompt: str) -> None:
    """``empty_prompt.safetensors`` and, for a non-empty ``negative_prompt``, ``negative_prompt.safetensors``; an
    earlier run's negative embedding is removed when none is asked for. Only files the ledger says a preprocess run
    wrote are replaced or removed: a same-named file of someone else's in ``out`` is one :class:`UserError` line."""
    ledger = _written_files(out)
    wanted = [EMPTY_PROMPT_FILE] + ([NEGATIVE_PROMPT_FILE] if negative_prompt else [])
    for name in (EMPTY_PROMPT_FILE, NEGATIVE_PROMPT_FILE):
        path = out / name
        if os.path.lexists(path) and (name not in ledger or path.is_symlink() or not path.is_file()):
            if name in wanted:
                raise UserError(f"preprocess: {path} exists and was not written by preprocess: not replaced; move it "
                                "away (or choose another --out) and rerun")
            continue  # not ours, not needed: left alone
        if name not in wanted and name in ledger:
            path.unlink(missing_ok=True)  # a previous run's, for a negative prompt no longer asked for
            ledger.discard(name)
    _write_ledger(out, ledger | set(wanted))  # recorded before they are written (a crash leaves them ours)
    write_empty_prompt_embedding(out, encoders.encode_prompts([""])[0])
    if negative_prompt:
        write_empty_prompt_embedding(out, encoders.encode_prompts([negative_prompt])[0], NEGATIVE_PROMPT_FILE)


def preprocess(base: Path, data: Path, out: Path, cfg: PreprocessConfig, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Run this rank's share of the shards not yet done; rank 0 then writes the summary files.

    Returns the manifest (rank 0; other ranks return their own counts). Raises UserError when a
    split has no usable clip or too large a bad fraction (from the scan, before any work, when the
    entries known bad without decoding already exceed it).
    """
    started = time.perf_counter()
    base, data, out = Path(base), Path(data), Path(out)
    if cfg.rows_per_shard < 1 or cfg.batch_size < 1:
        raise UserError("preprocess: rows_per_shard and batch_size must be >= 1")
    cfg.ingest()  # the settings are valid
    splits = find_splits(data)
    scanned = _scan(splits, cfg)
    encoders = BaseEncoders(base, cfg.device, cfg.max_sequence_length)
    settings = shard_settings(cfg, encoders.max_sequence_length)
    encoders_sha = encoders_digest(base)
    plan: list[Shard] = []
    totals: dict[str, int] = {}
    for split, split_dir in splits.items():
        entries = scanned[split]
        totals[split] = len(entries)
        for k in range(0, max(1, -(-len(entries) // cfg.rows_per_shard))):
            plan.append((split, split_dir, k, entries[k * cfg.rows_per_shard : (k + 1) * cfg.rows_per_shard]))
    todo = _this_ranks_work(plan, out, settings, encoders_sha, rank, world_size)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _remove_unplanned(out, plan)
        if todo or world_size > 1:
            (out / MANIFEST_FILE).unlink(missing_ok=True)  # it would describe shards being rewritten
        mine = -(-len(plan) // world_size) if world_size > 1 else len(plan)
        log.info("%d shards in %s (%d already done%s); this run writes %d", len(plan), out, mine - len(todo),
                 f" of rank 0's {mine}" if world_size > 1 else "", len(todo))
    barrier()  # rank 0's clean-up is over before any rank writes
    for split in splits:
        (out / split).mkdir(parents=True, exist_ok=True)
    clips_done = 0
    with Progress(len(todo), "preprocess", "shard", enabled=rank == 0) as bar:  # a bar on a terminal, else sparse lines
        for (split, split_dir, k, entries), digest in todo:
            provenance = {"settings": settings, "inputs_sha256": digest}
            rec = process_shard(encoders, split_dir, entries, cfg, out, split, k, provenance)
            clips_done += rec["rows"]
            bar.update(1, clips=clips_done)
    barrier()
    if rank != 0:
        return {"rank": rank, "clips": clips_done}
    _write_prompt_embeddings(out, encoders, cfg.negative_prompt)
    manifest = _summarise(plan, out, splits, totals, cfg, base, data, encoders, time.perf_counter() - started, clips_done)
    return manifest


def _this_ranks_work(plan: list[Shard], out: Path, settings: dict[str, Any], encoders_sha: str, rank: int,
                     world_size: int) -> list[tuple[Shard, str]]:
    """This rank's shards that are not done, each with its input digest; a shard redone for another
    reason than never having been done is logged with that reason (a warning: every rank prints it)."""
    todo = []
    for i, shard in enumerate(plan):
        if i % world_size != rank:
            continue
        split, split_dir, k, entries = shard
        digest = shard_inputs_digest(encoders_sha, split_dir, entries)
        reason = stale_reason(out, split, k, settings, digest)
        if reason is None:
            continue
        if reason != "not done":
            log.warning("%s/shard-%05d redone: %s", split, k, reason)
        todo.append((shard, digest))
    return todo


def _summarise(plan, out: Path, splits, totals, cfg, base, data, encoders, seconds: float, clips_this_run: int) -> dict[str, Any]:
    counts: dict[str, dict[str, Any]] = {}
    skipped_all: list[dict[str, Any]] = []
    shapes: set[tuple[int, ...]] = set()
    for split, _, k, _ in plan:
        rec = json.loads(_shard_record_path(out, split, k).read_text())
        c = counts.setdefault(split, {"entries": totals[split], "rows": 0, "skipped": 0, "reasons": {}})
        c["rows"] += rec["rows"]
        c["skipped"] += len(rec["skipped"])
        for s in rec["skipped"]:
            c["reasons"][s["reason"]] = c["reasons"].get(s["reason"], 0) + 1
        skipped_all.extend(rec["skipped"])
        if rec.get("latent_shape"):
            shapes.add(tuple(rec["latent_shape"]))
    write_text_atomic(out / "skipped.jsonl", "".join(json.dumps(s) + "\n" for s in skipped_all))
    for split, c in counts.items():
        bad = c["skipped"] / max(1, c["entries"])
        if c["rows"] == 0 or bad > cfg.max_bad_fraction:
            top = ", ".join(f"{r} {n}" for r, n in sorted(c["reasons"].items(), key=lambda kv: -kv[1])[:3])
            raise UserError(
                f"preprocess: {split}: {c['skipped']} of {c['entries']} items unusable ({top}); "
                f"limit max_bad_fraction={cfg.max_bad_fraction}; see {out / 'skipped.jsonl'}"
            )
    if len(shapes) != 1:  # one settings run makes one layout; anything else is a bug, not a user's error
        raise RuntimeError(f"preprocess: the shards of {out} hold latent shapes {sorted(shapes)}, expected one")
    manifest = {
        "settings": asdict(cfg) | {"max_sequence_length": encoders.max_sequence_length},
        "base": str(base),
        "data": str(data),
        "splits": counts,
        "latent_channels": encoders.z_dim,
        "latent_shape": list(shapes.pop()),  # [C, T, H, W] of every row
        "text_dim": encoders.text_dim,
        **({"text_streams": stream_records(encoders.text_streams)} if len(encoders.text_streams) > 1 else {}),
        **({"image_conditioning": _image_conditioning(out, plan)} if encoders.image_to_video else {}),
        "normalisation": encoders.vae_kind.formula,
    }
    write_text_atomic(out / MANIFEST_FILE, json.dumps(manifest, indent=2))  # the same inputs give the same bytes
    manifest.update(seconds_this_run=round(seconds, 3), clips_this_run=clips_this_run)  # facts of this run only
    log.info("preprocessed %s", ", ".join(f"{s}: {c['rows']} clips ({c['skipped']} skipped)" for s, c in counts.items()))
    return manifest


def _image_conditioning(out: Path, plan: list[Shard]) -> dict[str, Any]:
    """An image-to-video set's manifest entry: the first-frame condition's shape and the image embeddings' (None when
    the base has no image encoder), read from the first shard that holds rows."""
    for split, _, k, _ in plan:
        path = shard_path(out, split, k)
        if path.is_file():
            names = [c for c in ("first_frame_shape", "image_embedding_shape") if c in pq.read_schema(path).names]
            row = pq.read_table(path, columns=names).slice(0, 1).to_pylist()[0]
            embedding = row.get("image_embedding_shape")
            return {"first_frame_shape": list(row["first_frame_shape"]), "image_embedding_shape": embedding}
    raise RuntimeError(f"preprocess: no shard of {out} holds rows")


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
