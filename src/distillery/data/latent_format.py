"""The on-disk format of latent shards (docs/architecture.md §2): parquet schema and tensor <-> bytes codecs.

One parquet row is one training clip:

- ``latent_bytes`` / ``latent_shape`` / ``latent_dtype``: the VAE latent, ``[C, T, H, W]``
  (latent channels, latent frames, latent height, latent width), raw little-endian bytes in
  C order.
- ``text_embedding_bytes`` / ``_shape`` / ``_dtype``: the text-encoder output, ``[L, D]``,
  unpadded (``L`` is the prompt's real token count and may be 0 for the empty prompt).
- ``num_frames``, ``height``, ``width`` (video frames and pixels), ``fps``, ``source``: metadata of
  the clip the latent was encoded from.
- image-to-video sets only (:data:`I2V_SCHEMA`): ``first_frame_bytes`` / ``_shape`` / ``_dtype``, the first
  frame's condition ``[M + C, T, H, W]`` (the mask, then the latent of the first frame followed by zeros, as
  ``WanImageToVideoPipeline`` builds it), and — when the base has an image encoder —
  ``image_embedding_bytes`` / ``_shape`` / ``_dtype``, its embeddings of the first frame ``[N, D_img]``.

Format versions (the schema metadata ``distillery.format``): ``latents/v1`` (``+i2v`` for an image-to-video set) and
``prompts/v1`` hold one text encoder's embeddings; ``latents/v2`` / ``prompts/v2`` hold the prompt streams of several
encoders side by side in the same text column (:mod:`distillery.components.prompt_streams`: HunyuanVideo 1.5's
Qwen2.5-VL and ByT5) and record them as ``distillery.text_streams`` (:func:`with_text_streams`; each stream's
``encoder``, ``width`` and ``tokens`` budget). A v1 shard reads as one stream, as it always did; a format of a later
major version than this reader's is refused (:func:`format_problem`).

Supported dtypes are ``float32``, ``float16`` and ``bfloat16``; every codec here round-trips them
bitwise. Readers honour the dtype column (a row's tensors come back in the dtype they were written
in).

Decoding is column-wise: :func:`decode_tensor_column` turns one whole arrow column of bytes into a
single torch byte buffer in one copy, and rows are views into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import torch

__all__ = [
    "DTYPES",
    "ColumnError",
    "FORMAT_METADATA",
    "I2V_TENSORS",
    "LATENT_NDIM",
    "LATENT_COLUMNS",
    "PROMPT_SCHEMA",
    "SCHEMA",
    "TEXT_NDIM",
    "TensorColumn",
    "decode_tensor_column",
    "dtype_from_name",
    "dtype_name",
    "exact_nbytes",
    "format_problem",
    "i2v_schema",
    "schema_problems",
    "stream_records",
    "tensor_from_bytes",
    "tensor_to_record_fields",
    "text_streams_of",
    "with_text_streams",
]

#: Stored dtype name -> torch dtype. Only these may appear in a ``*_dtype`` column.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}

#: Rank of a stored latent (``[C, T, H, W]``) and a stored text embedding (``[L, D]``).
LATENT_NDIM = 4
TEXT_NDIM = 2

#: Schema-level metadata written into every shard (readers check the columns, :func:`format_problem` the version).
FORMAT_METADATA: dict[bytes, bytes] = {b"distillery.format": b"latents/v1"}
FORMAT_KEY = b"distillery.format"
STREAMS_KEY = b"distillery.text_streams"
#: The newest format version this reader knows (of ``latents/`` and ``prompts/`` shards).
FORMAT_VERSION = 2

SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("caption", pa.string(), nullable=False),
        pa.field("latent_bytes", pa.binary(), nullable=False),
        pa.field("latent_shape", pa.list_(pa.int32()), nullable=False),
        pa.field("latent_dtype", pa.string(), nullable=False),
        pa.field("text_embedding_bytes", pa.binary(), nullable=False),
        pa.field("text_embedding_shape", pa.list_(pa.int32()), nullable=False),
        pa.field("text_embedding_dtype", pa.string(), nullable=False),
        pa.field("num_frames", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("fps", pa.float32(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
    ],
    metadata=FORMAT_METADATA,
)

#: An image-to-video set's extra tensor columns (each a ``*_bytes``/``_shape``/``_dtype`` triple) and their ranks.
I2V_TENSORS = {"first_frame": LATENT_NDIM, "image_embedding": TEXT_NDIM}


def _tensor_fields(name: str) -> list[pa.Field]:
    return [pa.field(f"{name}_bytes", pa.binary(), nullable=False), pa.field(f"{name}_shape", pa.list_(pa.int32()), nullable=False),
            pa.field(f"{name}_dtype", pa.string(), nullable=False)]


def i2v_schema(with_image_embedding: bool) -> pa.Schema:
    """An image-to-video latent shard's schema: :data:`SCHEMA`, then the first frame's condition columns and (with
    ``with_image_embedding``) the image embedding's."""
    extra = [*_tensor_fields("first_frame"), *(_tensor_fields("image_embedding") if with_image_embedding else [])]
    return pa.schema([*SCHEMA, *extra], metadata={b"distillery.format": b"latents/v1+i2v"})


#: The columns only a latent shard holds (a prompt shard, written by the ``prompts`` stage, has none of them).
LATENT_COLUMNS = ("latent_bytes", "latent_shape", "latent_dtype", "num_frames", "height", "width", "fps")
#: A prompt shard's schema: the latent shard's columns less :data:`LATENT_COLUMNS` — the same id, caption, text
#: embedding and source columns, written the same way, so one reader serves both (``LatentDataset(with_latents=False)``).
PROMPT_SCHEMA: pa.Schema = pa.schema([f for f in SCHEMA if f.name not in LATENT_COLUMNS],
                                     metadata={b"distillery.format": b"prompts/v1"})


def stream_records(streams: Sequence[tuple[str, int, int | None]]) -> list[dict]:
    """The record of prompt streams ``(encoder class, width, token budget)`` a v2 shard and its set's manifest keep."""
    return [{"encoder": e, "width": int(w), "tokens": n} for e, w, n in streams]


def with_text_streams(schema: pa.Schema, streams: Sequence[tuple[str, int, int | None]] | None) -> pa.Schema:
    """``schema`` as a shard of several prompt streams records them (module doc: format version 2 and
    ``distillery.text_streams``); ``schema`` itself for one stream (or None)."""
    if streams is None or len(streams) < 2:
        return schema
    import json

    meta = dict(schema.metadata or {})
    kind, _, rest = meta.get(FORMAT_KEY, b"latents/v1").decode().partition("/v1")
    meta[FORMAT_KEY] = f"{kind}/v{FORMAT_VERSION}{rest}".encode()
    meta[STREAMS_KEY] = json.dumps(stream_records(streams)).encode()
    return schema.with_metadata(meta)


def format_problem(schema: pa.Schema) -> str | None:
    """Why a reader of :data:`FORMAT_VERSION` cannot read a shard of ``schema``'s format (a later major version),
    else None (no format recorded: the columns say)."""
    value = (schema.metadata or {}).get(FORMAT_KEY, b"").decode(errors="replace")
    kind, slash, rest = value.partition("/v")
    digits = rest.split("+")[0]
    if slash and kind in ("latents", "prompts") and digits.isdigit() and int(digits) > FORMAT_VERSION:
        return f"written as {value}, a later format than this distillery reads ({kind}/v{FORMAT_VERSION})"
    return None


def text_streams_of(schema: pa.Schema) -> list[dict] | None:
    """The prompt streams a v2 shard records (``[{"encoder", "width", "tokens"}, …]``), None for a one-stream shard."""
    raw = (schema.metadata or {}).get(STREAMS_KEY)
    if raw is None:
        return None
    import json

    try:
        streams = json.loads(raw)
    except ValueError:
        return None
    return streams if isinstance(streams, list) else None


def dtype_name(dtype: torch.dtype) -> str:
    """Stored name of a supported torch dtype; ``ValueError`` for any other dtype."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported tensor dtype {dtype}; latent shards store one of {sorted(DTYPES)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype for a stored dtype name; ``ValueError`` for an unknown name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown stored dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def tensor_to_record_fields(t: torch.Tensor) -> tuple[bytes, list[int], str]:
    """Encode a tensor as ``(raw bytes, shape, dtype name)`` for one parquet row.

    The bytes are the C-order element bytes in native (little-endian) order; bfloat16 is
    reinterpreted as int16 first because numpy has no bfloat16. The tensor is moved to CPU and
    made contiguous; its dtype is kept (float32, float16 or bfloat16, else ``ValueError``).
    """
    name = dtype_name(t.dtype)
    c = t.detach().to("cpu").contiguous()
    if c.dtype == torch.bfloat16:
        c = c.view(torch.int16)
    return c.numpy().tobytes(), [int(s) for s in t.shape], name


#: Largest dimension a shape column may hold (the format stores ``list<int32>``).
MAX_DIM = 2**31 - 1


def exact_nbytes(shape: Sequence[int], dtype_name: str) -> int:
    """``prod(shape) * itemsize`` in Python integers: exact for any shape (a numpy int64 product
    wraps: ``[65536] * 4`` would give 0)."""
    return math.prod(int(s) for s in shape) * _ITEMSIZE[dtype_name]


def tensor_from_bytes(buf: bytes | bytearray | memoryview, shape: Sequence[int], dtype_name: str) -> torch.Tensor:
    """Decode one tensor written by :func:`tensor_to_record_fields`; bitwise inverse.

    Returns a new writable CPU tensor of ``shape`` and the named dtype. ``ValueError`` if a
    dimension is negative or the byte count does not match ``prod(shape) * itemsize`` (computed
    exactly, :func:`exact_nbytes`).
    """
    dtype = dtype_from_name(dtype_name)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"tensor shape {list(shape)} has a negative dimension")
    expected = exact_nbytes(shape, dtype_name)
    if len(buf) != expected:
        raise ValueError(
            f"tensor bytes do not match shape {list(shape)} and dtype {dtype_name}: "
            f"got {len(buf)} bytes, expected {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_int_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


_COLUMN_CHECKS = {
    "id": (_is_string, "string"),
    "caption": (_is_string, "string"),
    "latent_bytes": (_is_binary, "binary"),
    "latent_shape": (_is_int_list, "list<int32>"),
    "latent_dtype": (_is_string, "string"),
    "text_embedding_bytes": (_is_binary, "binary"),
    "text_embedding_shape": (_is_int_list, "list<int32>"),
    "text_embedding_dtype": (_is_string, "string"),
    "num_frames": (pa.types.is_integer, "int32"),
    "height": (pa.types.is_integer, "int32"),
    "width": (pa.types.is_integer, "int32"),
    "fps": (pa.types.is_floating, "float32"),
    "source": (_is_string, "string"),
}


def schema_problems(schema: pa.Schema, with_latents: bool = True) -> list[str]:
    """What keeps ``schema`` from being a latent-shard schema (``with_latents=False``: a schema whose text
    columns can be read, i.e. a latent or a prompt shard's); empty when it is one.

    Extra columns are allowed; every column of :data:`SCHEMA` (less :data:`LATENT_COLUMNS` without
    latents) must be present with a compatible
    type (large/small variants of string, binary and list are accepted, any integer width for
    shapes and int columns, any float width for ``fps``).
    """
    problems = []
    for name, (ok, want) in _COLUMN_CHECKS.items():
        if not with_latents and name in LATENT_COLUMNS:
            continue
        idx = schema.get_field_index(name)
        if idx < 0:
            problems.append(f"missing column '{name}' ({want})")
        elif not ok(schema.field(idx).type):
            problems.append(f"column '{name}' has type {schema.field(idx).type}, expected {want}")
    return problems


@dataclass(frozen=True)
class TensorColumn:
    """A decoded column of per-row tensors, held as byte buffers plus per-row layout.

    ``buffers[k]`` is a contiguous uint8 CPU tensor holding the bytes of one arrow chunk. Row ``i``
    lives in ``buffers[chunk[i]]`` at bytes ``[start[i], start[i] + nbytes[i])`` with shape
    ``shapes[i]`` (int64 ``[N, ndim]``) and dtype ``DTYPES[dtype_names[dtype_code[i]]]``.
    Indexing returns a view of the buffer (a copy only when the row's start is not aligned to its
    element size), so rows share memory with the column.
    """

    buffers: tuple[torch.Tensor, ...]
    chunk: np.ndarray  # int64 [N]: index into buffers
    start: np.ndarray  # int64 [N]: byte offset of the row inside its buffer
    nbytes: np.ndarray  # int64 [N]: byte length of the row
    shapes: np.ndarray  # int64 [N, ndim]
    dtype_code: np.ndarray  # int64 [N]: index into dtype_names
    dtype_names: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.chunk.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        name = self.dtype_names[int(self.dtype_code[i])]
        dtype = DTYPES[name]
        shape = tuple(int(s) for s in self.shapes[i])
        start, n = int(self.start[i]), int(self.nbytes[i])
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        seg = self.buffers[int(self.chunk[i])][start : start + n]
        if start % _ITEMSIZE[name]:
            seg = seg.clone()
        return seg.view(dtype).view(shape)


class ColumnError(ValueError):
    """A column's content does not follow the format (message names the row's position)."""


def _binary_chunk_layout(arr: pa.Array) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(bytes as one uint8 tensor, row starts, row lengths) of one binary arrow chunk, one copy."""
    if arr.null_count:
        raise ColumnError("contains null values")
    if len(arr) == 0:
        return torch.empty(0, dtype=torch.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, offsets_buf, data_buf = arr.buffers()
    off_dtype = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(offsets_buf, dtype=off_dtype)[arr.offset : arr.offset + len(arr) + 1]
    offsets = offsets.astype(np.int64)
    lo, hi = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
    if hi > lo:
        data = np.frombuffer(data_buf, dtype=np.uint8)[lo:hi]
        storage = torch.from_numpy(data.copy())
    else:
        storage = torch.empty(0, dtype=torch.uint8)
    return storage, offsets[:-1] - lo, np.diff(offsets)


def _shape_matrix(arr: pa.ChunkedArray, ndim: int) -> np.ndarray:
    """int64 ``[N, ndim]`` from a list<int> column; ``ColumnError`` if a row has another rank."""
    n = len(arr)
    out = np.empty((n, ndim), dtype=np.int64)
    row = 0
    for chunk in arr.chunks:
        if chunk.null_count:
            raise ColumnError("contains null values")
        lens = np.diff(chunk.offsets.to_numpy(zero_copy_only=False))
        bad = np.nonzero(lens != ndim)[0]
        if bad.size:
            raise ColumnError(f"row {row + int(bad[0])} has rank {int(lens[bad[0]])}, expected {ndim}")
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        if values.size and values.min() < 0:
            raise ColumnError("contains a negative dimension")
        if values.size and values.max() > MAX_DIM:
            raise ColumnError(f"contains a dimension above {MAX_DIM} (the format stores int32)")
        out[row : row + len(chunk)] = values.reshape(len(chunk), ndim)
        row += len(chunk)
    return out


def _dtype_codes(arr: pa.ChunkedArray) -> tuple[np.ndarray, tuple[str, ...]]:
    """Dictionary-encode a dtype-name column: (int64 codes [N], names); checks the names."""
    if arr.null_count:
        raise ColumnError("contains null values")
    enc = arr.combine_chunks().dictionary_encode()
    names = tuple(str(s) for s in enc.dictionary.to_pylist())
    unknown = [s for s in names if s not in DTYPES]
    if unknown:
        raise ColumnError(f"has unsupported dtype {unknown[0]!r}; expected one of {sorted(DTYPES)}")
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), names


def _as_chunked(a: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray:
    return a if isinstance(a, pa.ChunkedArray) else pa.chunked_array([a])


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def decode_tensor_column(
    bytes_col: pa.ChunkedArray | pa.Array,
    shape_col: pa.ChunkedArray | pa.Array,
    dtype_col: pa.ChunkedArray | pa.Array,
    ndim: int,
) -> TensorColumn:
    """Decode a ``(*_bytes, *_shape, *_dtype)`` column triple into a :class:`TensorColumn`.

    Vectorised: one memory copy per arrow chunk of bytes, numpy for shapes, sizes and dtype codes;
    no per-row Python work. ``ColumnError`` (a ``ValueError``) if a row's rank is not ``ndim``, a
    dtype name is unknown, a value is null, or a row's byte count is not
    ``prod(shape) * itemsize`` (the message names the row position).
    """
    bytes_col, shape_col, dtype_col = map(_as_chunked, (bytes_col, shape_col, dtype_col))
    buffers, chunk_idx, starts, lengths = [], [], [], []
    for k, chunk in enumerate(bytes_col.chunks):
        storage, start, length = _binary_chunk_layout(chunk)
        buffers.append(storage)
        chunk_idx.append(np.full(len(chunk), k, dtype=np.int64))
        starts.append(start)
        lengths.append(length)
    chunk_arr, start_arr, len_arr = _concat(chunk_idx), _concat(starts), _concat(lengths)
    shapes = _shape_matrix(shape_col, ndim)
    codes, names = _dtype_codes(dtype_col)
    bad = _byte_count_mismatches(shapes, codes, names, len_arr)
    if bad.size:
        i = int(bad[0])
        name = names[int(codes[i])]
        raise ColumnError(
            f"row {i}: {int(len_arr[i])} bytes do not match shape {shapes[i].tolist()} "
            f"and dtype {name} ({exact_nbytes(shapes[i].tolist(), name)} bytes expected)"
        )
    return TensorColumn(tuple(buffers), chunk_arr, start_arr, len_arr, shapes, codes, names)


def _byte_count_mismatches(shapes: np.ndarray, codes: np.ndarray, names: tuple[str, ...],
                           lengths: np.ndarray) -> np.ndarray:
    """Row positions whose byte length is not ``prod(shape) * itemsize``, computed exactly.

    The product is taken in Python integers once per distinct (shape, dtype) pair (a split holds a
    handful: one latent layout, one text width), so a shape whose int64 product would wrap never
    matches a short buffer."""
    if not len(lengths):
        return np.zeros(0, dtype=np.int64)
    keys, inverse = np.unique(np.column_stack([shapes, codes]), axis=0, return_inverse=True)
    limit = np.iinfo(np.int64).max
    per_key = np.array([min(exact_nbytes(k[:-1].tolist(), names[int(k[-1])]), limit) for k in keys], dtype=np.int64)
    expected = per_key[inverse.reshape(-1)]
    exact = expected != limit  # a product at the int64 limit cannot be any buffer's length
    return np.nonzero(~exact | (expected != lengths))[0]
