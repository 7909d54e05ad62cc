"""Host and RNG state of a checkpoint as JSON plus safetensors: data only, nothing to execute.

``write_state(folder, stem, tree)`` writes ``<stem>.json`` and, when the tree holds tensors,
``<stem>.safetensors``; ``read_state(folder, stem)`` returns an equal tree. A tree is made of
dicts with string keys, lists, tuples, ``str``/``int``/``float``/``bool``/``None``, numpy arrays
and torch tensors (stored on the CPU). In the JSON a tuple is ``{"__tuple__": [...]}``, an array
``{"__ndarray__": {"dtype", "shape", "data"}}`` and a tensor ``{"__tensor__": "<name in the
safetensors file>"}``; those three keys never occur in the state itself. Floats round-trip exactly
(JSON keeps ``repr``), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from distillery.common.errors import UserError
from distillery.common.fsutil import follow_umask

_MARKERS = ("__tuple__", "__ndarray__", "__tensor__")
_NDARRAY_DTYPES = ("uint8", "uint32", "int32", "int64", "uint64", "float32", "float64", "bool")


def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": name}
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in _NDARRAY_DTYPES:
            raise TypeError(f"{where}: numpy dtype {obj.dtype} is not stored in checkpoints")
        return {"__ndarray__": {"dtype": obj.dtype.name, "shape": list(obj.shape), "data": obj.ravel().tolist()}}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str) or k in _MARKERS:
                raise TypeError(f"{where}: key {k!r} cannot be stored in a checkpoint's JSON state")
            out[k] = _encode(v, tensors, f"{where}.{k}")
        return out
    raise TypeError(f"{where}: a {type(obj).__name__} cannot be stored in a checkpoint's JSON state")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if len(obj) == 1 and "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if len(obj) == 1 and "__ndarray__" in obj:
        spec = obj["__ndarray__"]
        if spec["dtype"] not in _NDARRAY_DTYPES:
            raise ValueError(f"numpy dtype {spec['dtype']!r}")
        return np.asarray(spec["data"], dtype=spec["dtype"]).reshape(spec["shape"])
    return {k: _decode(v, tensors) for k, v in obj.items()}


def write_state(folder: Path, stem: str, tree: Any) -> list[Path]:
    """Write ``tree`` as ``folder/<stem>.json`` (+ ``.safetensors``); returns the files written.

    Raises ``TypeError`` (a programming error, not a user error) for values outside the format.
    """
    folder = Path(folder)
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, tensors, stem)
    written = []
    if tensors:
        save_file(tensors, str(folder / f"{stem}.safetensors"))
        follow_umask(folder / f"{stem}.safetensors")  # safetensors writes 0600; a checkpoint's files follow the umask
        written.append(folder / f"{stem}.safetensors")
    doc = {"format": 1, "tensors": bool(tensors), "state": encoded}
    (folder / f"{stem}.json").write_text(json.dumps(doc, separators=(",", ":")))
    written.append(folder / f"{stem}.json")
    return written


def read_state(folder: Path, stem: str) -> Any:
    """The tree :func:`write_state` wrote; a one-line :class:`UserError` if the files are unreadable."""
    folder = Path(folder)
    try:
        doc = json.loads((folder / f"{stem}.json").read_text())
        tensors = load_file(str(folder / f"{stem}.safetensors")) if doc["tensors"] else {}
        return _decode(doc["state"], tensors)
    except Exception as exc:  # missing, truncated, not JSON, a tensor missing from the safetensors file, ...
        raise UserError(f"cannot read the checkpoint state {str(folder / stem)[-160:]}.json/.safetensors "
                        f"({type(exc).__name__}: {str(exc)[:100]})") from None
