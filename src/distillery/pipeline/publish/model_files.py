"""The files of a model folder, checked before the pipeline takes it in (docs/reliability.md).

A base folder (``base.path``) is copied by the base stage and read by every later stage; what it holds
must not hang, exhaust or crash them. :func:`check_model_files` walks the folder once, reading no more
than each safetensors file's header, and refuses in one :class:`UserError` line:

- anything that is not a file or a folder: a FIFO (copying it blocks forever), a device (a link to
  ``/dev/zero`` is copied until the disk is full), a socket — also when reached through a symbolic link;
- a symbolic link loop (``vae/loop → .``, a link to itself): copying it recurses until the path is too long;
- a config, tokenizer or other non-weight file of a component larger than :data:`MAX_SMALL_FILE`
  (a 1 GiB ``tokenizer.json`` costs every stage 2.5 GB of memory; a real umT5 one is 16 MiB);
- a ``.safetensors`` file whose header is not one: its length field past :data:`MAX_HEADER_BYTES` or the
  file, JSON that is not an object of tensor entries, a dtype or shape of the wrong type, data offsets
  outside the file or not the tensor's size (diffusers would fail later with an ``OSError`` traceback,
  or allocate what the header claims).

Symbolic links to regular files are followed (a Hugging Face cache snapshot links its blobs); a link
to a folder is followed unless it leads back into a folder already on the walk. At most
:data:`MAX_ENTRIES` entries are walked.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
from pathlib import Path

from distillery.common.errors import UserError
from distillery.common.fsutil import MAX_JSON_DEPTH, file_kind, json_depth

MAX_SMALL_FILE = 64 << 20  # bytes of a component's config / tokenizer file (umT5's tokenizer.json: 16 MiB)
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own bound on its JSON header
MAX_ENTRIES = 100_000
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}


def safetensors_problem(path: Path) -> str | None:
    """Why the file ``path`` is not a well-formed safetensors file (header only), or None."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                return f"its header claims {n} bytes (the file has {size}; the format allows at most {MAX_HEADER_BYTES})"
            raw = fh.read(n)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    try:
        text = raw.decode("utf-8")
        if json_depth(text) > MAX_JSON_DEPTH:
            return "its header nests deeper than a safetensors header"
        header = json.loads(text)
    except ValueError:
        return "its header is not UTF-8 JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data_bytes = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            if not (isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())):
                return "__metadata__ is not an object of strings"
            continue
        problem = _tensor_entry_problem(entry, data_bytes)
        if problem:
            return f"tensor {name[:60]!r}: {problem}"
    return None


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _tensor_entry_problem(entry: object, data_bytes: int) -> str | None:
    if not isinstance(entry, dict):
        return "not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        return "no dtype"
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        return "shape is not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        return "data_offsets is not [begin, end]"
    begin, end = offsets
    if not begin <= end <= data_bytes:
        return f"data_offsets {offsets} outside the file's {data_bytes} data bytes"
    if dtype in DTYPE_BYTES and (end - begin) != math.prod(shape) * DTYPE_BYTES[dtype]:
        return f"{end - begin} bytes for a {dtype} tensor of shape {shape}"
    return None


def check_model_files(folder: Path, what: str, components: tuple[str, ...] = ()) -> None:
    """Walk the model folder ``folder`` (module doc) and raise one :class:`UserError` line, prefixed by ``what``,
    for the first entry a model folder may not hold. ``components``: the component folders whose non-weight
    files are bounded by :data:`MAX_SMALL_FILE`."""
    folder = Path(folder)
    root_real = os.path.realpath(folder)
    stack: list[tuple[Path, tuple[str, ...]]] = [(folder, (root_real,))]
    seen = 0
    while stack:
        here, ancestors = stack.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError as exc:
            raise UserError(f"{what}: {_rel(here, folder)} cannot be listed ({exc.strerror or exc})") from None
        for entry in entries:
            seen += 1
            if seen > MAX_ENTRIES:
                raise UserError(f"{what}: more than {MAX_ENTRIES} files and folders: not a model folder")
            path = Path(entry.path)
            rel = _rel(path, folder)
            try:
                st = os.stat(path)  # through a link: what a copy or a load would read
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UserError(f"{what}: {rel} is a symbolic link loop; a model folder holds files and folders") from None
                raise UserError(f"{what}: {rel} cannot be read ({exc.strerror or exc}; a dangling link?)") from None
            if stat.S_ISDIR(st.st_mode):
                real = os.path.realpath(path)
                if any(real == a or a.startswith(real + os.sep) for a in ancestors):  # itself or above it
                    raise UserError(f"{what}: {rel} links back to a folder above it (a loop); a model folder holds "
                                    "files and folders")
                stack.append((path, (*ancestors, real)))
                continue
            if not stat.S_ISREG(st.st_mode):
                via = " through a symbolic link" if entry.is_symlink() else ""
                raise UserError(f"{what}: {rel} is {file_kind(st.st_mode)}{via}, not a file: a model folder holds "
                                "files and folders (copying it would block or never end)")
            _check_file(path, rel, st.st_size, what, components)


def _check_file(path: Path, rel: str, size: int, what: str, components: tuple[str, ...]) -> None:
    name = path.name.lower()
    if name.endswith(".safetensors"):
        problem = safetensors_problem(path)
        if problem:
            raise UserError(f"{what}: {rel} is not a valid safetensors file: {problem}")
    elif rel.split("/", 1)[0] in components and size > MAX_SMALL_FILE and not name.endswith(WEIGHT_SUFFIXES):
        raise UserError(f"{what}: {rel} is {size} bytes, more than the {MAX_SMALL_FILE >> 20} MiB a model's config or "
                        "tokenizer file may be (a real Wan 2.1 tokenizer.json is 16 MiB)")


def _rel(path: Path, folder: Path) -> str:
    try:
        return path.relative_to(folder).as_posix() or "."
    except ValueError:
        return str(path)
