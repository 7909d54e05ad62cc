"""What a validation measures of a candidate's videos: each video's scores (:func:`score_video`: adherence,
sharpness, features), whether adherence applies to the prompts (:func:`adherence_applicability`), and the summaries
over a candidate's videos — per-seed means and their spread (:func:`mean_table`, :func:`seeded_summary`), latency
(:func:`latency_summary`) and the distribution-level scores against the reference (:func:`distribution_scores`).
The metrics' contracts are :mod:`distillery.evaluation.validate`'s module doc; this module samples nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from distillery.evaluation.kid import KID_METRICS, kid_summary

SEEDED_METRICS = ("colour", "shape", "direction", "all", "distance_to_teacher", "sharpness")  # mean + _std
METRIC_NAMES = (*(k for m in SEEDED_METRICS for k in (m, f"{m}_std")), "latency_s", "latency_s_iqr", "nfe",
                "frechet_distance", "frechet_distance_std", *KID_METRICS)  # every candidate's keys in metrics.json (+ floors, resolved flags)
ADHERENCE_METRICS = ("colour", "shape", "direction", "all")  # the analyzer's readings: n/a off the clips' grammar
WARMUP_VIDEOS = 1  # a candidate's first videos: timed, but left out of its latency (module doc)


def sample_key(prompt_index: int, seed_index: int) -> str:
    """Name of a video in ``samples/<candidate>/``: ``"<i>"`` for seed index 0, else ``"<i>_s<j>"``
    (its ``.mp4`` file stem and its key in ``latents.safetensors``)."""
    return str(prompt_index) if seed_index == 0 else f"{prompt_index}_s{seed_index}"


def score_video(video: np.ndarray, analyzer: Any, caption: str) -> tuple[dict[str, bool], float, list[float]]:
    """The scores of one decoded video ``uint8 [T, H, W, 3]``: adherence to ``caption`` (the analyzer's reading with
    ``analyzer``'s thresholds), sharpness and the feature vector (computed from one float copy; sharpness once)."""
    from distillery.clips.analyzer import analyze, score_analysis
    from distillery.evaluation.video_metrics import sharpness, video_features

    analysis = analyze(video, analyzer)
    rgb = video.astype(np.float64) / 255.0
    sharp = sharpness(rgb)
    return score_analysis(analysis, caption), sharp, [float(f) for f in video_features(rgb, analysis, sharpness_value=sharp)]


def adherence_applicability(prompts: list[str]) -> dict[str, Any]:
    """Whether the analyzer's adherence applies to ``prompts``: ``{"applicable", "prompts_in_grammar", "why"}`` —
    applicable only when every prompt is a caption of the synthetic clips' grammar (the only captions it reads)."""
    from distillery.clips.grammar import parse_caption

    parsed = sum(parse_caption(p) is not None for p in prompts)
    return {"applicable": parsed == len(prompts), "prompts_in_grammar": parsed,
            "why": None if parsed == len(prompts) else
            f"{parsed} of {len(prompts)} prompts are captions of the synthetic clips' grammar ('a <colour> <shape> moving "
            f"<direction> on a <background> background'), the only captions the analyzer reads"}


@dataclass
class ScoredVideo:
    """What one sampled video scored."""

    prompt: int  # prompt index i
    seed_index: int  # seed index j
    seed: int  # generator seed of its noise (generator_seed)
    scores: dict[str, bool]  # analyzer adherence: colour, shape, direction, all
    latency_s: float  # wall seconds for sampling + decode
    warmup: bool  # one of the candidate's first WARMUP_VIDEOS (left out of its latency)
    distance_to_teacher: float  # mean squared RGB difference ([0, 1] units) to the reference's same video
    sharpness: float  # video_metrics.sharpness, luminance²
    features: np.ndarray  # video_metrics.video_features, [len(FEATURE_NAMES)]

    def values(self) -> dict[str, float]:
        """This video's value of every seeded metric (adherence as 0/1)."""
        return {**{k: float(self.scores[k]) for k in ("colour", "shape", "direction", "all")},
                "distance_to_teacher": self.distance_to_teacher, "sharpness": self.sharpness}

    def row(self) -> dict[str, Any]:
        """Its report.json ``per_video`` entry."""
        return {"prompt": self.prompt, "seed_index": self.seed_index, "generator_seed": self.seed,
                "sample": sample_key(self.prompt, self.seed_index), **{k: bool(v) for k, v in self.scores.items()},
                "latency_s": round(self.latency_s, 6), "warmup": self.warmup, "distance_to_teacher": self.distance_to_teacher,
                "sharpness": self.sharpness, "features": [float(f) for f in self.features]}


def mean_table(videos: list[ScoredVideo], group: str, count: int) -> np.ndarray:
    """Means ``[count, len(SEEDED_METRICS)]`` of every seeded metric over the videos of each group value
    (``group``: "seed_index" or "prompt")."""
    sums, hits = np.zeros((count, len(SEEDED_METRICS))), np.zeros(count)
    for v in videos:
        values = v.values()
        sums[getattr(v, group)] += [values[k] for k in SEEDED_METRICS]
        hits[getattr(v, group)] += 1
    return sums / hits[:, None]


def seeded_summary(per_seed: np.ndarray) -> dict[str, float]:
    """``<metric>`` (mean of the per-seed means ``[S, M]``) and ``<metric>_std`` (their std, ddof=1; 0 when S = 1)."""
    mean = per_seed.mean(axis=0)
    std = per_seed.std(axis=0, ddof=1) if per_seed.shape[0] >= 2 else np.zeros_like(mean)
    out: dict[str, float] = {}
    for k, m, s in zip(SEEDED_METRICS, mean, std):
        out[k], out[f"{k}_std"] = float(m), float(s)
    return out


def latency_summary(seconds: list[float], warmup: int = WARMUP_VIDEOS) -> dict[str, Any]:
    """Per-video wall times (in sampling order) → ``median_s`` and ``iqr_s`` (75th − 25th percentile) of
    the times after the first ``warmup`` (all of them when there are no more), ``min_s``, ``max_s``,
    ``timed_videos`` (how many the statistics use) and ``warmup_s`` (the times left out)."""
    kept = seconds[warmup:] if len(seconds) > warmup else list(seconds)
    left_out = seconds[:warmup] if len(seconds) > warmup else []
    q25, q50, q75 = np.percentile(np.asarray(kept, dtype=np.float64), [25, 50, 75])
    return {"median_s": round(float(q50), 6), "iqr_s": round(float(q75 - q25), 6), "min_s": round(float(min(kept)), 6),
            "max_s": round(float(max(kept)), 6), "timed_videos": len(kept), "warmup_s": [round(float(t), 6) for t in left_out]}


def frechet_scores(features: np.ndarray, reference: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """Fréchet distance of standardised features ``[N, D]`` to the reference's ``[N_ref, D]``, and its bootstrap std (``resamples`` < 2: 0)."""
    from distillery.evaluation.video_metrics import bootstrap_frechet, frechet_distance

    distance = frechet_distance(features, reference)
    if resamples < 2:
        return distance, 0.0
    return distance, float(bootstrap_frechet(features, reference, resamples, seed).std(ddof=1))


def distribution_scores(z: np.ndarray, reference_z: np.ndarray, resamples: int, seed: int) -> dict[str, float]:
    """A candidate's scores against the reference's videos from standardised features ``[N, D]`` (the
    reference's ``[N_ref, D]``), bootstrapped ``resamples`` times from ``seed``: one line per distribution-level score (a key not in :data:`METRIC_NAMES`
    follows them in metrics.json)."""
    frechet, frechet_std = frechet_scores(z, reference_z, resamples, seed)
    scores = {"frechet_distance": frechet, "frechet_distance_std": frechet_std}
    if min(len(z), len(reference_z)) >= 2:  # the unbiased KID needs two videos a side: left out with one
        scores.update(kid_summary(z, reference_z, resamples, seed))
    return scores
