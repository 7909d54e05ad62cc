"""Read colour, shape and motion direction back from the frames of a synthetic-style clip.

Method (frames are RGB, scaled to [0, 1]):

1. Background = per-channel median of the border pixels of all frames.
2. Soft foreground mask per pixel: distance to the background divided by the clip's contrast
   (a high percentile of that distance), clipped to [0, 1]; values below ``mask_floor`` are
   treated as noise and the rest rescaled to [0, 1]. For a blurred flat shape the mask is ≈ the
   local coverage, so its moments are those of the shape convolved with the blur.
3. Per frame, the mask's centroid and, in a window around it, its centred complex moments
   ``c_k = Σ m·z^k / Σ m`` and ``c_2 = Σ m·|z|² / Σ m`` with ``z = (x − cx) + i(y − cy)``. Shape
   features ``h3 = |k_3| / c_2^1.5`` and ``h4 = |k_4| / c_2^2`` use the complex cumulants
   ``k_3 = c_3`` and ``k_4 = c_4 − 3·c_2'²`` (``c_2' = Σ m·z² / Σ m``). They are rotation invariant,
   and a Gaussian blur of any covariance (VAE blur, motion smear) leaves ``k_3`` and ``k_4``
   unchanged (up to the window and the mask floor) and only grows ``c_2``, so blur shrinks the
   features smoothly: a triangle has a large 3-fold term (h3 ≈ 0.78 sharp, ≈ 0.45 at σ = 1.6 px),
   a square a large 4-fold term and no 3-fold term (h4 ≈ 0.58 sharp, ≈ 0.35 at σ = 1.6 px), a
   circle neither (both < 0.05). The clip's features are medians over frames; triangle if
   ``h3 ≥ triangle_h3``, else square if ``h4 ≥ square_h4``, else circle. :func:`calibrate` fits
   the two thresholds to labelled clips (e.g. VAE reconstructions).
4. Colour: mask²-weighted mean of ``frame − background``, matched to each palette colour's
   ``colour − background`` by cosine similarity (scale free, so blur that dims the shape is fine).
5. Direction: least-squares slope of the centroid over time; the axis with the larger |slope|
   and its sign. A clip whose centroid travels less than ``min_travel_px`` has no direction.

``score`` checks a caption against the analysis (captions outside the grammar score all False);
``evaluate`` averages scores over many clips.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from distillery.clips.grammar import BACKGROUNDS, COLOURS, DIRECTIONS, parse_caption
from distillery.common.errors import UserError

log = logging.getLogger("distillery")

SCORE_KEYS = ("colour", "shape", "direction", "all")


@dataclass(frozen=True)
class AnalyzerConfig:
    """Thresholds of the analyzer; :func:`calibrate` fits the shape ones to labelled clips."""

    triangle_h3: float = 0.15  # shape is a triangle when the 3-fold moment feature h3 is at least this
    square_h4: float = 0.15  # otherwise a square when the 4-fold moment feature h4 is at least this
    contrast_percentile: float = 99.5  # percentile of the background distance taken as full contrast
    min_contrast: float = 0.08  # contrast floor (RGB distance in [0, 1] units) so empty clips stay empty
    mask_floor: float = 0.15  # soft-mask values below this are noise; the rest is rescaled to [0, 1]
    window_scale: float = 2.0  # moment window radius, in equivalent-disc radii of the frame's mask mass
    min_mass_px: float = 2.0  # frames whose mask mass (in pixels) is below this are skipped
    min_travel_px: float = 2.0  # centroid travel over the clip below which there is no direction


@dataclass(frozen=True)
class AnalyzedClip:
    """What :func:`analyze` read from a clip; a field is None when the clip gave no evidence."""

    colour: str | None  # nearest palette colour (grammar word)
    shape: str | None  # circle, square or triangle
    direction: str | None  # left, right, up or down
    background: str  # nearest grammar background to the estimated background colour
    colour_confidence: float  # cosine similarity of the best colour minus the runner-up, in [0, 2]
    shape_confidence: float  # relative margin of the shape features from the decision thresholds, in [0, 1]
    direction_confidence: float  # |major slope| / (|vx| + |vy|), in [0.5, 1] (0 when no direction)
    h3: float  # median 3-fold moment feature over frames (large for triangles)
    h4: float  # median 4-fold moment feature over frames (large for squares)
    velocity_xy: tuple[float, float]  # centroid velocity in pixels per frame (x right, y down)
    foreground_px: float  # median mask mass per frame, in pixels
    valid_frames: int  # frames with enough foreground to measure


def to_unit_float(frames: np.ndarray) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 or float in [0, 1] → float64 in [0, 1] (a single frame ``[H, W, 3]`` gets T = 1);
    a :class:`UserError` for anything else."""
    arr = np.asarray(frames)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.shape[1] < 3 or arr.shape[2] < 3:
        raise UserError(f"analyze needs RGB frames [T, H, W, 3], got shape {arr.shape}")
    if arr.dtype == np.uint8:
        return arr.astype(np.float64) / 255.0
    if not np.issubdtype(arr.dtype, np.floating):
        raise UserError(f"analyze needs uint8 or float frames, got {arr.dtype}")
    return np.clip(arr.astype(np.float64), 0.0, 1.0)


def _border_median(frames: np.ndarray) -> np.ndarray:
    """Per-channel median of the border pixels of all frames, ``[3]``."""
    border = np.concatenate(
        [frames[:, 0].reshape(-1, 3), frames[:, -1].reshape(-1, 3),
         frames[:, 1:-1, 0].reshape(-1, 3), frames[:, 1:-1, -1].reshape(-1, 3)]
    )
    return np.median(border, axis=0)


def _soft_mask(frames: np.ndarray, background: np.ndarray, cfg: AnalyzerConfig) -> np.ndarray:
    """Foreground weight per pixel ``[T, H, W]`` in [0, 1]."""
    dist = np.linalg.norm(frames - background, axis=-1)
    contrast = max(float(np.percentile(dist, cfg.contrast_percentile)), cfg.min_contrast)
    mask = np.clip(dist / contrast, 0.0, 1.0)
    return np.clip((mask - cfg.mask_floor) / (1.0 - cfg.mask_floor), 0.0, 1.0)


def _frame_moments(mask: np.ndarray, cfg: AnalyzerConfig) -> tuple[float, float, float, float, float] | None:
    """(cx, cy, h3, h4, mass) of one frame's mask ``[H, W]``, or None when it is (nearly) empty."""
    mass = float(mask.sum())
    if mass < cfg.min_mass_px:
        return None
    h, w = mask.shape
    ys, xs = np.mgrid[0:h, 0:w]
    xs = xs + 0.5
    ys = ys + 0.5
    cx = float((mask * xs).sum() / mass)
    cy = float((mask * ys).sum() / mass)
    radius = cfg.window_scale * np.sqrt(mass / np.pi) + 1.0
    for _ in range(2):  # re-centre inside the window so far-away noise does not pull the centroid
        window = mask * (((xs - cx) ** 2 + (ys - cy) ** 2) <= radius**2)
        wmass = float(window.sum())
        if wmass < cfg.min_mass_px:
            return None
        cx = float((window * xs).sum() / wmass)
        cy = float((window * ys).sum() / wmass)
    z = (xs - cx) + 1j * (ys - cy)
    c2 = float((window * np.abs(z) ** 2).sum() / wmass)
    if c2 <= 1e-9:
        return None
    m2 = complex((window * z**2).sum() / wmass)
    k3 = complex((window * z**3).sum() / wmass)
    k4 = complex((window * z**4).sum() / wmass) - 3 * m2**2
    return cx, cy, abs(k3) / c2**1.5, abs(k4) / c2**2, wmass


def _classify_shape(h3: float, h4: float, cfg: AnalyzerConfig) -> tuple[str, float]:
    """Shape word and a relative margin in [0, 1] from the thresholds."""
    m3 = (h3 - cfg.triangle_h3) / max(cfg.triangle_h3, 1e-9)
    m4 = (h4 - cfg.square_h4) / max(cfg.square_h4, 1e-9)
    if m3 >= 0:
        return "triangle", float(min(1.0, m3))
    if m4 >= 0:
        return "square", float(min(1.0, -m3, m4))
    return "circle", float(min(1.0, -m3, -m4))


def _nearest_colour(frames: np.ndarray, mask: np.ndarray, background: np.ndarray) -> tuple[str | None, float]:
    """Palette colour whose direction from the background best matches the foreground's."""
    weight = mask**2
    total = float(weight.sum())
    if total <= 0:
        return None, 0.0
    delta = (weight[..., None] * (frames - background)).reshape(-1, 3).sum(axis=0) / total
    if np.linalg.norm(delta) < 1e-6:
        return None, 0.0
    sims = []
    for name, rgb in COLOURS.items():
        ref = np.asarray(rgb, dtype=np.float64) / 255.0 - background
        norm = np.linalg.norm(ref) * np.linalg.norm(delta)
        sims.append((float(ref @ delta / norm) if norm > 1e-9 else -1.0, name))
    sims.sort(reverse=True)
    return sims[0][1], sims[0][0] - sims[1][0]


def _nearest_background(background: np.ndarray) -> str:
    dists = {name: float(np.linalg.norm(np.asarray(rgb) / 255.0 - background)) for name, rgb in BACKGROUNDS.items()}
    return min(dists, key=dists.__getitem__)


def analyze(frames: np.ndarray, cfg: AnalyzerConfig | None = None) -> AnalyzedClip:
    """Read colour, shape and direction from RGB frames ``[T, H, W, 3]`` (uint8, or float in [0, 1])."""
    cfg = cfg or AnalyzerConfig()
    rgb = to_unit_float(frames)
    background = _border_median(rgb)
    mask = _soft_mask(rgb, background, cfg)
    colour, colour_conf = _nearest_colour(rgb, mask, background)
    rows = []
    for t in range(mask.shape[0]):
        moments = _frame_moments(mask[t], cfg)
        if moments is not None:
            rows.append((t, *moments))
    if not rows:
        return AnalyzedClip(colour, None, None, _nearest_background(background), colour_conf, 0.0, 0.0,
                            0.0, 0.0, (0.0, 0.0), 0.0, 0)
    table = np.asarray(rows)
    h3 = float(np.median(table[:, 3]))
    h4 = float(np.median(table[:, 4]))
    shape, shape_conf = _classify_shape(h3, h4, cfg)
    direction, direction_conf, velocity = None, 0.0, (0.0, 0.0)
    if len(rows) >= 2:
        t = table[:, 0]
        vx = float(np.polyfit(t, table[:, 1], 1)[0])
        vy = float(np.polyfit(t, table[:, 2], 1)[0])
        velocity = (vx, vy)
        major = max(abs(vx), abs(vy))
        if major * (mask.shape[0] - 1) >= cfg.min_travel_px:
            step = (int(np.sign(vx)), 0) if abs(vx) >= abs(vy) else (0, int(np.sign(vy)))
            direction = next(name for name, unit in DIRECTIONS.items() if unit == step)
            direction_conf = major / (abs(vx) + abs(vy))
    return AnalyzedClip(colour, shape, direction, _nearest_background(background), colour_conf, shape_conf,
                        direction_conf, h3, h4, velocity, float(np.median(table[:, 5])), len(rows))


def score_analysis(analysis: AnalyzedClip, caption: str) -> dict[str, bool]:
    """Whether the analysis agrees with the caption: keys colour, shape, direction, all."""
    attrs = parse_caption(caption)
    if attrs is None:
        return dict.fromkeys(SCORE_KEYS, False)
    result = {
        "colour": analysis.colour == attrs.colour,
        "shape": analysis.shape == attrs.shape,
        "direction": analysis.direction == attrs.direction,
    }
    result["all"] = all(result.values())
    return result


def score(frames: np.ndarray, caption: str, cfg: AnalyzerConfig | None = None) -> dict[str, bool]:
    """Does the clip show what the caption says? keys colour, shape, direction, all (all False off-grammar)."""
    return score_analysis(analyze(frames, cfg), caption)


def folder_scorer(folder: str | Path) -> Callable[[np.ndarray, str], dict[str, bool]] | None:
    """The training validation callback's scorer plugin (run config: ``callbacks.<name>.scorer:
    distillery.clips.analyzer.folder_scorer``): with the thresholds of ``folder/analyzer.json`` (a
    tiny base's, fitted by ``distillery tinybase``), ``score(frames, caption)`` → ``colour``,
    ``shape``, ``direction`` and ``adherence`` (all three right); None when the folder has no
    ``analyzer.json`` (a real base: nothing to score)."""
    path = Path(folder) / "analyzer.json"
    if not path.is_file():
        return None
    cfg = AnalyzerConfig(**json.loads(path.read_text()))

    def scored(frames: np.ndarray, caption: str) -> dict[str, bool]:
        return {("adherence" if key == "all" else key): ok for key, ok in score(frames, caption, cfg).items()}

    return scored


def evaluate(pairs: Iterable[tuple[np.ndarray, str]], cfg: AnalyzerConfig | None = None) -> dict[str, float]:
    """Accuracy over ``(frames, caption)`` pairs: keys colour, shape, direction, all (in [0, 1]), num_clips."""
    return accuracy((analyze(frames, cfg), caption) for frames, caption in pairs)


def accuracy(pairs: Iterable[tuple[AnalyzedClip, str]]) -> dict[str, float]:
    """:func:`evaluate` over clips already analysed (one analysis can be scored against several captions)."""
    totals = dict.fromkeys(SCORE_KEYS, 0)
    count = 0
    for analysis, caption in pairs:
        for key, ok in score_analysis(analysis, caption).items():
            totals[key] += int(ok)
        count += 1
    if count == 0:
        raise UserError("evaluate needs at least one (frames, caption) pair")
    result = {key: totals[key] / count for key in SCORE_KEYS}
    result["num_clips"] = float(count)
    return result


def calibrate(pairs: Iterable[tuple[np.ndarray, str]], base: AnalyzerConfig | None = None) -> AnalyzerConfig:
    """``base`` with the shape thresholds that maximise shape accuracy on labelled clips.

    Candidates are midpoints between consecutive observed feature values; among equally accurate
    pairs the one with the widest gaps (largest relative margin) wins. Captions outside the grammar
    are skipped.
    """
    base = base or AnalyzerConfig()
    feats, labels = [], []
    for frames, caption in pairs:
        attrs = parse_caption(caption)
        if attrs is None:
            continue
        clip = analyze(frames, base)
        if clip.valid_frames == 0:
            continue
        feats.append((clip.h3, clip.h4))
        labels.append(attrs.shape)
    if not feats:
        raise UserError("calibrate needs labelled clips with a visible shape")
    h3, h4 = np.asarray(feats).T
    truth = np.asarray(labels)
    cand3, gap3 = _threshold_candidates(h3)
    cand4, gap4 = _threshold_candidates(h4)
    is_tri = h3[None, :] >= cand3[:, None]  # [C3, N]
    is_sq = h4[None, :] >= cand4[:, None]  # [C4, N]
    pred_tri = is_tri[:, None, :]
    pred_sq = ~pred_tri & is_sq[None, :, :]
    pred_circ = ~pred_tri & ~is_sq[None, :, :]
    correct = ((pred_tri & (truth == "triangle")) | (pred_sq & (truth == "square"))
               | (pred_circ & (truth == "circle"))).sum(axis=-1)  # [C3, C4]
    best = correct.max()
    margin = np.where(correct == best, gap3[:, None] + gap4[None, :], -np.inf)
    i, j = np.unravel_index(int(np.argmax(margin)), margin.shape)
    log.info("analyzer calibration: shape accuracy %.3f on %d clips (triangle_h3 %.4f, square_h4 %.4f)",
             best / len(truth), len(truth), cand3[i], cand4[j])
    return replace(base, triangle_h3=float(cand3[i]), square_h4=float(cand4[j]))


def _threshold_candidates(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Midpoints between sorted unique values (plus one beyond each end) and each gap's relative width."""
    v = np.unique(values)
    if len(v) == 1:
        return np.asarray([v[0] * 0.5, v[0] * 1.5 + 1e-6]), np.zeros(2)
    mids = (v[:-1] + v[1:]) / 2
    gaps = (v[1:] - v[:-1]) / np.maximum(mids, 1e-9)
    ends = np.asarray([v[0] * 0.5, v[-1] * 1.5 + 1e-6])
    return np.concatenate([[ends[0]], mids, [ends[1]]]), np.concatenate([[0.0], gaps, [0.0]])
