"""Per-video feature vectors, sharpness and the Fréchet distance between two sets of videos.

Videos are RGB ``[T, H, W, 3]``: uint8, or float in [0, 1] (``H, W >= 3``).

**Sharpness** (:func:`sharpness`): per frame, the variance over the interior pixels of the 4-neighbour
Laplacian ``L = Y[y-1,x] + Y[y+1,x] + Y[y,x-1] + Y[y,x+1] − 4·Y[y,x]`` of the luminance
``Y = 0.299 R + 0.587 G + 0.114 B`` (values in [0, 1], BT.601 weights; border pixels, which lack
neighbours, are left out), averaged over frames. Unit: luminance², 0 for a flat frame; blur lowers it.

**Features** (:func:`video_features`, ``D = len(FEATURE_NAMES) = 11`` numbers per video, all finite,
also on empty or constant videos where the analyzer sees nothing and reads zeros):

- ``h3``, ``h4`` — the analyzer's 3- and 4-fold shape moment features (medians over frames; large
  for triangles / squares, small for circles; :mod:`distillery.clips.analyzer`);
- ``area`` — the analyzer's median foreground mask mass per frame as a fraction of the frame (H·W);
- ``vx``, ``vy`` — the analyzer's centroid velocity, pixels per frame (x right, y down);
- ``mean_r``, ``mean_g``, ``mean_b`` — per-channel mean of all pixels of all frames, in [0, 1];
- ``contrast`` — standard deviation of all RGB values of all frames (channels pooled), in [0, 1];
- ``motion`` — mean absolute difference of consecutive frames (RGB in [0, 1]; 0 for one frame);
- ``sharpness`` — as above.

**Fréchet distance** (:func:`frechet_distance`): fit a Gaussian to each set of feature vectors (mean
and covariance with ``ddof=1``, ``ddof=0`` for a single vector, plus ``eps·I``) and return the
squared 2-Wasserstein distance between the fits, as FID reports it::

    FD = ‖μ₁ − μ₂‖² + tr(Σ₁ + Σ₂ − 2 (Σ₁^½ Σ₂ Σ₁^½)^½)

The matrix square roots come from symmetric eigen-decompositions (negative round-off eigenvalues
clipped to 0), so the result is symmetric in the two sets up to round-off, ≥ 0, and exactly 0 for
identical sets. ``eps`` (:data:`COV_EPS` = 1e-3, in standardised units) keeps the fits positive
definite when a set has fewer vectors than dimensions; there the distance also counts the
directions one set does not span, so it shrinks as sets grow (compare distances of equal-size sets). Features should first be put on a common
scale: :class:`Standardiser` fits the
reference set's per-feature mean and standard deviation and maps every set with them, so no unit
dominates. :func:`bootstrap_frechet` gives the distance's sampling spread by resampling one set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from distillery.clips.analyzer import to_unit_float

if TYPE_CHECKING:
    from distillery.clips.analyzer import AnalyzedClip, AnalyzerConfig

FEATURE_NAMES = ("h3", "h4", "area", "vx", "vy", "mean_r", "mean_g", "mean_b", "contrast", "motion", "sharpness")
LUMA_WEIGHTS = (0.299, 0.587, 0.114)  # BT.601 RGB → luminance
COV_EPS = 1e-3  # added to covariance diagonals, standardised units: a variance floor of (0.03 reference std)²
# that bounds the square roots' sensitivity to round-off when there are fewer videos than features
MIN_SCALE = 1e-8  # reference standard deviations below this count as constant features (scale 1)


def paired_mse(video: np.ndarray, reference: np.ndarray) -> float:
    """Mean squared difference of two uint8 videos of one shape as RGB in [0, 1]: exact integer sums, one division
    (the float64 ``mean((a/255 − b/255)²)`` to round-off, without its two 8-byte copies of each video)."""
    if video.shape != reference.shape or video.dtype != np.uint8 or reference.dtype != np.uint8:
        raise ValueError(f"paired_mse needs two uint8 videos of one shape, got {video.dtype}{video.shape} and "
                         f"{reference.dtype}{reference.shape}")
    total = 0
    for a, b in zip(video.reshape(video.shape[0], -1), reference.reshape(reference.shape[0], -1)):  # a frame at a time
        d = a.astype(np.int64) - b
        total += int(np.dot(d, d))  # ≤ 255² · H·W·3 per frame: exact in int64
    return total / (255.0 * 255.0 * video.size)


def sharpness(video: np.ndarray) -> float:
    """Mean over frames of the variance of the luminance Laplacian (module doc); luminance² units, >= 0."""
    luma = to_unit_float(video) @ np.asarray(LUMA_WEIGHTS)  # [T, H, W]
    lap = (luma[:, :-2, 1:-1] + luma[:, 2:, 1:-1] + luma[:, 1:-1, :-2] + luma[:, 1:-1, 2:]
           - 4.0 * luma[:, 1:-1, 1:-1])  # [T, H-2, W-2]
    return float(lap.reshape(lap.shape[0], -1).var(axis=1).mean())


def video_features(video: np.ndarray, analysis: "AnalyzedClip | None" = None,
                   analyzer: "AnalyzerConfig | None" = None, sharpness_value: float | None = None) -> np.ndarray:
    """The feature vector ``float64 [len(FEATURE_NAMES)]`` of one video (module doc).

    ``analysis``: the analyzer's reading of this video when already at hand; else it is analysed
    here with ``analyzer`` (None: default thresholds). ``sharpness_value``: :func:`sharpness` of this
    video when already computed (at 81×480×832 it is ~8 s of numpy; the value must be that function's).
    """
    from distillery.clips.analyzer import analyze

    rgb = to_unit_float(video)
    if analysis is None:
        analysis = analyze(rgb, analyzer)
    t, h, w, _ = rgb.shape
    motion = float(np.abs(np.diff(rgb, axis=0)).mean()) if t > 1 else 0.0
    vx, vy = analysis.velocity_xy
    feats = [analysis.h3, analysis.h4, analysis.foreground_px / (h * w), vx, vy,
             *rgb.reshape(-1, 3).mean(axis=0), float(rgb.std()), motion,
             sharpness(rgb) if sharpness_value is None else sharpness_value]
    return np.nan_to_num(np.asarray(feats, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class Standardiser:
    """Per-feature affine map ``(x − mean) / scale`` fitted to a reference set."""

    mean: np.ndarray  # [D], the reference's feature means
    scale: np.ndarray  # [D], the reference's feature standard deviations (ddof=0); 1 where below MIN_SCALE

    @classmethod
    def fit(cls, reference: np.ndarray) -> "Standardiser":
        """Fit to reference features ``[N, D]``."""
        ref = _as_set(reference)
        std = ref.std(axis=0)
        return cls(ref.mean(axis=0), np.where(std > MIN_SCALE, std, 1.0))

    def __call__(self, features: np.ndarray) -> np.ndarray:
        """``[N, D]`` → standardised ``[N, D]``."""
        return (_as_set(features) - self.mean) / self.scale


def _as_set(features: np.ndarray) -> np.ndarray:
    arr = np.asarray(features, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] < 1:
        raise ValueError(f"expected a feature set [N >= 1, D], got shape {arr.shape}")
    return arr


def fit_gaussian(features: np.ndarray, eps: float = COV_EPS) -> tuple[np.ndarray, np.ndarray]:
    """Mean ``[D]`` and covariance ``[D, D]`` (ddof=1; ddof=0 for one vector) + ``eps·I`` of ``[N, D]``."""
    x = _as_set(features)
    mean = x.mean(axis=0)
    centred = x - mean
    cov = centred.T @ centred / max(x.shape[0] - 1, 1)
    return mean, cov + eps * np.eye(x.shape[1])


def _psd_sqrt(mat: np.ndarray) -> np.ndarray:
    """Symmetric square root of a symmetric positive semi-definite matrix (round-off negatives → 0)."""
    vals, vecs = np.linalg.eigh((mat + mat.T) / 2)
    return (vecs * np.sqrt(np.clip(vals, 0.0, None))) @ vecs.T


def gaussian_frechet(mean1: np.ndarray, cov1: np.ndarray, mean2: np.ndarray, cov2: np.ndarray) -> float:
    """Squared 2-Wasserstein distance between N(mean1, cov1) and N(mean2, cov2); covariances PSD ``[D, D]``."""
    mean1, mean2 = np.asarray(mean1, np.float64), np.asarray(mean2, np.float64)
    cov1, cov2 = np.asarray(cov1, np.float64), np.asarray(cov2, np.float64)
    root1 = _psd_sqrt(cov1)
    cross = root1 @ cov2 @ root1
    trace_root = float(np.sqrt(np.clip(np.linalg.eigvalsh((cross + cross.T) / 2), 0.0, None)).sum())
    diff = mean1 - mean2
    return max(0.0, float(diff @ diff) + float(np.trace(cov1) + np.trace(cov2)) - 2.0 * trace_root)


def frechet_distance(features1: np.ndarray, features2: np.ndarray, eps: float = COV_EPS) -> float:
    """Fréchet distance (module doc) between the Gaussian fits of two feature sets ``[N, D]``, ``[M, D]``.

    Identical sets score exactly 0. Put both sets on one scale first (:class:`Standardiser`).
    """
    x, y = _as_set(features1), _as_set(features2)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"feature sets differ in dimension: {x.shape[1]} vs {y.shape[1]}")
    if x.shape == y.shape and np.array_equal(x, y):
        return 0.0
    return gaussian_frechet(*fit_gaussian(x, eps), *fit_gaussian(y, eps))


def bootstrap_frechet(features: np.ndarray, reference: np.ndarray, num_resamples: int, seed: int,
                      eps: float = COV_EPS) -> np.ndarray:
    """Fréchet distances ``[num_resamples]`` of ``features`` resampled with replacement (N of N rows) to
    the fixed ``reference``; the draws come from ``numpy.random.default_rng(seed)``, so sets of equal
    size get the same resample indices for the same seed."""
    x, ref = _as_set(features), _as_set(reference)
    rng = np.random.default_rng(seed)
    ref_fit = fit_gaussian(ref, eps)
    out = np.empty(num_resamples)
    for b in range(num_resamples):
        rows = x[rng.integers(0, x.shape[0], size=x.shape[0])]
        out[b] = gaussian_frechet(*fit_gaussian(rows, eps), *ref_fit)
    return out
