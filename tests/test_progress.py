"""Progress of long loops: sparse log lines (steps, loss, rate, ETA) when stderr is not a terminal."""

from __future__ import annotations

import logging

import pytest

from distillery.common.progress import Progress, format_duration

LOG = logging.getLogger("test_progress")  # not the project logger: its handler may not propagate to caplog


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG.name]


def test_lines_mode_writes_a_line_per_ten_percent_not_per_step(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOG.name)
    bar = Progress(120, "train", "step", mode="lines", interval_s=3600, logger=LOG)
    for step in range(1, 121):
        bar.update(1, loss=1.0 / step)
    bar.close()
    lines = _lines(caplog)
    assert len(lines) == 11, lines  # the first step, then each new 10 % (the last is 100 %)
    assert lines[0].startswith("train 1/120 (1%) loss 1, ") and "ETA " in lines[0]
    assert lines[1].startswith("train 12/120 (10%) loss 0.08333, ")
    assert lines[-1].startswith("train 120/120 (100%) loss 0.008333, ") and "done in " in lines[-1]
    bar.update(1)  # after close: nothing more
    assert len(_lines(caplog)) == 11


def test_lines_mode_also_writes_every_interval_and_counts_a_resumed_run(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOG.name)
    with Progress(1000, "validate", "video", initial=500, mode="lines", interval_s=0.0, logger=LOG) as bar:
        bar.set(candidate="teacher_40 (1/3)")
        for _ in range(3):
            bar.update()
    lines = _lines(caplog)
    assert [line.split(" (")[0] for line in lines] == ["validate 501/1000", "validate 502/1000", "validate 503/1000"]
    assert "candidate teacher_40 (1/3)" in lines[-1]


def test_disabled_progress_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOG.name)
    with Progress(10, "train", enabled=False, mode="lines", logger=LOG) as bar:  # a rank other than 0
        for _ in range(10):
            bar.update(1, loss=0.5)
    assert _lines(caplog) == []


@pytest.mark.parametrize("seconds, shown", [(4.4, "4s"), (65, "1m05s"), (7620, "2h07m"), (float("inf"), "?")])
def test_format_duration(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown


class _Clock:
    """A monotonic clock the test moves by hand (the module's ``time``: its ``monotonic``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_eta_counts_the_steady_steps_not_the_compiling_first_one(caplog, monkeypatch) -> None:
    """A first step of 300 s (start-up, torch.compile), then 15 s a step: at 10 % of 120 steps the ETA is the
    108 steady steps left × 15 s = 27 min (the whole-run average said 108 × 39 s = 70 min); after the first step
    alone nothing steady is known: ``ETA ?``, not 119 × 300 s."""
    import distillery.common.progress as progress

    clock = _Clock()
    monkeypatch.setattr(progress, "time", clock)
    caplog.set_level(logging.INFO, logger=LOG.name)
    bar = Progress(120, "train", "step", mode="lines", interval_s=3600, logger=LOG)
    clock.now += 300
    bar.update(1)
    for _ in range(11):
        clock.now += 15
        bar.update(1)
    lines = _lines(caplog)
    assert lines[0] == "train 1/120 (1%), 300.0 s/step, ETA ?", lines
    assert lines[1] == "train 12/120 (10%), 15.0 s/step, ETA 27m00s", lines
    for _ in range(108):
        clock.now += 15
        bar.update(1)
    assert _lines(caplog)[-1] == "train 120/120 (100%), 15.0 s/step, done in 34m45s"


def test_a_resumed_run_leaves_out_its_own_first_step(caplog, monkeypatch) -> None:
    import distillery.common.progress as progress

    clock = _Clock()
    monkeypatch.setattr(progress, "time", clock)
    bar = Progress(100, "train", initial=50, mode="off")
    clock.now += 120  # restoring the checkpoint, compiling
    bar.update(1)
    assert bar.eta_s() == float("inf")
    for _ in range(9):
        clock.now += 2
        bar.update(1)
    assert bar.eta_s() == 40 * 2.0
