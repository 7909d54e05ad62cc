"""Checks of a model folder in transformers' layout that read only its small files (no weights, no code): what a
validate scorer (a CLIP folder) and a reward model (an image classifier) ask of the folder a user names, before any
weights load.

Each check raises the exception ``fail(message)`` makes, so a caller keeps its own error type and prefix (a params
key's ``UserError`` line, a config's ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

CONFIG_BYTES = 1 << 20  # a config.json larger than this is not read (a FIFO or a device there never blocks)
SAFETENSORS_ONLY = "pickled .bin weights are not loaded: a pickle can run code"


def read_model_config(folder: Path, hint: str, fail: Callable[[str], Exception]) -> Any:
    """``folder``'s ``config.json`` as parsed JSON; ``fail(message)`` raised — ``message`` one line ending in ``hint``
    (what to point the setting at) — when ``folder`` is not a folder, has no ``config.json`` or it is not readable
    JSON."""
    from distillery.common.fsutil import read_json_file

    if not folder.is_dir():
        raise fail(f"{folder} does not exist or is not a folder; {hint}")
    try:
        return read_json_file(folder / "config.json", CONFIG_BYTES)
    except FileNotFoundError:
        raise fail(f"{folder} has no config.json: not a transformers model folder; {hint}") from None
    except (OSError, ValueError) as exc:
        raise fail(f"{folder}/config.json is not readable JSON ({str(exc)[:80]}); {hint}") from None


def require_safetensors(folder: Path, fail: Callable[[str], Exception], advice: str = "") -> None:
    """``fail(message)`` raised unless ``folder`` holds ``*.safetensors`` weights (``advice``: how to make them, added
    to the line)."""
    if not any(folder.glob("*.safetensors")):
        raise fail(f"{folder} has no .safetensors weights ({SAFETENSORS_ONLY})" + (f"; {advice}" if advice else ""))
