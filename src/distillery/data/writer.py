"""Writing latent shards: one :class:`LatentRecord` per row, zstd parquet, atomic per shard (and prompt
shards: one :class:`PromptRecord` per row, the same text-embedding columns without the latent ones).

Called by the preprocessing (``latents``) and ``prompts`` stages. A shard is written to a hidden temp file in its
destination folder and renamed into place, so a shard path either holds a complete shard or does
not exist; a resumed stage writes only the shards that are missing.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from distillery.data.latent_format import (
    LATENT_NDIM,
    PROMPT_SCHEMA,
    SCHEMA,
    TEXT_NDIM,
    i2v_schema,
    tensor_to_record_fields,
    with_text_streams,
)

__all__ = ["LatentRecord", "PromptRecord", "shard_path", "write_latent_shards", "write_prompt_shard", "write_shard"]

logger = logging.getLogger("distillery.data")

#: Low-cardinality string columns that benefit from dictionary encoding.
_DICTIONARY_COLUMNS = ["latent_dtype", "text_embedding_dtype", "source"]


@dataclass
class LatentRecord:
    """One preprocessed clip, as stored in one parquet row.

    Tensors keep their dtype on disk (float32, float16 or bfloat16).
    """

    id: str  # unique sample id
    caption: str  # the prompt the text embedding was computed from
    latent: torch.Tensor  # [C, T, H, W] VAE latent (channels, latent frames, latent height, latent width)
    text_embedding: torch.Tensor  # [L, D] unpadded text-encoder output; L may be 0 (empty prompt)
    num_frames: int  # video frames of the source clip
    height: int  # source clip height, pixels
    width: int  # source clip width, pixels
    fps: float  # source clip frame rate, frames per second
    source: str  # where the clip came from (file path, URL, generator name)
    first_frame: torch.Tensor | None = None  # image-to-video: [M + C, T, H, W] the first frame's mask and latent
    image_embedding: torch.Tensor | None = None  # image-to-video: [N, D_img] the image encoder's embeddings of it

    def __post_init__(self) -> None:
        if self.first_frame is not None and (self.first_frame.ndim != LATENT_NDIM or self.first_frame.shape[1:] != self.latent.shape[1:]):
            raise ValueError(f"record {self.id!r}: first_frame must be [M + C, T, H, W] with the latent's T, H, W; got "
                             f"{list(self.first_frame.shape)} beside {list(self.latent.shape)}")
        if self.image_embedding is not None and (self.first_frame is None or self.image_embedding.ndim != TEXT_NDIM):
            raise ValueError(f"record {self.id!r}: image_embedding must be [N, D] beside a first_frame")
        if self.latent.ndim != LATENT_NDIM:
            raise ValueError(
                f"record {self.id!r}: latent must be [C, T, H, W], got shape {list(self.latent.shape)}"
            )
        if self.text_embedding.ndim != TEXT_NDIM:
            raise ValueError(
                f"record {self.id!r}: text_embedding must be [L, D], got shape {list(self.text_embedding.shape)}"
            )


@dataclass
class PromptRecord:
    """One encoded prompt of a prompt-only set, as stored in one parquet row (:data:`PROMPT_SCHEMA`)."""

    id: str  # unique sample id
    caption: str  # the prompt the text embedding was computed from
    text_embedding: torch.Tensor  # [L, D] unpadded text-encoder output
    source: str  # where the prompt came from (file and line)

    def __post_init__(self) -> None:
        if self.text_embedding.ndim != TEXT_NDIM:
            raise ValueError(
                f"record {self.id!r}: text_embedding must be [L, D], got shape {list(self.text_embedding.shape)}"
            )


def shard_path(out_dir: Path, split: str, index: int) -> Path:
    """Path of shard ``index`` of ``split``: ``out_dir/<split>/shard-<index:05d>.parquet``."""
    return Path(out_dir) / split / f"shard-{index:05d}.parquet"


def _tensor_columns(name: str, tensors: list) -> dict[str, list]:
    """The ``<name>_bytes`` / ``_shape`` / ``_dtype`` columns of ``tensors`` (:func:`tensor_to_record_fields` each)."""
    fields = [tensor_to_record_fields(t) for t in tensors]
    return {f"{name}_bytes": [b for b, _, _ in fields], f"{name}_shape": [s for _, s, _ in fields],
            f"{name}_dtype": [d for _, _, d in fields]}


Streams = Sequence[tuple[str, int, int | None]] | None  # the prompt streams of a multi-encoder base (latent_format)


def _records_to_table(records: list[LatentRecord], streams: Streams = None) -> pa.Table:
    columns = {
        "id": [r.id for r in records],
        "caption": [r.caption for r in records],
        **_tensor_columns("latent", [r.latent for r in records]),
        **_tensor_columns("text_embedding", [r.text_embedding for r in records]),
        "num_frames": [int(r.num_frames) for r in records],
        "height": [int(r.height) for r in records],
        "width": [int(r.width) for r in records],
        "fps": [float(r.fps) for r in records],
        "source": [r.source for r in records],
    }
    schema = SCHEMA
    if records[0].first_frame is not None:  # an image-to-video set: every row has the first frame (and embedding)
        with_image = records[0].image_embedding is not None
        if any((r.first_frame is None) or ((r.image_embedding is None) == with_image) for r in records):
            raise ValueError("records of one shard must all carry a first_frame (and all or none an image_embedding)")
        columns.update(_tensor_columns("first_frame", [r.first_frame for r in records]))
        if with_image:
            columns.update(_tensor_columns("image_embedding", [r.image_embedding for r in records]))
        schema = i2v_schema(with_image)
    elif any(r.first_frame is not None for r in records):
        raise ValueError("records of one shard must all carry a first_frame or none")
    return pa.Table.from_pydict(columns, schema=with_text_streams(schema, streams))


def _prompts_to_table(records: list[PromptRecord], streams: Streams = None) -> pa.Table:
    columns = {
        "id": [r.id for r in records],
        "caption": [r.caption for r in records],
        **_tensor_columns("text_embedding", [r.text_embedding for r in records]),
        "source": [r.source for r in records],
    }
    return pa.Table.from_pydict(columns, schema=with_text_streams(PROMPT_SCHEMA, streams))


def _write_table(table: pa.Table, path: Path, rows: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd",
                       use_dictionary=[c for c in _DICTIONARY_COLUMNS if c in table.column_names])
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    logger.debug("wrote %d rows to %s", rows, path)
    return path


def write_prompt_shard(records: Iterable[PromptRecord], path: Path, text_streams: Streams = None) -> Path:
    """Write ``records`` as one zstd parquet prompt shard at ``path``, atomically (as :func:`write_shard`)."""
    path = Path(path)
    rows = list(records)
    if not rows:
        raise ValueError(f"no records to write to {path}")
    return _write_table(_prompts_to_table(rows, text_streams), path, len(rows))


def write_shard(records: Iterable[LatentRecord], path: Path, text_streams: Streams = None) -> Path:
    """Write ``records`` as one zstd parquet shard at ``path``, atomically; returns ``path``. ``text_streams``: the
    base's prompt streams where it has several (recorded, format v2: :func:`~distillery.data.latent_format.with_text_streams`).

    The parent folder is created if needed. Data goes to a hidden temp file beside ``path``
    (never matching ``*.parquet``) and is renamed over ``path`` only once complete; on any error
    the temp file is removed and ``path`` is left as it was. ``ValueError`` for an empty record list
    or an unsupported tensor dtype.
    """
    path = Path(path)
    rows = list(records)
    if not rows:
        raise ValueError(f"no records to write to {path}")
    return _write_table(_records_to_table(rows, text_streams), path, len(rows))


def _batched(it: Iterable[LatentRecord], n: int) -> Iterator[list[LatentRecord]]:
    it = iter(it)
    while chunk := list(islice(it, n)):
        yield chunk


def write_latent_shards(
    records: Iterable[LatentRecord], out_dir: Path, rows_per_shard: int, split: str = "train"
) -> list[Path]:
    """Write ``records`` as shards ``out_dir/<split>/shard-00000.parquet``, ``shard-00001``, ….

    Every shard holds ``rows_per_shard`` rows except possibly the last. Records are consumed
    lazily (at most one shard in memory). Each shard is written atomically by :func:`write_shard`.
    Returns the shard paths in order (empty when there were no records).
    """
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    paths = []
    for index, chunk in enumerate(_batched(records, rows_per_shard)):
        paths.append(write_shard(chunk, shard_path(out_dir, split, index)))
    logger.info("wrote %d shard(s) to %s", len(paths), Path(out_dir) / split)
    return paths
