"""The offline PNG plots: each loss on its own with its moving mean; adherence labels that never overprint."""

from __future__ import annotations

import pytest

from distillery.engine.run_log import component_losses
from distillery.evaluation.plots import adherence_figure, loss_figure, smoothed, write_loss_plot


def test_moving_mean_is_centred_and_cut_at_the_ends():
    assert smoothed([0.0, 3.0, 0.0, 3.0, 0.0], 3) == pytest.approx([1.5, 1.0, 2.0, 1.0, 1.5])
    assert smoothed([2.0], 5) == [2.0]


def test_an_alternating_method_plots_each_loss_on_its_own(tmp_path):
    """DMD2 / Self-Forcing log a critic loss every step and a generator loss every other step: the total
    saw-tooths between them, so the plot draws the two losses (per step and smoothed), not the total."""
    rows = [{"step": s, "critic_loss": 0.5, "total_loss": 0.5 + (1.0 if s % 2 == 0 else 0.0),
             **({"generator_loss": 1.0} if s % 2 == 0 else {})} for s in range(1, 21)]
    losses = component_losses(rows)
    assert list(losses) == ["critic_loss", "generator_loss"]
    assert [p["step"] for p in losses["generator_loss"]] == list(range(2, 21, 2))
    total = [{"step": r["step"], "loss": r["total_loss"]} for r in rows]
    ax = loss_figure(total, "distill", losses).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"critic_loss (per step)", "critic_loss (moving mean, 3 points)",
                          "generator_loss (per step)", "generator_loss (moving mean, 3 points)"}
    assert list(lines["generator_loss (per step)"].get_xdata()) == list(range(2, 21, 2))
    assert not any(max(line.get_ydata()) > 1.0 for line in lines.values())  # no saw-tooth total (1.5) drawn
    assert write_loss_plot(total, tmp_path / "loss.png", "distill", losses).read_bytes()[:4] == b"\x89PNG"


def test_a_single_loss_gets_a_smoothed_line():
    rows = [{"step": s, "loss": float(s % 3)} for s in range(1, 31)]
    labels = [line.get_label() for line in loss_figure(rows, "teacher").axes[0].get_lines()]
    assert labels == ["total_loss (per step)", "total_loss (moving mean, 3 points)"]


def test_adherence_labels_at_the_same_point_do_not_overprint():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rows = [{"candidate": name, "nfe": nfe, "adherence": a, "adherence_std": 0.1}
            for name, nfe, a in [("teacher_40", 80, 0.5), ("teacher_1", 2, 0.5), ("pdd_2", 2, 0.5), ("pdd_1", 1, 0.5),
                                 ("pretrain_40", 80, 0.5), ("pdd_4", 4, 0.5), ("teacher_2", 4, 0.5625)]]
    fig = adherence_figure(rows)
    renderer = FigureCanvasAgg(fig).get_renderer()
    texts = [t for t in fig.axes[0].texts]
    assert sorted(t.get_text() for t in texts) == sorted(r["candidate"] for r in rows)
    boxes = [t.get_window_extent(renderer) for t in texts]
    clashes = [(texts[i].get_text(), texts[j].get_text()) for i in range(len(boxes)) for j in range(i)
               if boxes[i].overlaps(boxes[j])]
    assert clashes == []
