"""The pipeline's plots as PNG images, drawn offline (matplotlib, Agg backend): no browser, no CDN.

``dvc plots show`` renders ``plots/`` through Vega-Lite from a CDN; these images are the same
curves for a machine without network, written beside the data they plot:

- :func:`write_loss_plot` — a training stage's loss per step (``artifacts/<stage>/loss.png``
  beside ``loss.json``);
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


def write_loss_plot(rows: Sequence[Mapping[str, float]], path: Path, title: str) -> Path:
    """``rows`` = ``[{"step": s, "loss": l}, ...]`` (a stage's ``loss.json``) as a line plot at ``path``."""
    fig, ax = _figure()
    steps = [float(r["step"]) for r in rows]
    ax.plot(steps, [float(r["loss"]) for r in rows], color="tab:blue", linewidth=1.2, marker="." if len(rows) < 40 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (total_loss)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def candidate_family(name: str) -> str:
    """``teacher_40`` → ``teacher``, ``pdd_4`` → ``pdd``: the model a validation candidate samples."""
    head, _, tail = name.rpartition("_")
    return head if head and tail.isdigit() else name


def write_adherence_plot(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Validate's rows (``candidate``, ``nfe``, ``adherence``, ``adherence_std``: its ``adherence.csv``) as
    adherence vs NFE (log scale), one line with spread bars per candidate family, each point labelled."""
    fig, ax = _figure()
    families: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        families.setdefault(candidate_family(str(row["candidate"])), []).append(row)
    for family, members in families.items():
        members = sorted(members, key=lambda r: float(r["nfe"]))
        nfe = [float(r["nfe"]) for r in members]
        ax.errorbar(nfe, [float(r["adherence"]) for r in members], yerr=[float(r["adherence_std"]) for r in members],
                    marker="o", capsize=3, linewidth=1.2, label=family)
        for r in members:
            ax.annotate(str(r["candidate"]), (float(r["nfe"]), float(r["adherence"])), textcoords="offset points",
                        xytext=(3, 4), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("NFE per video (transformer forwards, log scale)")
    ax.set_ylabel("prompt adherence (all), ± std over seeds")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("adherence vs NFE")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
