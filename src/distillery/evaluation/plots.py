"""The pipeline's plots as PNG images, drawn offline (matplotlib, Agg backend): no browser, no CDN.

``dvc plots show`` renders ``plots/`` through Vega-Lite from a CDN; these images are the same
curves for a machine without network, written beside the data they plot:

- :func:`write_loss_plot` — a training stage's loss per step (``artifacts/<stage>/loss.png``
  beside ``loss.json``): each loss on its own, per step and as a moving mean;
- :func:`write_adherence_plot` — validate's prompt adherence against NFE per candidate family
  (``artifacts/validate/report/plots/adherence_vs_nfe.png`` beside ``adherence.csv``).

The same data gives the same bytes (no timestamp or version in the PNG's metadata), so an artifact
made again from the same inputs stays byte-identical.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FIGSIZE_IN = (6.4, 4.0)  # width, height in inches
DPI = 100  # pixels per inch of the PNG


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only, whatever the environment's display
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI)  # not pyplot: no global state, nothing left open
    return fig, fig.add_subplot(1, 1, 1)


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})  # no version stamp: same data, same bytes
    return path


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """Centred moving mean of ``values`` over ``window`` points (odd; fewer at the ends, where the window
    is cut to the points there are): the trend of a noisy per-step curve."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    half = max(0, int(window) // 2)
    sums = np.concatenate([[0.0], np.cumsum(v)])
    lo = np.clip(np.arange(len(v)) - half, 0, len(v))
    hi = np.clip(np.arange(len(v)) + half + 1, 0, len(v))
    return [float(x) for x in (sums[hi] - sums[lo]) / np.maximum(hi - lo, 1)]


def smoothing_window(points: int) -> int:
    """The moving mean's width for a curve of ``points`` points: about a tenth of it, odd, at least 3."""
    return max(3, (points // 10) | 1)


def write_loss_plot(rows: Sequence[Mapping[str, float]], path: Path, title: str,
                    components: Mapping[str, Sequence[Mapping[str, float]]] | None = None) -> Path:
    """:func:`loss_figure` written to ``path``."""
    return _save(loss_figure(rows, title, components), path)


def loss_figure(rows: Sequence[Mapping[str, float]], title: str,
                components: Mapping[str, Sequence[Mapping[str, float]]] | None = None) -> Any:
    """A training stage's loss curves: each of ``components`` (``{name: [{"step", "loss"}]}``,
    the losses a method logs on its own: a critic loss every step and a generator loss every other
    step are two curves, not one saw-tooth total) or, without them, ``rows`` (``[{"step": s, "loss": l}]``,
    the stage's ``loss.json``: total_loss). Each curve is drawn per step (thin) and as its moving mean
    (:func:`smoothed`, :func:`smoothing_window` points) on top."""
    fig, ax = _figure()
    series = {name: list(points) for name, points in (components or {}).items() if points} or {"total_loss": list(rows)}
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    for n, (name, points) in enumerate(series.items()):
        steps = [float(r["step"]) for r in points]
        values = [float(r["loss"]) for r in points]
        colour = colours[n % len(colours)]
        ax.plot(steps, values, color=colour, linewidth=0.8, alpha=0.35, marker="." if len(points) < 40 else None,
                label=f"{name} (per step)")
        if len(points) >= 3:
            window = smoothing_window(len(points))
            ax.plot(steps, smoothed(values, window), color=colour, linewidth=2.0, label=f"{name} (moving mean, {window} points)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def candidate_family(name: str) -> str:
    """``teacher_40`` → ``teacher``, ``pdd_4`` → ``pdd``: the model a validation candidate samples."""
    head, _, tail = name.rpartition("_")
    return head if head and tail.isdigit() else name


def _spread_labels(fig: Any, labels: Sequence[Any], step_pt: float = 9.0, tries: int = 24) -> None:
    """Move annotations (offset in points from their point) up or down, in steps of ``step_pt``, until no
    two of their text boxes overlap: labels of points at the same place stack instead of overprinting."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    placed: list[Any] = []
    for label in labels:
        dx, dy = label.xyann
        for k in range(tries):
            shift = ((k + 1) // 2) * step_pt * (1 if k % 2 else -1) if k else 0.0  # 0, +1, −1, +2, −2 … steps
            label.xyann = (dx, dy + shift)
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
        placed.append(label.get_window_extent(renderer))


def write_adherence_plot(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """:func:`adherence_figure` written to ``path``."""
    return _save(adherence_figure(rows), path)


def adherence_figure(rows: Sequence[Mapping[str, Any]]) -> Any:
    """Validate's rows (``candidate``, ``nfe``, ``adherence``, ``adherence_std``: its ``adherence.csv``) as
    adherence vs NFE (log scale), one line with spread bars per candidate family, each point labelled
    (labels that would overprint are stacked: :func:`_spread_labels`)."""
    fig, ax = _figure()
    families: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        families.setdefault(candidate_family(str(row["candidate"])), []).append(row)
    labels = []
    for family, members in families.items():
        members = sorted(members, key=lambda r: float(r["nfe"]))
        nfe = [float(r["nfe"]) for r in members]
        ax.errorbar(nfe, [float(r["adherence"]) for r in members], yerr=[float(r["adherence_std"]) for r in members],
                    marker="o", capsize=3, linewidth=1.2, label=family)
        for r in members:
            labels.append(ax.annotate(str(r["candidate"]), (float(r["nfe"]), float(r["adherence"])),
                                      textcoords="offset points", xytext=(4, 3), fontsize=7))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("NFE per video (transformer forwards, log scale)")
    ax.set_ylabel("prompt adherence (all), ± std over seeds")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("adherence vs NFE")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    labels.sort(key=lambda a: (a.xy[0], a.xy[1]))
    _spread_labels(fig, labels)
    return fig
