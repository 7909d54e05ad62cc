"""VBench's quality, semantic and total scores from dimension scores, with VBench's normalisation and weights.

The constants are data from VBench's repository (``scripts/constant.py``: ``NORMALIZE_DIC``, ``DIM_WEIGHT``,
``QUALITY_WEIGHT``, ``SEMANTIC_WEIGHT``; the formulas of ``scripts/cal_final_score.py``); the wheel of vbench 0.1.5
computes the dimensions but not these scores. A dimension's normalised score is
``(raw − Min) / (Max − Min) · weight``; the quality score is the sum over the 7 quality dimensions divided by the
sum of their weights (dynamic degree weighs 0.5: 6.5); the semantic score likewise over the 9 semantic dimensions;
the total ``(4 · quality + 1 · semantic) / 5``. Scores are fractions; papers print them ×100.

We compute one semantic dimension (overall consistency), so :func:`scores` gives the quality score, the
normalised overall consistency, and no semantic or total score (both need all 9 semantic dimensions).

:data:`PUBLISHED` is the rows users set beside theirs (Wan2.1-T2V-1.3B students, VBench total / quality /
semantic ×100), each with its source and the protocol it was measured under.
"""

from __future__ import annotations

from dataclasses import dataclass

QUALITY = ("subject_consistency", "background_consistency", "temporal_flickering", "motion_smoothness",
           "aesthetic_quality", "imaging_quality", "dynamic_degree")
SEMANTIC = ("object_class", "multiple_objects", "human_action", "color", "spatial_relationship", "scene",
            "appearance_style", "temporal_style", "overall_consistency")
COMPUTED = QUALITY + ("overall_consistency",)  # the dimensions this package computes

# VBench scripts/constant.py: NORMALIZE_DIC (Min, Max) and DIM_WEIGHT, keyed by our dimension names
NORMALIZE = {
    "subject_consistency": (0.1462, 1.0), "background_consistency": (0.2615, 1.0), "temporal_flickering": (0.6293, 1.0),
    "motion_smoothness": (0.706, 0.9975), "dynamic_degree": (0.0, 1.0), "aesthetic_quality": (0.0, 1.0),
    "imaging_quality": (0.0, 1.0), "object_class": (0.0, 1.0), "multiple_objects": (0.0, 1.0), "human_action": (0.0, 1.0),
    "color": (0.0, 1.0), "spatial_relationship": (0.0, 1.0), "scene": (0.0, 0.8222), "appearance_style": (0.0009, 0.2855),
    "temporal_style": (0.0, 0.364), "overall_consistency": (0.0, 0.364),
}
WEIGHT = {name: (0.5 if name == "dynamic_degree" else 1.0) for name in QUALITY + SEMANTIC}
QUALITY_WEIGHT, SEMANTIC_WEIGHT = 4.0, 1.0


def normalised(dimension: str, raw: float) -> float:
    """A dimension's normalised, weighted score (module doc)."""
    low, high = NORMALIZE[dimension]
    return (raw - low) / (high - low) * WEIGHT[dimension]


def quality_score(raw: dict[str, float]) -> float:
    """VBench's quality score from the 7 quality dimensions' raw scores (fractions)."""
    missing = [d for d in QUALITY if d not in raw]
    if missing:
        raise ValueError(f"the quality score needs all 7 quality dimensions; missing {missing}")
    return sum(normalised(d, raw[d]) for d in QUALITY) / sum(WEIGHT[d] for d in QUALITY)


def semantic_score(raw: dict[str, float]) -> float:
    """VBench's semantic score (all 9 semantic dimensions needed)."""
    missing = [d for d in SEMANTIC if d not in raw]
    if missing:
        raise ValueError(f"the semantic score needs all 9 semantic dimensions; missing {missing}")
    return sum(normalised(d, raw[d]) for d in SEMANTIC) / sum(WEIGHT[d] for d in SEMANTIC)


def total_score(quality: float, semantic: float) -> float:
    """VBench's total score: ``(4 · quality + semantic) / 5``."""
    return (quality * QUALITY_WEIGHT + semantic * SEMANTIC_WEIGHT) / (QUALITY_WEIGHT + SEMANTIC_WEIGHT)


def scores(raw: dict[str, float]) -> dict[str, float]:
    """``quality_score`` (when all 7 quality dimensions are in ``raw``), each computed dimension's normalised score
    (``<dimension>_normalised``), and ``semantic_score``/``total_score`` when all semantic dimensions are there."""
    out = {f"{d}_normalised": normalised(d, v) for d, v in raw.items() if d in NORMALIZE}
    if all(d in raw for d in QUALITY):
        out["quality_score"] = quality_score(raw)
    if all(d in raw for d in SEMANTIC):
        out["semantic_score"] = semantic_score(raw)
        if "quality_score" in out:
            out["total_score"] = total_score(out["quality_score"], out["semantic_score"])
    return out


@dataclass(frozen=True)
class PublishedRow:
    """A published VBench result (×100), its source and the protocol it was measured under."""

    model: str
    total: float | None
    quality: float | None
    semantic: float | None
    protocol: str
    source: str


SELF_FORCING_PAPER = "Self Forcing (arXiv 2506.08009), Table 1"
FASTGEN_README = "NVIDIA FastGen, methods/distribution_matching/README.md"
PUBLISHED = (
    PublishedRow("Self-Forcing (chunk-wise, 4-step)", 84.31, 85.07, 81.28, "vbench_extended", SELF_FORCING_PAPER),
    PublishedRow("FastGen DMD2, 4-step", 84.72, 85.86, 80.15, "unstated", FASTGEN_README),
    PublishedRow("FastGen DMD2, 2-step", 84.53, None, None, "unstated", FASTGEN_README),
    PublishedRow("FastGen Self-Forcing", 84.27, None, None, "unstated", FASTGEN_README),
)
