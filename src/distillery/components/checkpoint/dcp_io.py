"""Reading a checkpoint's DCP folder without executing anything stored in it.

``torch.distributed.checkpoint`` (DCP) keeps two kinds of pickles: the folder's ``.metadata``
(read by ``FileSystemReader`` with an unrestricted unpickler) and the non-tensor items inside the
``.distcp`` shards (optimizer hyper-parameters: read by ``DefaultLoadPlanner`` with an
unrestricted ``torch.load``). Either runs arbitrary code when crafted. Every DCP load of the
package goes through :func:`load_dcp`, which reads

- ``.metadata`` with :class:`MetadataUnpickler`: only the classes DCP metadata holds
  (:data:`METADATA_GLOBALS`, plus ``torch`` dtypes) are resolved; anything else is refused with a
  :class:`~distillery.common.errors.UserError` naming the checkpoint and the refused global, before any
  object is built from it;
- the shards' non-tensor items with ``torch.load(weights_only=True)`` (torch's own allow-list);
- rank-local ``__<rank>.metadata`` files never (this project does not write them).

:func:`checkpoint_load_error` turns DCP's multi-rank exception into one line.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from distillery.common.errors import UserError

_DCP_META = "torch.distributed.checkpoint.metadata"

# Every global a DCP ``.metadata`` written by this project holds (found by unpickling checkpoints of
# 1- and 2-rank runs, with and without FSDP, EMA and optimizer states; torch 2.13). ``pathlib``:
# ``StorageMeta.checkpoint_id`` is the save folder as a path object.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (_DCP_META, "Metadata"),
    (_DCP_META, "MetadataIndex"),
    (_DCP_META, "StorageMeta"),
    (_DCP_META, "TensorStorageMetadata"),
    (_DCP_META, "BytesStorageMetadata"),
    (_DCP_META, "ChunkStorageMetadata"),
    (_DCP_META, "TensorProperties"),
    (_DCP_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided")
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib._local", "PosixPath"),  # Python >= 3.13
    ("pathlib._local", "WindowsPath"),
})

METADATA_FILE = ".metadata"


def _cut(text: object, limit: int = 160) -> str:
    s = str(text)
    return s if len(s) <= limit else s[: limit - 1] + "…"


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside the allow-list."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualified = f"{module}.{name}"


class MetadataUnpickler(pickle.Unpickler):
    """Unpickler that resolves only :data:`METADATA_GLOBALS` and ``torch`` dtypes.

    ``find_class`` is the only way a pickle reaches a callable (GLOBAL, STACK_GLOBAL, INST, OBJ
    and EXT opcodes all go through it), so nothing outside the list can be called or built.
    Persistent ids are refused by ``pickle.Unpickler`` itself.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedGlobal(module, name)


def read_dcp_metadata(dcp_dir: Path) -> Metadata:
    """The DCP ``Metadata`` of ``dcp_dir``, read with :class:`MetadataUnpickler` and checked.

    Raises a one-line :class:`UserError` naming the checkpoint when a global is refused, the file
    is missing, truncated or not DCP metadata, or it points at a shard outside the folder.
    """
    path = Path(dcp_dir) / METADATA_FILE
    where = _cut(Path(dcp_dir).parent)
    try:
        with path.open("rb") as fh:
            metadata = MetadataUnpickler(fh).load()
    except RefusedGlobal as exc:
        raise UserError(f"checkpoint {where}: refused to load dcp/{METADATA_FILE}: it names the global "
                        f"{_cut(exc.qualified, 100)}, which DCP metadata never holds (a crafted or foreign file)") from None
    except FileNotFoundError:
        raise UserError(f"checkpoint {where}: dcp/{METADATA_FILE} is missing") from None
    except Exception as exc:  # truncated or garbled pickle: EOFError, UnpicklingError, ValueError, ...
        raise UserError(f"checkpoint {where}: dcp/{METADATA_FILE} is unreadable ({type(exc).__name__}: "
                        f"{_cut(exc, 100) or 'truncated'})") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise UserError(f"checkpoint {where}: dcp/{METADATA_FILE} is not DCP checkpoint metadata")
    for info in metadata.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise UserError(f"checkpoint {where}: dcp/{METADATA_FILE} points at a shard outside its folder ({_cut(rel, 80)!r})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from :func:`read_dcp_metadata` (read once, cached)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # rank-local metadata: never written here, never read
            raise UserError(f"checkpoint {_cut(Path(self.path).parent)}: has no dcp/{METADATA_FILE}")
        if self._metadata is None:
            self._metadata = read_dcp_metadata(Path(self.path))
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor items with ``torch.load(weights_only=True)``."""

    def __init__(self, checkpoint: str) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.refusal: UserError | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            text = str(exc)
            found = re.search(r"Unsupported global: GLOBAL (\S+)", text)  # torch names builtins without "builtins."
            name = found.group(1) if found else ""
            name = name if "." in name or not name else f"builtins.{name}"
            what = f"it names the global {_cut(name, 100)}" if name else type(exc).__name__
            self.refusal = UserError(f"checkpoint {_cut(self.checkpoint)}: refused to load the item "
                                     f"{_cut(read_item.dest_index.fqn, 100)} of its dcp shards: {what}")
            raise self.refusal from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def user_error_inside(exc: BaseException) -> UserError | None:
    """The first :class:`UserError` one of DCP's ranks raised, if ``exc`` carries one."""
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, CheckpointException):
        for _, (inner, _trace) in sorted(exc.failures.items()):
            if isinstance(inner, UserError):
                return inner
    return None


def checkpoint_load_error(checkpoint: Path, what: str, exc: BaseException) -> UserError:
    """One line for a DCP load that failed (a key the checkpoint lacks, a shape that differs, ...)."""
    inner = user_error_inside(exc)
    if inner is not None:
        return inner
    if isinstance(exc, CheckpointException):
        exc = next((e for _, (e, _t) in sorted(exc.failures.items())), exc)
    text = str(exc)
    missing = re.search(r"Missing key in checkpoint state_dict: ([^\s\\]+?)\.?(?:\s|\\n|$)", text)
    reason = (f"the checkpoint has no {missing.group(1)}" if missing
              else _cut((text.strip().splitlines() or [type(exc).__name__])[0], 200))
    return UserError(f"{_cut(checkpoint)}: cannot load {what}: {reason}")


def load_dcp(state: dict[str, Any], dcp_dir: Path, what: str) -> None:
    """``dcp.load(state, ...)`` from ``dcp_dir`` through the safe reader and planner.

    Collective under a process group (every rank calls it). ``what`` names the loaded part for
    error messages. Any failure raises a one-line :class:`UserError`.
    """
    dcp_dir = Path(dcp_dir)
    reader = SafeFileSystemReader(dcp_dir)
    reader.read_metadata()  # refuse a crafted or broken .metadata before DCP starts its collectives
    planner = SafeLoadPlanner(str(dcp_dir.parent))
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except (CheckpointException, RuntimeError, ValueError, KeyError, OSError, pickle.UnpicklingError, EOFError) as exc:
        raise checkpoint_load_error(dcp_dir.parent, what, exc) from None
