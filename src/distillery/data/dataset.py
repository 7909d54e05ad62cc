"""Reading latent shards into memory and collating them into training batches.

:class:`LatentDataset` loads every shard of one split at construction (columns decoded once,
vectorised) and serves rows as tensor views; without latents (:func:`read_text_embeddings`) it reads
the text-embedding columns of either data artifact: a latent set (``latents`` stage) or a prompt-only
set (``prompts`` stage: the same columns, no latent ones; its manifest says ``kind: prompts``). :func:`collate_latents` builds the model-boundary
batch (``[B, C, T, H, W]`` latents, text embeddings padded the way diffusers' ``WanPipeline`` pads
its prompt embeddings). The empty-prompt embedding used as the CFG negative lives beside the
splits in ``empty_prompt.safetensors``.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from distillery.common.errors import UserError
from distillery.data.latent_format import (
    I2V_TENSORS,
    LATENT_NDIM,
    TEXT_NDIM,
    ColumnError,
    TensorColumn,
    decode_tensor_column,
    format_problem,
    schema_problems,
    text_streams_of,
)

__all__ = [
    "EMPTY_PROMPT_FILE",
    "NEGATIVE_PROMPT_FILE",
    "EMPTY_PROMPT_KEY",
    "MANIFEST_FILE",
    "LatentDataset",
    "collate_latents",
    "data_kind",
    "read_empty_prompt_embedding",
    "read_text_embeddings",
    "write_empty_prompt_embedding",
]

logger = logging.getLogger("distillery.data")

#: File (beside the split folders) and key of the stored empty/negative prompt embedding [L, D].
EMPTY_PROMPT_FILE = "empty_prompt.safetensors"
#: The latents stage's negative prompt's embedding (same key), present when its negative prompt is not empty.
NEGATIVE_PROMPT_FILE = "negative_prompt.safetensors"
EMPTY_PROMPT_KEY = "text_embedding"
#: The latent set's manifest (beside the split folders, written by ``distillery preprocess``):
#: ``latent_shape`` (``[C, T, H, W]`` of every row), ``text_dim`` and per-split ``rows``.
MANIFEST_FILE = "preprocess.json"
#: The manifest's ``kind`` of a prompt-only set (``prompts`` stage); a latent set's manifest has none or ``latents``.
PROMPTS_KIND = "prompts"

_READ_COLUMNS = [
    "id",
    "caption",
    "latent_bytes",
    "latent_shape",
    "latent_dtype",
    "text_embedding_bytes",
    "text_embedding_shape",
    "text_embedding_dtype",
]


class _Shard:
    """The decoded columns of one shard file."""

    def __init__(self, path: Path, with_latents: bool = True) -> None:
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path} is not a readable parquet file ({e}); rewrite it with the latents stage") from None
        too_new = format_problem(schema)
        if too_new:
            raise UserError(f"{path}: {too_new}; read it with that distillery or regenerate it with the latents stage")
        #: the prompt streams a multi-encoder set records (format v2), None for one encoder's (v1)
        self.text_streams = text_streams_of(schema)
        problems = schema_problems(schema, with_latents)
        if problems and with_latents and not schema_problems(schema, with_latents=False):
            raise UserError(f"{path} holds prompt embeddings only (no video latents): a method that reads video latents "
                            "cannot train on it; point training.data.path at a latent set (the latents stage's)")
        if problems:
            raise UserError(
                f"{path} is not a latent shard: {'; '.join(problems)}. "
                "Regenerate it with the latents stage (distillery.data.write_latent_shards)"
            )
        try:
            columns = _READ_COLUMNS if with_latents else [c for c in _READ_COLUMNS if not c.startswith("latent_")]
            i2v = [name for name in I2V_TENSORS if f"{name}_bytes" in schema.names]  # read with or without latents
            columns = columns + [f"{name}_{part}" for name in i2v for part in ("bytes", "shape", "dtype")]
            table = pq.read_table(path, columns=columns)
            self.ids: list[str] = table.column("id").to_pylist()
            self.captions: list[str] = table.column("caption").to_pylist()
            if any(v is None for v in self.ids) or any(v is None for v in self.captions):
                raise ColumnError("id or caption contains null values")
            self.latents: TensorColumn | None = decode_tensor_column(
                table.column("latent_bytes"), table.column("latent_shape"), table.column("latent_dtype"), LATENT_NDIM
            ) if with_latents else None
            self.texts: TensorColumn = decode_tensor_column(
                table.column("text_embedding_bytes"),
                table.column("text_embedding_shape"),
                table.column("text_embedding_dtype"),
                TEXT_NDIM,
            )
            #: image-to-video columns (``first_frame``, ``image_embedding``) when the shard has them
            self.extras: dict[str, TensorColumn] = {
                name: decode_tensor_column(table.column(f"{name}_bytes"), table.column(f"{name}_shape"),
                                           table.column(f"{name}_dtype"), I2V_TENSORS[name]) for name in i2v}
        except ColumnError as e:
            raise UserError(f"{path} is a corrupt latent shard: {e}; regenerate it with the latents stage") from None
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path} could not be read ({e}); regenerate it with the latents stage") from None

    def __len__(self) -> int:
        return len(self.ids)


def shard_record_path(shard: Path) -> Path:
    """The per-shard record ``shard-<k>.json`` beside ``shard-<k>.parquet`` (written by preprocessing)."""
    return Path(shard).with_suffix(".json")


def _read_json(path: Path, what: str) -> dict[str, Any] | None:
    """``path`` as a JSON object, None when absent; :class:`UserError` when present but unreadable."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable {what} ({type(e).__name__}); regenerate it with the latents stage") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: {what} is not a JSON object; regenerate it with the latents stage")
    return value


def _recorded_rows(shard: Path) -> int | None:
    """The row count the shard's record says it holds (None: no record, a set written without one)."""
    record = _read_json(shard_record_path(shard), "shard record")
    if record is None:
        return None
    rows = record.get("rows")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise UserError(f"{shard_record_path(shard)}: no row count; regenerate the shard with the latents stage")
    return rows


def _expected_layout(manifest: dict[str, Any] | None, key: str, length: int) -> list[int] | int | None:
    """``manifest[key]`` when it is a list of ``length`` non-negative ints (or an int for length 0), else None."""
    value = (manifest or {}).get(key)
    if length == 0:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(value, list) and len(value) == length and all(isinstance(v, int) and v >= 0 for v in value):
        return value
    return None


class LatentDataset:
    """All rows of ``root/<split>/*.parquet`` (shards in name order), held in memory.

    ``dataset[i]`` is a dict: ``latents`` (``[C, T, H, W]``, stored dtype), ``text_embedding``
    (``[L, D]``, stored dtype, unpadded), ``caption`` (str), ``id`` (str); an image-to-video set's rows add
    ``first_frame`` (``[M + C, T, H, W]``) and, when stored, ``image_embedding`` (``[N, D_img]``). The tensors are
    read-only-by-convention views of the loaded shard buffers: clone before writing in place.
    ``with_latents=False`` reads prompts only (no ``latents`` key; the latent columns are never read):
    what a method whose ``data_kind`` is ``prompts`` trains on. Raises :class:`UserError` naming the path if the split folder is missing, holds no shards, or a
    shard is not a (valid) latent shard.

    Each shard is also checked against what the latent set recorded, before any row is served
    (one-line :class:`UserError` naming the shard): its row count against its record
    ``shard-<k>.json`` (when there is one); every row's latent shape against the manifest's
    ``latent_shape`` (``root/preprocess.json``; without one, against the split's first row: a
    split holds one layout) and every text width against its ``text_dim``; the split's total
    rows against the manifest's count for the split (a shard file removed).
    """

    def __init__(self, root: Path, split: str = "train", with_latents: bool = True) -> None:
        self.root = Path(root)
        self.split = split
        self.with_latents = with_latents
        folder = self.root / split
        if not folder.is_dir():
            raise UserError(
                f"latent split folder {folder} does not exist; run the latents stage or point data at "
                f"the folder that holds '{split}/'"
            )
        self.shard_paths: list[Path] = sorted(folder.glob("*.parquet"), key=lambda p: p.name)
        if not self.shard_paths:
            raise UserError(f"latent split folder {folder} holds no *.parquet shards; run the latents stage")
        self._shards = [_Shard(p, with_latents) for p in self.shard_paths]
        self._check_recorded(_read_json(self.root / MANIFEST_FILE, "latent set manifest"))
        sizes = np.array([len(s) for s in self._shards], dtype=np.int64)
        self._ends = np.cumsum(sizes)
        self._shard_of = np.repeat(np.arange(len(sizes)), sizes)
        logger.info("loaded %d rows from %d shard(s) in %s", len(self), len(self._shards), folder)

    def _check_recorded(self, manifest: dict[str, Any] | None) -> None:
        """The checks against the shard records and the manifest (class docstring)."""
        where = self.root / MANIFEST_FILE
        layout = _expected_layout(manifest, "latent_shape", LATENT_NDIM)
        text_dim = _expected_layout(manifest, "text_dim", 0)
        reference = f"the latent set's {where} records"
        for path, shard in zip(self.shard_paths, self._shards):
            recorded = _recorded_rows(path)
            if recorded is not None and recorded != len(shard):
                raise UserError(f"{path} holds {len(shard)} row{'s' if len(shard) != 1 else ''}, but its record "
                                f"{shard_record_path(path).name} says {recorded}; regenerate it with the latents stage")
            if shard.latents is not None and len(shard):
                if layout is None:  # no manifest: the split's first row sets the layout
                    layout = shard.latents.shapes[0].tolist()
                    reference = f"{path} row 0 has"
                _check_column(path, "latent shape", shard.latents.shapes, layout, reference)
            if text_dim is not None and len(shard):
                _check_column(path, "text embedding width", shard.texts.shapes[:, 1:], [text_dim],
                              f"the latent set's {where} records")
            streams = (manifest or {}).get("text_streams")
            if manifest is not None and shard.text_streams != streams:
                raise UserError(f"{path} holds the prompt streams {shard.text_streams or 'of one text encoder'}, but {where} "
                                f"records {streams or 'one text encoder'}; regenerate it with the latents stage")
        splits = (manifest or {}).get("splits")
        counts = splits.get(self.split) if isinstance(splits, dict) else None
        expected_rows = counts.get("rows") if isinstance(counts, dict) else None
        total = sum(len(s) for s in self._shards)
        if isinstance(expected_rows, int) and expected_rows != total:
            missing = [str(p) for p in self._recorded_but_missing()]
            raise UserError(f"{self.root / self.split} holds {total} rows, but {where} records {expected_rows}"
                            f"{' (missing: ' + ', '.join(missing) + ')' if missing else ''}; "
                            "regenerate the latent set with the latents stage")

    def _recorded_but_missing(self) -> list[Path]:
        """Shard files whose record says they hold rows but which are not there."""
        shards = [r.with_suffix(".parquet") for r in sorted((self.root / self.split).glob("shard-*.json"))]
        return [p for p in shards if not p.exists() and (_recorded_rows(p) or 0) > 0]

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def _locate(self, i: int) -> tuple[_Shard, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} rows")
        i %= n
        k = int(self._shard_of[i])
        local = i - (int(self._ends[k - 1]) if k else 0)
        return self._shards[k], local

    def __getitem__(self, i: int) -> dict[str, Any]:
        shard, j = self._locate(int(i))
        item = {"text_embedding": shard.texts[j], "caption": shard.captions[j], "id": shard.ids[j]}
        if shard.latents is not None:
            item["latents"] = shard.latents[j]
        for name, column in shard.extras.items():  # an image-to-video set: first_frame, image_embedding
            item[name] = column[j]
        return item


def read_text_embeddings(root: Path, split: str = "train") -> LatentDataset:
    """The prompts of ``root/<split>`` with their text embeddings, from either data artifact — a latent set
    (``artifacts/latents/data``) or a prompt-only set (``artifacts/prompts/data``): ``dataset[i]`` holds
    ``text_embedding`` ``[L, D]`` (unpadded), ``caption`` and ``id``, never a latent. The one reader of prompt
    embeddings for anything that starts from text (prompt-only training, teacher trajectory generation); the
    same checks as :class:`LatentDataset` (one-line :class:`UserError` naming the shard)."""
    return LatentDataset(root, split, with_latents=False)


def data_kind(root: Path) -> str:
    """``"prompts"`` when the data set at ``root`` holds prompt embeddings only (its manifest's ``kind``), else
    ``"latents"`` (a latent set, or a folder without a manifest: its shards say what they hold when read)."""
    manifest = _read_json(Path(root) / MANIFEST_FILE, "data set manifest")
    return PROMPTS_KIND if (manifest or {}).get("kind") == PROMPTS_KIND else "latents"


def recorded_latent_shape(root: Path, split: str = "train") -> list[int] | None:
    """The ``[C, T, H, W]`` a data set records: its manifest's ``latent_shape`` (a latent set: its rows'; a prompt-only
    set: what its stage derived for rollouts), else — a latent set written without a manifest — the first row's of
    the split (only that column read; a set holds one layout). None when neither is there to read."""
    manifest = _read_json(Path(root) / MANIFEST_FILE, "data set manifest") or {}
    value = manifest.get("latent_shape")
    if isinstance(value, list) and len(value) == LATENT_NDIM and all(isinstance(v, int) and v > 0 for v in value):
        return [int(v) for v in value]
    if manifest.get("kind") == PROMPTS_KIND:
        return None
    folder = Path(root) / split
    for shard in sorted(folder.glob("*.parquet"), key=lambda p: p.name) if folder.is_dir() else []:
        try:
            column = pq.read_table(shard, columns=["latent_shape"]).column("latent_shape")
        except (pa.ArrowException, OSError, KeyError):
            return None
        if len(column):
            value = column[0].as_py()
            return [int(v) for v in value] if isinstance(value, list) and len(value) == LATENT_NDIM else None
    return None


def _check_column(path: Path, what: str, shapes: np.ndarray, expected: list[int], reference: str) -> None:
    """One-line :class:`UserError` naming ``path`` and the first row whose ``shapes`` row is not ``expected``."""
    bad = np.nonzero((shapes != np.asarray(expected, dtype=np.int64)).any(axis=1))[0]
    if bad.size:
        i = int(bad[0])
        got = shapes[i].tolist()
        got_text, want_text = (got, expected) if len(expected) > 1 else (got[0], expected[0])
        raise UserError(f"{path}: row {i} has {what} {got_text}, but {reference} {want_text}; "
                        "regenerate it with the latents stage")


def collate_latents(
    items: Sequence[dict[str, Any]], text_max_length: int, dtype: torch.dtype | None = None, pin_memory: bool = False
) -> dict[str, Any]:
    """Stack dataset items into one batch.

    Returns ``latents`` ``[B, C, T, H, W]`` (when the items have latents); ``text_embeds`` ``[B, text_max_length, D]`` holding each
    prompt's first ``min(L, text_max_length)`` token embeddings followed by zeros (the layout
    ``WanPipeline`` gives its prompt embeddings: trimmed to the real tokens, truncated to the max
    sequence length, zero-padded); ``text_lengths`` int64 ``[B]`` (real tokens kept per row);
    ``captions`` and ``ids`` lists of str; items of an image-to-video set add ``first_frame`` ``[B, M + C, T, H, W]``
    and ``image_embeds`` ``[B, N, D_img]`` (when stored). Tensors are new (not views of the dataset). With
    ``dtype`` both tensors are cast to it; without, all items must share a dtype. With ``pin_memory``
    the tensors are allocated page-locked (needs CUDA).

    :class:`UserError` if two latents differ in shape, or text widths ``D`` differ, or dtypes differ
    with ``dtype=None`` (the message names both ids).
    """
    if not items:
        raise ValueError("cannot collate an empty batch")
    if text_max_length < 1:
        raise ValueError(f"text_max_length must be >= 1, got {text_max_length}")
    first = items[0]
    has_latents = "latents" in first
    for it in items[1:]:
        a, b = first.get("latents"), it.get("latents")
        if has_latents and a.shape != b.shape:
            raise UserError(
                f"latents in one batch must share a shape: {first['id']!r} has {list(a.shape)}, "
                f"{it['id']!r} has {list(b.shape)}; preprocess all clips to one resolution and length"
            )
        a, b = first["text_embedding"], it["text_embedding"]
        if a.shape[1] != b.shape[1]:
            raise UserError(
                f"text embeddings in one batch must share a width: {first['id']!r} has D={a.shape[1]}, "
                f"{it['id']!r} has D={b.shape[1]}; encode all captions with one text encoder"
            )
        if dtype is None:
            for key in ("latents", "text_embedding") if has_latents else ("text_embedding",):
                a, b = first[key], it[key]
                if a.dtype != b.dtype:
                    raise UserError(
                        f"'{key}' in one batch have different dtypes: {first['id']!r} is {a.dtype}, "
                        f"{it['id']!r} is {b.dtype}; pass a dtype to cast to"
                    )
    latents = None
    if not has_latents:
        pass
    elif pin_memory and dtype is None:  # stacked straight into page-locked memory (items share a dtype, checked above)
        latents = torch.empty(len(items), *first["latents"].shape, dtype=first["latents"].dtype, pin_memory=True)
        torch.stack([it["latents"] for it in items], out=latents)
    else:
        latents = torch.stack([it["latents"] for it in items])
        if dtype is not None:
            latents = latents.to(dtype)
        if pin_memory:
            latents = latents.pin_memory()
    width = first["text_embedding"].shape[1]
    text_dtype = dtype if dtype is not None else first["text_embedding"].dtype
    text = torch.zeros(len(items), text_max_length, width, dtype=text_dtype, pin_memory=pin_memory)
    lengths = torch.empty(len(items), dtype=torch.long, pin_memory=pin_memory)
    for b, it in enumerate(items):
        emb = it["text_embedding"][:text_max_length]
        text[b, : emb.shape[0]] = emb
        lengths[b] = emb.shape[0]
    batch = {
        "text_embeds": text,
        "text_lengths": lengths,
        "captions": [str(it["caption"]) for it in items],
        "ids": [str(it["id"]) for it in items],
    }
    if latents is not None:
        batch["latents"] = latents
    for name, key in (("first_frame", "first_frame"), ("image_embedding", "image_embeds")):  # image-to-video
        if name in first:
            if any(name not in it or it[name].shape != first[name].shape for it in items):
                raise UserError(f"'{name}' in one batch must be in every row, of one shape ({first['id']!r}: "
                                f"{list(first[name].shape)}); preprocess all clips with one image-to-video base")
            stacked = torch.stack([it[name] for it in items])
            stacked = stacked.to(dtype) if dtype is not None else stacked
            batch[key] = stacked.pin_memory() if pin_memory else stacked
    return batch


def pad_prompt_embedding(embed: torch.Tensor, length: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One prompt's unpadded embedding ``[L, D]`` → ``[length, D]``: its first ``min(L, length)`` rows,
    then zeros (the layout of :func:`collate_latents` and ``WanPipeline``), in ``dtype`` (default: its own)."""
    out = torch.zeros(length, embed.shape[1], dtype=dtype or embed.dtype)
    n = min(length, embed.shape[0])
    out[:n] = embed[:n]
    return out


def read_empty_prompt_embedding(root: Path, which: str = "empty") -> torch.Tensor | None:
    """The stored empty (``which="empty"``) or negative (``"negative"``) prompt embedding ``[L, D]``
    (stored dtype), or ``None`` if absent.

    Reads ``root/empty_prompt.safetensors`` (``negative``: ``root/negative_prompt.safetensors``,
    and the empty prompt's where a set has no negative prompt: its negative prompt was the empty one)
    key ``text_embedding``. :class:`UserError` if the file exists but is unreadable, lacks the key, or
    is not 2-D.
    """
    if which not in ("empty", "negative"):
        raise ValueError(f"which must be empty or negative, got {which!r}")
    path = Path(root) / (NEGATIVE_PROMPT_FILE if which == "negative" else EMPTY_PROMPT_FILE)
    if which == "negative" and not path.is_file():
        path = Path(root) / EMPTY_PROMPT_FILE
    if not path.is_file():
        return None
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path} is not a readable safetensors file ({e}); rerun the latents stage") from None
    if EMPTY_PROMPT_KEY not in tensors:
        raise UserError(f"{path} has no '{EMPTY_PROMPT_KEY}' tensor (found {sorted(tensors)}); rerun the latents stage")
    t = tensors[EMPTY_PROMPT_KEY]
    if t.ndim != TEXT_NDIM:
        raise UserError(f"{path}: '{EMPTY_PROMPT_KEY}' must be [L, D], got shape {list(t.shape)}")
    return t


def write_empty_prompt_embedding(root: Path, tensor: torch.Tensor, file: str = EMPTY_PROMPT_FILE) -> Path:
    """Store the empty/negative prompt embedding ``[L, D]`` at ``root/empty_prompt.safetensors``
    (``file``: :data:`NEGATIVE_PROMPT_FILE` for the negative prompt's).

    Keeps the tensor's dtype; written to a temp file in ``root`` and renamed (atomic). Returns the
    path. ``ValueError`` if ``tensor`` is not 2-D.
    """
    if tensor.ndim != TEXT_NDIM:
        raise ValueError(f"empty prompt embedding must be [L, D], got shape {list(tensor.shape)}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if file not in (EMPTY_PROMPT_FILE, NEGATIVE_PROMPT_FILE):
        raise ValueError(f"file must be {EMPTY_PROMPT_FILE} or {NEGATIVE_PROMPT_FILE}, got {file!r}")
    path = root / file
    tmp = root / f".{file}.{uuid.uuid4().hex}.tmp"
    try:
        save_file({EMPTY_PROMPT_KEY: tensor.detach().to("cpu").contiguous()}, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
