"""Kernel inception distance (KID) between two sets of per-video feature vectors, with a bootstrap interval.

KID is the squared maximum mean discrepancy (MMD²) between two samples under the cubic polynomial kernel

    k(x, y) = (x·y / d + 1)³        (d = the feature dimension)

estimated without bias (Bińkowski et al., "Demystifying MMD GANs", 2018): for sets ``X`` (m rows) and
``Y`` (n rows)::

    KID = Σ_{i≠j} k(x_i, x_j) / (m(m−1)) + Σ_{i≠j} k(y_i, y_j) / (n(n−1)) − 2 Σ_{i,j} k(x_i, y_j) / (mn)

Its expectation is the population MMD² (0 when both sets come from one distribution), so unlike the
Fréchet distance it carries no small-sample bias: two samples of one distribution score ≈ 0 at any
size (a single estimate may be slightly negative). That makes it the distance to compare at the few
hundred videos a validation draws. Needs m, n ≥ 2.

Features are those of :mod:`distillery.evaluation.video_metrics` (``FEATURE_NAMES``), standardised by
the reference set's :class:`~distillery.evaluation.video_metrics.Standardiser` as for the Fréchet
distance, so ``d = 11`` and no unit dominates.

**Interval** (:func:`bootstrap_kid`): both sets are resampled with replacement (m of m rows, n of n),
and the within-set sums of each resample run over pairs of *different original rows* only (a row
drawn twice is not paired with itself: that would add the kernel's diagonal and bias the estimate
upwards); the 95% interval is the 2.5th and 97.5th percentiles of the resampled estimates. Draws come
from ``numpy.random.default_rng(seed)``: sets of equal sizes get the same resample indices.

**Floor and resolution** (:func:`kid_summary`, :func:`resolved`): the reference's own seed-to-seed KID
(its seed-0 videos against its seed-1 videos) is what sampling noise alone gives; a candidate's
difference from the reference is *resolved* when its whole interval lies above that floor and above 0
(the population KID is ≥ 0, so an unbiased floor estimate below 0 is noise, not a lower bar).
"""

from __future__ import annotations

import numpy as np

KID_METRICS = ("kid", "kid_lo", "kid_hi")  # a candidate's KID and its 95% bootstrap interval
INTERVAL = (2.5, 97.5)  # percentiles of the bootstrap estimates: a 95% interval


def polynomial_kernel(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``k(x_i, y_j) = (x_i·y_j / d + 1)³`` for ``x [m, d]``, ``y [n, d]`` → ``[m, n]`` (float64)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return (x @ y.T / x.shape[1] + 1.0) ** 3


def _check(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"expected feature sets [m, d] and [n, d], got shapes {x.shape} and {y.shape}")
    if x.shape[0] < 2 or y.shape[0] < 2:
        raise ValueError(f"KID needs at least 2 vectors per set, got {x.shape[0]} and {y.shape[0]}")
    return x, y


def _off_diagonal_mean(k: np.ndarray) -> float:
    m = k.shape[0]
    return float((k.sum() - np.trace(k)) / (m * (m - 1)))


def kid(features1: np.ndarray, features2: np.ndarray) -> float:
    """The unbiased KID (module doc) between feature sets ``[m, d]`` and ``[n, d]``; identical sets score exactly 0."""
    x, y = _check(features1, features2)
    if x.shape == y.shape and np.array_equal(x, y):
        return 0.0
    return (_off_diagonal_mean(polynomial_kernel(x, x)) + _off_diagonal_mean(polynomial_kernel(y, y))
            - 2.0 * float(polynomial_kernel(x, y).mean()))


def bootstrap_kid(features1: np.ndarray, features2: np.ndarray, num_resamples: int, seed: int) -> np.ndarray:
    """KID estimates ``[num_resamples]`` of both sets resampled with replacement (module doc: pairs of
    one original row are left out of the within-set sums; a resample drawing a single distinct row of a
    set counts that set's within term as 0)."""
    x, y = _check(features1, features2)
    kxx, kyy, kxy = polynomial_kernel(x, x), polynomial_kernel(y, y), polynomial_kernel(x, y)
    rng = np.random.default_rng(seed)
    out = np.empty(num_resamples)

    def within(k: np.ndarray, rows: np.ndarray) -> float:
        distinct = rows[:, None] != rows[None, :]
        pairs = int(distinct.sum())
        return float(k[np.ix_(rows, rows)][distinct].sum() / pairs) if pairs else 0.0

    for b in range(num_resamples):
        rx = rng.integers(0, x.shape[0], size=x.shape[0])
        ry = rng.integers(0, y.shape[0], size=y.shape[0])
        out[b] = within(kxx, rx) + within(kyy, ry) - 2.0 * float(kxy[np.ix_(rx, ry)].mean())
    return out


def kid_interval(features1: np.ndarray, features2: np.ndarray, num_resamples: int, seed: int) -> tuple[float, float]:
    """The 95% bootstrap interval ``(lo, hi)`` of the KID; ``(kid, kid)`` when ``num_resamples`` < 2 or the sets are identical."""
    x, y = _check(features1, features2)
    if num_resamples < 2 or (x.shape == y.shape and np.array_equal(x, y)):
        value = kid(x, y)
        return value, value
    lo, hi = np.percentile(bootstrap_kid(x, y, num_resamples, seed), INTERVAL)
    return float(lo), float(hi)


def kid_summary(features: np.ndarray, reference: np.ndarray, num_resamples: int, seed: int) -> dict[str, float]:
    """``{"kid", "kid_lo", "kid_hi"}`` of a candidate's standardised features ``[N, d]`` against the reference's."""
    lo, hi = kid_interval(features, reference, num_resamples, seed)
    return {"kid": kid(features, reference), "kid_lo": lo, "kid_hi": hi}


def resolved(lower: float, floor: float) -> bool:
    """Whether a distance whose interval starts at ``lower`` is resolved against the reference's own
    seed-to-seed ``floor``: the whole interval lies above it and above 0 (module doc)."""
    return bool(lower > max(floor, 0.0))
