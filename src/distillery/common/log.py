"""The project logger.

Everything logs through ``logging.getLogger("distillery")`` (or a child of it). Under
torchrun only rank 0 emits INFO; other ranks emit warnings and errors only.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "distillery"


def get_logger(name: str | None = None) -> logging.Logger:
    """Return the project logger or a child of it (``distillery.<name>``)."""
    return logging.getLogger(LOGGER_NAME if not name else f"{LOGGER_NAME}.{name}")


class _CurrentStderrHandler(logging.StreamHandler):
    """A stream handler that writes to ``sys.stderr`` as it is at each record, not as it was at set-up: a stream
    swapped in later and closed (a test's capture, a caller's redirect) never receives a line after it closed."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__/setStream assign it; the current stderr always wins
        pass


def setup_logging(rank: int | None = None, level: int = logging.INFO) -> None:
    """Configure the project logger once per process: rank 0 at ``level``, others at WARNING."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    logger = logging.getLogger(LOGGER_NAME)
    if not any(getattr(h, "_distillery", False) for h in logger.handlers):
        handler = _CurrentStderrHandler()
        prefix = f"[rank{rank}] " if rank else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
        handler._distillery = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level if rank == 0 else logging.WARNING)


def quiet_library_progress() -> None:
    """Silence transformers'/diffusers' own load/save progress bars (ours are enough)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import diffusers.utils.logging as dlog
        import transformers.utils.logging as tlog

        tlog.disable_progress_bar()
        dlog.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
