"""The scoring half of ``bench/quality.py``: every candidate's metrics against the reference with their bootstrap
intervals over prompts and seeds (:func:`score`), the noise floor of the reference against itself
(:func:`floor_scores`), the goal checks (:func:`check_goals`), sparse against dense (:func:`sparse_vs_dense`) and
the results written (JSON, plot, summary table)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

METRICS = ("kid", "frechet", "adherence", "sharpness", "paired_distance")  # each candidate's scores
ADHERENCE_PARTS = ("colour", "shape", "direction")  # the analyzer's readings behind "all" (reported per candidate)


# -- scoring ------------------------------------------------------------------------------------
def _percentile_ci(samples: np.ndarray) -> list[float]:
    lo, hi = np.percentile(np.asarray(samples, dtype=np.float64), [2.5, 97.5])
    return [round(float(lo), 6), round(float(hi), 6)]


def shifted_ci(estimate: float, samples: np.ndarray, floor: float | None = 0.0) -> list[float]:
    """95% interval of a statistic biased by its sample size (the Fréchet distance: a resample with
    repeated rows has a narrower spread, so its bootstrap distances sit above the estimate): the
    bootstrap percentiles shifted by the bootstrap's bias (their mean − ``estimate``), clipped at ``floor``."""
    bias = float(np.mean(samples)) - estimate
    lo, hi = (v - bias for v in np.percentile(np.asarray(samples, dtype=np.float64), [2.5, 97.5]))
    if floor is not None:
        lo, hi = max(lo, floor), max(hi, floor)
    return [round(float(lo), 6), round(float(hi), 6)]


def bootstrap_mean_ci(values: np.ndarray, resamples: int, seed: int) -> list[float]:
    """95% percentile-bootstrap interval of the mean of ``values [N]`` (resampled with replacement)."""
    v = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(resamples, len(v)))].mean(axis=1)
    return _percentile_ci(means)


@dataclass
class Sampled:
    """One candidate's videos as the scores need them (seed-major order, as validate samples them)."""

    features: np.ndarray  # [N, D] raw video features
    adherence: np.ndarray  # [N] 0/1: the analyzer's "all"
    parts: dict[str, np.ndarray]  # "colour", "shape", "direction": [N] 0/1 each (which reading fails)
    sharpness: np.ndarray  # [N]
    seed_index: np.ndarray  # [N]
    keys: list[str]  # sample keys "<i>" / "<i>_s<j>"
    frames: np.ndarray  # [N, T, H, W, 3] float32 RGB in [0, 1], decoded from the saved latents


def load_sampled(folder: Path, decoder: Any) -> Sampled:
    import torch
    from safetensors.torch import load_file

    report = json.loads((folder / "report.json").read_text())
    (name,) = report["per_video"]
    rows = report["per_video"][name]
    latents = load_file(str(folder / "samples" / name / "latents.safetensors"))
    keys = [r["sample"] for r in rows]
    frames = []
    for start in range(0, len(keys), 16):
        batch = torch.stack([latents[k] for k in keys[start:start + 16]])
        frames.append(decoder.decode_latents(batch).astype(np.float32) / 255.0)
    return Sampled(np.asarray([r["features"] for r in rows], dtype=np.float64), np.asarray([float(r["all"]) for r in rows]),
                   {k: np.asarray([float(r[k]) for r in rows]) for k in ADHERENCE_PARTS},
                   np.asarray([r["sharpness"] for r in rows], dtype=np.float64), np.asarray([r["seed_index"] for r in rows]),
                   keys, np.concatenate(frames))


def score(cand: Sampled, ref: Sampled, scaler: Any, resamples: int) -> dict[str, Any]:
    """Every score of a candidate against the reference, each with its 95% interval (module doc)."""
    from distillery.evaluation.kid import kid, kid_interval
    from distillery.evaluation.video_metrics import bootstrap_frechet, frechet_distance

    if cand.keys != ref.keys:
        raise SystemExit("error: a candidate's videos are not the reference's prompts × seeds")
    z, ref_z = scaler(cand.features), scaler(ref.features)
    paired = ((cand.frames - ref.frames) ** 2).reshape(len(cand.keys), -1).mean(axis=1)
    same = z.shape == ref_z.shape and np.array_equal(z, ref_z)
    fd = frechet_distance(z, ref_z)
    out = {"kid": round(kid(z, ref_z), 6), "kid_ci": [round(v, 6) for v in kid_interval(z, ref_z, resamples, 0)],
           "frechet": round(fd, 6),
           "frechet_ci": [0.0, 0.0] if same else shifted_ci(fd, bootstrap_frechet(z, ref_z, resamples, 0)),
           "adherence": round(float(cand.adherence.mean()), 6), "adherence_ci": bootstrap_mean_ci(cand.adherence, resamples, 1),
           "adherence_parts": {k: round(float(v.mean()), 6) for k, v in cand.parts.items()},
           "sharpness": round(float(cand.sharpness.mean()), 8), "sharpness_ci": bootstrap_mean_ci(cand.sharpness, resamples, 2),
           "paired_distance": round(float(paired.mean()), 8),
           "paired_distance_ci": [0.0, 0.0] if same else bootstrap_mean_ci(paired, resamples, 3)}
    return out


def floor_scores(ref: Sampled, scaler: Any, seeds: int, resamples: int) -> dict[str, Any]:
    """The reference against itself across seeds: indices [0, S/2) vs [S/2, S) (module doc)."""
    from distillery.evaluation.kid import kid, kid_interval
    from distillery.evaluation.video_metrics import bootstrap_frechet, frechet_distance

    half = seeds // 2
    a, b = ref.seed_index < half, (ref.seed_index >= half) & (ref.seed_index < 2 * half)
    za, zb = scaler(ref.features[a]), scaler(ref.features[b])
    paired = ((ref.frames[a] - ref.frames[b]) ** 2).reshape(int(a.sum()), -1).mean(axis=1)
    fd = frechet_distance(za, zb)
    return {"kid": round(kid(za, zb), 6), "kid_ci": [round(v, 6) for v in kid_interval(za, zb, resamples, 0)],
            "frechet": round(fd, 6), "frechet_ci": shifted_ci(fd, bootstrap_frechet(za, zb, resamples, 0)),
            "paired_distance": round(float(paired.mean()), 8), "paired_distance_ci": bootstrap_mean_ci(paired, resamples, 3),
            "adherence": round(float(ref.adherence.mean()), 6), "adherence_ci": bootstrap_mean_ci(ref.adherence, resamples, 1),
            "sharpness": round(float(ref.sharpness.mean()), 8), "sharpness_ci": bootstrap_mean_ci(ref.sharpness, resamples, 2),
            "of": "teacher_40", "split": f"seed indices [0, {half}) vs [{half}, {2 * half})",
            "videos_per_set": int(a.sum())}


# -- goals --------------------------------------------------------------------------------------
def check_goals(cands: dict[str, dict[str, Any]], floor: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals 2 and 3 against the intervals (each entry: the numbers and whether it holds;
    a goal whose candidates are missing is ``null``)."""
    goals: dict[str, Any] = {}
    ref_adh = cands.get("teacher_40", {}).get("adherence_ci")

    def student_names(nfe: int) -> list[str]:
        names = [f"dmd2_{nfe}", f"pdd_{nfe}", f"dm_pdd_{nfe}"]
        if nfe == 4:
            names.append("self_forcing")
        return [n for n in names if n in cands]

    for nfe in (1, 2):
        teacher = cands.get(f"teacher_{nfe}")
        rows = {}
        for name in student_names(nfe):
            c = cands[name]
            if teacher is None or ref_adh is None:
                rows[name] = None
                continue
            rows[name] = {m: {"student_ci": c[f"{m}_ci"], "teacher_ci": teacher[f"{m}_ci"],
                              "below": c[f"{m}_ci"][1] < teacher[f"{m}_ci"][0]} for m in ("kid", "frechet")}
            rows[name]["adherence"] = {"student_ci": c["adherence_ci"], "teacher_40_ci": ref_adh,
                                       "at_least": c["adherence_ci"][1] >= ref_adh[0]}
            rows[name]["met"] = all(rows[name][m]["below"] for m in ("kid", "frechet")) and rows[name]["adherence"]["at_least"]
        goals[f"students_beat_teacher_at_{nfe}_steps"] = {"students": rows,
                                                          "met": bool(rows) and all(r and r["met"] for r in rows.values())}
    within = {}
    for name in student_names(4):
        c = cands[name]
        within[name] = {m: {"student_ci": c[f"{m}_ci"], "floor": floor[m], "within": c[f"{m}_ci"][0] <= max(floor[m], 0.0)}
                        for m in ("kid", "frechet")}
        within[name]["met"] = within[name]["kid"]["within"] and within[name]["frechet"]["within"]
    goals["a_student_within_the_floor_at_4"] = {"students": within, "met": any(r["met"] for r in within.values())}
    teacher4 = cands.get("teacher_4")
    for name in ("pdd_4", "dm_pdd_4"):
        c = cands.get(name)
        if c is None or teacher4 is None:
            goals[f"{name}_not_blurrier"] = None
            continue
        ratio = c["sharpness"] / teacher4["sharpness"] if teacher4["sharpness"] else float("nan")
        goals[f"{name}_not_blurrier"] = {
            "sharpness": c["sharpness"], "teacher_4_sharpness": teacher4["sharpness"], "ratio": round(ratio, 4),
            "within_5_percent": abs(ratio - 1.0) <= 0.05 or ratio > 1.0,
            "paired_distance": c["paired_distance"], "teacher_4_paired_distance": teacher4["paired_distance"],
            "no_loss_of_paired_distance": c["paired_distance_ci"][0] <= teacher4["paired_distance"],
        }
        goals[f"{name}_not_blurrier"]["met"] = (goals[f"{name}_not_blurrier"]["within_5_percent"]
                                                and goals[f"{name}_not_blurrier"]["no_loss_of_paired_distance"])
    return goals


def sparse_vs_dense(rows: list[dict[str, Any]], twins: dict[str, dict[str, list[str]]]) -> dict[str, Any]:
    """Per student trained both ways (``twins``: student -> {"dense": [candidate names, one per training seed],
    "sparse": [...]}, ``quality.sparse_twins``), per metric: each seed's value (its 95% interval in the candidate's
    row), their mean and spread (min, max over seeds) dense and sparse, and the sparse mean minus the dense mean. A
    student missing either kind is left out."""
    by_name = {r["name"]: r for r in rows}
    out: dict[str, Any] = {}
    for student, kinds in twins.items():
        groups = {kind: [by_name[n] for n in names if n in by_name] for kind, names in kinds.items()}
        if not groups.get("dense") or not groups.get("sparse"):
            continue
        entry: dict[str, Any] = {}
        for metric in METRICS:
            per = {kind: [r[metric] for r in group] for kind, group in groups.items()}
            entry[metric] = {kind: {"seeds": vals, "mean": round(float(np.mean(vals)), 6),
                                    "min": round(float(np.min(vals)), 6), "max": round(float(np.max(vals)), 6)}
                             for kind, vals in per.items()}
            entry[metric]["sparse_minus_dense"] = round(entry[metric]["sparse"]["mean"] - entry[metric]["dense"]["mean"], 6)
        out[student] = entry
    return out


# -- output -------------------------------------------------------------------------------------
def write_results(out: Path, settings: dict[str, Any], rows: list[dict[str, Any]], floor: dict[str, Any] | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"settings": settings, "candidates": rows, "floor": floor or {}}, indent=2) + "\n")
    tmp.replace(out)


def write_plot(rows: list[dict[str, Any]], floor: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"teacher": "o", "dmd2": "s", "self_forcing": "^", "pdd": "D", "dm_pdd": "v", "dmd2_sparse": "P",
               "self_forcing_sparse": "X", "pdd_sparse": "d", "dm_pdd_sparse": "1"}
    for ax, metric, label in ((axes[0], "kid", "KID to teacher-40"), (axes[1], "frechet", "Fréchet distance to teacher-40")):
        for method in markers:
            pts = sorted((r["nfe"], r[metric], *r[f"{metric}_ci"]) for r in rows if r["method"] == method and r["name"] != "teacher_40")
            if not pts:
                continue
            x, y, lo, hi = (np.asarray(v, dtype=np.float64) for v in zip(*pts))
            ax.errorbar(x, y, yerr=[np.clip(y - lo, 0, None), np.clip(hi - y, 0, None)], marker=markers[method], capsize=3, label=method,
                        linestyle="-" if method in ("teacher", "pdd", "dm_pdd") else "none")
        if floor:
            ax.axhspan(floor[f"{metric}_ci"][0], floor[f"{metric}_ci"][1], color="grey", alpha=0.25,
                       label="teacher-40 seed-to-seed floor")
            ax.axhline(floor[metric], color="grey", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("NFE (transformer forwards per video)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("distillery quality benchmark: distance to the 40-step teacher's samples vs NFE (95% intervals)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_table(rows: list[dict[str, Any]], floor: dict[str, Any] | None) -> str:
    def ci(r: dict[str, Any], m: str, fmt: str) -> str:
        lo, hi = r[f"{m}_ci"]
        return f"{r[m]:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"

    head = (f"{'candidate':<14} {'method':<12} {'NFE':>4} {'latency s':>9}  {'KID [95%]':<28} {'Fréchet [95%]':<26} "
            f"{'adherence [95%]':<22} {'sharpness×1e3 [95%]':<22} {'paired×1e3 [95%]':<22}")
    lines = [head, "-" * len(head)]
    for r in rows:
        sharp = {**r, "sharpness": r["sharpness"] * 1e3, "sharpness_ci": [v * 1e3 for v in r["sharpness_ci"]]}
        paired = {**r, "paired_distance": r["paired_distance"] * 1e3,
                  "paired_distance_ci": [v * 1e3 for v in r["paired_distance_ci"]]}
        lines.append(f"{r['name']:<14} {r['method']:<12} {int(r['nfe']):>4} {r['latency_s']:>9.4f}  {ci(r, 'kid', '.4f'):<28} "
                     f"{ci(r, 'frechet', '.3f'):<26} {ci(r, 'adherence', '.3f'):<22} {ci(sharp, 'sharpness', '.3f'):<22} "
                     f"{ci(paired, 'paired_distance', '.3f'):<22}")
    if floor:
        lines.append(f"floor (teacher_40 seed halves, {floor['videos_per_set']} videos each): KID {floor['kid']:.4f} "
                     f"[{floor['kid_ci'][0]:.4f}, {floor['kid_ci'][1]:.4f}], Fréchet {floor['frechet']:.3f} "
                     f"[{floor['frechet_ci'][0]:.3f}, {floor['frechet_ci'][1]:.3f}], paired×1e3 {floor['paired_distance'] * 1e3:.3f}")
    return "\n".join(lines)
