"""Progress of a long loop (training steps, validation videos, preprocessing shards) on the console.

:class:`Progress` shows ``done/total``, the percentage, the rate, the ETA and a few live values
(``loss``, the candidate being sampled). Where it shows them depends on stderr:

- a terminal: a tqdm bar (redrawn in place, at most once a second);
- anything else (``dvc repro`` piped to a file, a Prefect task streaming the stage's output into
  its log, CI): one log line through the project logger when the first item is done, then at
  most one line per :data:`EVERY_PERCENT` % of the total or per ``interval_s`` seconds
  (:data:`DEFAULT_INTERVAL_S`; ``$DISTILLERY_PROGRESS_INTERVAL_S`` overrides it), whichever comes
  first, and one line at the end — about a dozen lines per loop, never a flood.

The rate and the ETA are the recent ones: measured over the last :data:`RECENT_ITEMS` items (or the last tenth of the
loop, if longer) after this process's first item — so neither the start-up and the first item (CUDA init,
``torch.compile``, the data loader's first batch: often minutes, the cost of many steady steps) nor a slow stretch
long past (the cores shared with another job for a while) counts as the loop's pace now. After the first item alone
no rate is known yet: the line shows that item's time and ``ETA ?``.

``$DISTILLERY_PROGRESS`` = ``bar`` | ``lines`` | ``off`` forces a mode (default ``auto``: as above).
Only the process that should talk shows anything: pass ``enabled=False`` on ranks other than 0.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from distillery.common.log import get_logger

RECENT_ITEMS = 10  # the rate and ETA: over the last this many items (or the last tenth of the loop, if longer)
EVERY_PERCENT = 10  # lines mode: a line at each new multiple of this percentage of the total
DEFAULT_INTERVAL_S = 60.0  # lines mode: a line at least this often (seconds) while items complete
MODES = ("auto", "bar", "lines", "off")


def format_duration(seconds: float) -> str:
    """``"45s"``, ``"3m05s"``, ``"2h07m"`` (``"?"`` for an unknown or infinite duration)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _mode() -> str:
    mode = os.environ.get("DISTILLERY_PROGRESS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        mode = "auto"
    if mode == "auto":
        return "bar" if sys.stderr.isatty() else "lines"
    return mode


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("DISTILLERY_PROGRESS_INTERVAL_S", DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


class Progress:
    """``done/total`` of a loop with rate and ETA, as a bar on a terminal or as sparse log lines.

    ``desc``: what is counted (``"train"``, ``"validate"``); ``unit``: one item (``"step"``,
    ``"video"``); ``initial``: items already done before this process (a resumed run: the rate
    and ETA count only this process's items, its first one left out: module doc).
    ``logger``/``interval_s``/``clock`` (seconds, monotonic) override the defaults (tests).
    Call :meth:`update` after each item (``values``: live numbers/labels shown beside the count,
    e.g. ``loss=0.1234``), :meth:`close` at the end (or use it as a context manager).
    """

    def __init__(self, total: int, desc: str, unit: str = "step", initial: int = 0, enabled: bool = True,
                 logger: logging.Logger | None = None, interval_s: float | None = None, mode: str | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.total, self.desc, self.unit = max(0, int(total)), desc, unit
        self.done = self.initial = int(initial)
        self.mode = "off" if not enabled else (mode or _mode())
        self.log = logger or get_logger("progress")
        self.interval_s = _interval() if interval_s is None else interval_s
        self.values: dict[str, Any] = {}
        self.clock = clock or time.monotonic
        self.started = self.last_line = self.clock()
        self.warm: tuple[float, int] | None = None  # (time, done) when this process's first item ended
        self.marks: collections.deque[tuple[float, int]] = collections.deque()  # (time, done) of the recent items
        self.last_percent_step = -1  # the multiple of EVERY_PERCENT last reported
        self.lines = 0  # log lines written (lines mode)
        self._bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=self.initial, desc=desc, unit=unit, dynamic_ncols=True,
                             mininterval=1.0)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def steady_s(self) -> float | None:
        """Seconds per item over the recent items (module doc: the last :data:`RECENT_ITEMS`, or the last tenth of the
        loop, after this process's first item); None until an item after the first ends."""
        if not self.marks or self.done <= self.marks[0][1]:
            return None
        return (self.clock() - self.marks[0][0]) / (self.done - self.marks[0][1])

    def eta_s(self) -> float:
        """Seconds left at the recent rate (:meth:`steady_s`); inf while it is unknown."""
        steady = self.steady_s()
        return math.inf if steady is None else steady * (self.total - self.done)

    def line(self) -> str:
        """The text of one progress line: ``train 40/120 (33%) loss 0.1234, 2.1 s/step, ETA 2m48s`` (the recent
        rate; after the first item alone, that item's time)."""
        ran, elapsed = self.done - self.initial, self.clock() - self.started
        pct = 100 * self.done / self.total if self.total else 100
        shown = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.values.items())
        per_item = self.steady_s()
        if per_item is None and ran > 0:
            per_item = elapsed / ran
        if per_item is not None and per_item >= 1:
            rate = f"{per_item:.1f} s/{self.unit}"
        elif per_item is not None:
            rate = f"{1 / max(per_item, 1e-9):.1f} {self.unit}/s"
        else:
            rate = f"? s/{self.unit}"
        left = "done in " + format_duration(elapsed) if self.done >= self.total else "ETA " + format_duration(self.eta_s())
        return f"{self.desc} {self.done}/{self.total} ({pct:.0f}%){' ' + shown if shown else ''}, {rate}, {left}"

    def set(self, **values: Any) -> None:
        """Change the live values shown (without counting an item)."""
        self.values.update(values)
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in self.values.items()},
                                  refresh=False)

    def update(self, n: int = 1, **values: Any) -> None:
        """``n`` more items done; ``values`` replace the live values shown."""
        self.done += n
        now = self.clock()
        if self.warm is None:
            self.warm = (now, self.done)
        self.marks.append((now, self.done))  # the window: from the oldest mark still within it, to now
        window = max(RECENT_ITEMS, self.total // 10)
        while len(self.marks) > 1 and self.done - self.marks[1][1] >= window:
            self.marks.popleft()
        if values:
            self.set(**values)
        if self._bar is not None:
            self._bar.update(n)
            return
        if self.mode != "lines":
            return
        percent_step = int(100 * self.done / self.total) // EVERY_PERCENT if self.total else 0
        first = self.done - self.initial == n
        if first or percent_step > self.last_percent_step or now - self.last_line >= self.interval_s \
                or self.done >= self.total:
            self._emit(now, percent_step)

    def _emit(self, now: float, percent_step: int) -> None:
        self.log.info("%s", self.line())
        self.lines += 1
        self.last_line, self.last_percent_step = now, percent_step

    def close(self) -> None:
        """End the bar (bar mode); nothing more is shown."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.mode = "off"
