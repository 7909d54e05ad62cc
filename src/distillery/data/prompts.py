"""Prompt-only data: a prompts file → a prompt-only set of text-embedding shards (no videos).

``distillery stage prompts`` (``params.yaml: prompts``) reads a prompts file — one prompt a line, or JSONL
(``*.jsonl``: one JSON object a line with a ``"prompt"`` or ``"caption"`` string) — and encodes every prompt
with the base model's text encoder, as the ``latents`` stage encodes captions. What it writes into ``OUT`` is a
latent set without latents, read by the same reader
(:func:`distillery.data.dataset.read_text_embeddings`)::

    OUT/train/shard-00000.parquet …     zstd, rows_per_shard prompts a shard: id, caption, text_embedding_*,
                                        source (:data:`~distillery.data.latent_format.PROMPT_SCHEMA`)
    OUT/train/shard-00000.json …        per-shard record: rows, settings, input digest (written last)
    OUT/empty_prompt.safetensors        the "" embedding; negative_prompt.safetensors for a non-empty negative prompt
    OUT/preprocess.json                 manifest: kind "prompts", settings, counts, text_dim, latent_channels and
                                        latent_shape [C, T', H', W'] (what a rollout from noise generates:
                                        :func:`distillery.models.registry.latent_shape_for`)
    OUT/written_files.json              the ledger of the shard files written here (only those are removed)

**Trust.** The file is checked before the base model is loaded or anything is written (:func:`read_prompts`):
a regular file (a FIFO or a device is never opened for reading), at most ``max_file_bytes``, no NUL byte (a
binary file), valid UTF-8, every prompt at most ``max_prompt_chars`` characters, every JSONL line an object
with a non-empty string prompt, at least one prompt. Any of these is one :class:`UserError` line naming the
file and line (the CLI exits 2). Blank lines are skipped.

**Incremental.** Shard ``k`` holds prompts ``[k·R, (k+1)·R)`` of the file (R = ``rows_per_shard``; a prompt's
id is its line number), and its record holds the settings it was made with and the digest of its inputs (the
base's text encoder and tokenizer files, and each prompt's id and text). A rerun into a folder holding an
earlier run's shards keeps every shard whose record still matches and re-encodes only the others (the
machinery of :mod:`distillery.data.preprocess`: the same records, ledger and clean-up), so changing one prompt
re-encodes one shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.common.fsutil import write_text_atomic
from distillery.common.hashcache import file_sha256
from distillery.common.log import get_logger
from distillery.common.progress import Progress
from distillery.data.dataset import MANIFEST_FILE, PROMPTS_KIND, shard_record_path
from distillery.data.latent_format import stream_records
from distillery.data.writer import PromptRecord, shard_path, write_prompt_shard

log = get_logger("prompts")

SPLIT = "train"  # a prompts file is one training split
MAX_FILE_BYTES = 4 << 30  # the largest prompts file accepted at all (4 GiB: ~10 M LLM-extended prompts)
MAX_PROMPT_CHARS = 100_000  # the longest prompt accepted at all (the text encoder keeps its first 512 tokens)
_TEXT_PARTS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")  # the parts of a base folder the embeddings depend on


@dataclass
class PromptsConfig:
    """How a prompts file is checked and encoded (``params.yaml: prompts``)."""

    num_frames: int = 17  # video frames the rollouts stand for (4k+1): the latent_shape's T' = (num_frames − 1) / 4 + 1
    height: int = 32  # pixels: H' = height / the VAE's spatial factor
    width: int = 32  # pixels: W' = width / the VAE's spatial factor
    rows_per_shard: int = 256  # prompts per parquet shard
    batch_size: int = 32  # prompts per text-encoder call
    max_sequence_length: int | None = None  # prompt tokens; None: the base model card / tokenizer decides
    device: str = "cpu"  # where the text encoder runs
    negative_prompt: str = ""  # encoded to negative_prompt.safetensors when not empty (the shards do not depend on it)
    max_file_bytes: int = 1 << 30  # a larger prompts file is refused before it is read
    max_prompt_chars: int = 10_000  # a longer prompt (line) is refused, naming its line

    def __post_init__(self) -> None:
        if self.rows_per_shard < 1 or self.batch_size < 1:
            raise UserError("prompts: rows_per_shard and batch_size must be >= 1")
        if not 1 <= self.max_file_bytes <= MAX_FILE_BYTES or not 1 <= self.max_prompt_chars <= MAX_PROMPT_CHARS:
            raise UserError(f"prompts: max_file_bytes must be in [1, {MAX_FILE_BYTES}] and max_prompt_chars in "
                            f"[1, {MAX_PROMPT_CHARS}]")


@dataclass(frozen=True)
class Prompt:
    """One prompt of the file: its 1-based line number and text."""

    line: int
    text: str

    @property
    def id(self) -> str:
        return f"line-{self.line:08d}"


# -- reading the file ---------------------------------------------------------------------------
def _read_bytes(path: Path, max_bytes: int) -> bytes:
    """The file's bytes: a regular file (never opened blocking: a FIFO there is refused, not waited on) of at
    most ``max_bytes``; anything else one :class:`UserError` line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise UserError(f"prompts file {path}: cannot be opened ({e.strerror or e})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"prompts file {path}: not a regular file; give a text or JSONL file of prompts")
        if info.st_size > max_bytes:
            raise UserError(f"prompts file {path}: {info.st_size} bytes, more than the limit of {max_bytes} "
                            f"(prompts.max_file_bytes); split it or raise the limit")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as e:
        raise UserError(f"prompts file {path}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while being read
        raise UserError(f"prompts file {path}: more than the limit of {max_bytes} bytes (prompts.max_file_bytes)")
    return data


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _decode(path: Path, data: bytes) -> str:
    """``data`` as UTF-8 text: a NUL byte (a binary file) or invalid UTF-8 is one line naming where."""
    nul = data.find(b"\0")
    if nul >= 0:
        raise UserError(f"prompts file {path}: line {_line_of(data, nul)}: a NUL byte: a binary file, not a text or "
                        "JSONL file of prompts")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"prompts file {path}: line {_line_of(data, e.start)}: not valid UTF-8 ({e.reason} at byte "
                        f"{e.start}); save the file as UTF-8") from None


def _jsonl_prompt(path: Path, number: int, line: str) -> str:
    try:
        value = json.loads(line)
    except ValueError as e:
        raise UserError(f"prompts file {path}: line {number}: not a JSON object ({e.__class__.__name__}: "
                        f"{str(e)[:80]})") from None
    if not isinstance(value, dict):
        raise UserError(f"prompts file {path}: line {number}: a JSON {type(value).__name__}, expected an object with "
                        "a \"prompt\" (or \"caption\") string")
    text = value.get("prompt", value.get("caption"))
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"prompts file {path}: line {number}: no non-empty \"prompt\" (or \"caption\") string")
    return text.strip()


def read_prompts(path: Path, max_file_bytes: int = 1 << 30, max_prompt_chars: int = 10_000) -> list[Prompt]:
    """The prompts of the file at ``path`` (module doc: format and checks), in file order, blank lines skipped.
    JSONL when the name ends in ``.jsonl``, else one prompt a line. Reads nothing but the file."""
    path = Path(path)
    text = _decode(path, _read_bytes(path, max_file_bytes))
    jsonl = path.name.lower().endswith(".jsonl")
    prompts = []
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        if len(line) > max_prompt_chars:
            raise UserError(f"prompts file {path}: line {number}: {len(line)} characters, more than the limit of "
                            f"{max_prompt_chars} (prompts.max_prompt_chars)")
        prompt = _jsonl_prompt(path, number, line) if jsonl else line
        if any(c in prompt for c in "\r\n"):
            raise UserError(f"prompts file {path}: line {number}: a prompt must be one line")
        prompts.append(Prompt(number, prompt))
    if not prompts:
        raise UserError(f"prompts file {path}: lists no prompts ({'one JSON object' if jsonl else 'one prompt'} a line)")
    return prompts


# -- encoding -----------------------------------------------------------------------------------
def text_encoders_digest(base: Path) -> str:
    """sha256 over every file of the base's ``text_encoder/`` and ``tokenizer/`` (relative path and content)."""
    h = hashlib.sha256()
    for part in _TEXT_PARTS:
        for path in sorted(p for p in (Path(base) / part).rglob("*") if p.is_file()):
            h.update(f"{path.relative_to(base).as_posix()}\0{file_sha256(path)}\n".encode())
    return h.hexdigest()


def shard_settings(cfg: PromptsConfig, max_sequence_length: int) -> dict[str, Any]:
    """The settings a prompt shard's bytes depend on (recorded in its record)."""
    import torch

    return {"kind": PROMPTS_KIND, "rows_per_shard": cfg.rows_per_shard, "batch_size": cfg.batch_size,
            "max_sequence_length": int(max_sequence_length), "device": torch.device(cfg.device).type}


def shard_inputs_digest(encoders: str, prompts: list[Prompt]) -> str:
    """sha256 of a shard's inputs: the text encoders' digest and each prompt's id and text, in order."""
    payload = {"encoders": encoders, "prompts": [[p.id, p.text] for p in prompts]}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def encode_shard(encoders: Any, prompts: list[Prompt], cfg: PromptsConfig, out: Path, index: int, source: str,
                 provenance: dict[str, Any]) -> dict[str, Any]:
    """Encode and write shard ``index`` (its prompts); return its record (the old record goes first, the new
    one is written last: a record always describes the parquet beside it)."""
    record_path = shard_record_path(shard_path(out, SPLIT, index))
    record_path.unlink(missing_ok=True)
    records = []
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[start : start + cfg.batch_size]
        for p, emb in zip(chunk, encoders.encode_prompts([p.text for p in chunk])):
            records.append(PromptRecord(id=p.id, caption=p.text, text_embedding=emb, source=f"{source}:{p.line}"))
    write_prompt_shard(records, shard_path(out, SPLIT, index), encoders.text_streams)
    record = {"shard": index, "rows": len(records), "entries": len(prompts), "skipped": [], "latent_shape": None,
              **provenance}
    write_text_atomic(record_path, json.dumps(record))
    return record


def encode_prompts_file(base: Path, prompts_file: Path, out: Path, cfg: PromptsConfig,
                        latent_shape: list[int]) -> dict[str, Any]:
    """Check the prompts file, then encode every shard of ``out`` not already done (module doc) and write the
    manifest with ``latent_shape`` (``[C, T', H', W']`` the base's VAE makes of ``cfg``'s frames and size:
    :func:`distillery.models.registry.latent_shape_for`); returns it (plus ``seconds_this_run`` and
    ``prompts_this_run``)."""
    from distillery.data.encoders import BaseEncoders
    from distillery.data.preprocess import _remove_unplanned, _write_prompt_embeddings, stale_reason

    started = time.perf_counter()
    base, prompts_file, out = Path(base), Path(prompts_file), Path(out)
    prompts = read_prompts(prompts_file, cfg.max_file_bytes, cfg.max_prompt_chars)  # before anything is loaded
    encoders = BaseEncoders(base, cfg.device, cfg.max_sequence_length)
    settings = shard_settings(cfg, encoders.max_sequence_length)
    text_sha = text_encoders_digest(base)
    r = cfg.rows_per_shard
    plan = [(SPLIT, out / SPLIT, k, prompts[k * r : (k + 1) * r]) for k in range(-(-len(prompts) // r))]
    todo = []
    for split, _, k, chunk in plan:
        digest = shard_inputs_digest(text_sha, chunk)
        reason = stale_reason(out, split, k, settings, digest)
        if reason is None:
            continue
        if reason.startswith("inputs differ"):
            reason = "inputs differ (a prompt or the text encoder changed)"
        if reason != "not done":
            log.info("%s/shard-%05d re-encoded: %s", split, k, reason)
        todo.append((k, chunk, digest))
    out.mkdir(parents=True, exist_ok=True)
    _remove_unplanned(out, plan)
    if todo:
        (out / MANIFEST_FILE).unlink(missing_ok=True)  # it would describe shards being rewritten
    log.info("%d prompts in %d shards of %s (%d already encoded); this run encodes %d", len(prompts), len(plan), out,
             len(plan) - len(todo), len(todo))
    (out / SPLIT).mkdir(parents=True, exist_ok=True)
    encoded = 0
    with Progress(len(todo), "prompts", "shard") as bar:
        for k, chunk, digest in todo:
            rec = encode_shard(encoders, chunk, cfg, out, k, prompts_file.name, {"settings": settings, "inputs_sha256": digest})
            encoded += rec["rows"]
            bar.update(1, prompts=encoded)
    _write_prompt_embeddings(out, encoders, cfg.negative_prompt)
    manifest = {
        "kind": PROMPTS_KIND,
        # what the set's bytes depend on (not the file limits: raising one changes nothing downstream)
        "settings": {**settings, "num_frames": cfg.num_frames, "height": cfg.height, "width": cfg.width,
                     "negative_prompt": cfg.negative_prompt},
        "base": str(base),
        "data": str(prompts_file),
        "splits": {SPLIT: {"entries": len(prompts), "rows": len(prompts), "skipped": 0, "reasons": {}}},
        "latent_channels": encoders.z_dim,
        "latent_shape": latent_shape,  # [C, T', H', W'] a rollout from noise generates (no row stores a latent)
        "text_dim": encoders.text_dim,
        **({"text_streams": stream_records(encoders.text_streams)} if len(encoders.text_streams) > 1 else {}),
    }
    write_text_atomic(out / MANIFEST_FILE, json.dumps(manifest, indent=2))
    manifest.update(seconds_this_run=round(time.perf_counter() - started, 3), prompts_this_run=encoded)
    log.info("encoded %d of %d prompts (%d shard%s re-encoded)", encoded, len(prompts), len(todo), "" if len(todo) == 1 else "s")
    return manifest
