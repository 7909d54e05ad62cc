"""KID (src/distillery/evaluation/kid.py): ≈ 0 on two samples of one distribution, growing with a shift,
and the estimator and its bootstrap recomputed by hand on tiny arrays."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from distillery.evaluation.kid import bootstrap_kid, kid, kid_interval, kid_summary, polynomial_kernel, resolved


def _k(a: np.ndarray, b: np.ndarray) -> float:
    return (float(np.dot(a, b)) / len(a) + 1.0) ** 3


def _by_hand(x: np.ndarray, y: np.ndarray) -> float:
    m, n = len(x), len(y)
    xx = sum(_k(x[i], x[j]) for i, j in itertools.permutations(range(m), 2)) / (m * (m - 1))
    yy = sum(_k(y[i], y[j]) for i, j in itertools.permutations(range(n), 2)) / (n * (n - 1))
    xy = sum(_k(a, b) for a in x for b in y) / (m * n)
    return xx + yy - 2 * xy


def test_kid_is_the_unbiased_mmd_recomputed_by_hand():
    x = np.array([[0.0, 1.0], [1.0, -1.0], [2.0, 0.5]])
    y = np.array([[1.0, 1.0], [-1.0, 0.0]])
    assert polynomial_kernel(x, y)[2, 0] == pytest.approx((2.5 / 2 + 1) ** 3)
    assert kid(x, y) == pytest.approx(_by_hand(x, y), rel=1e-12)
    assert kid(x, y) == pytest.approx(kid(y, x), rel=1e-12)  # symmetric
    assert kid(x, x) == 0.0 and kid_interval(x, x, 10, 0) == (0.0, 0.0)
    with pytest.raises(ValueError, match="at least 2"):
        kid(x[:1], y)


def test_bootstrap_pairs_only_distinct_original_rows():
    x = np.array([[0.0, 1.0], [1.0, -1.0], [2.0, 0.5]])
    y = np.array([[1.0, 1.0], [-1.0, 0.0], [0.5, 0.5]])
    got = bootstrap_kid(x, y, 3, seed=7)
    rng = np.random.default_rng(7)
    for value in got:
        rx, ry = rng.integers(0, 3, size=3), rng.integers(0, 3, size=3)

        def within(s, rows):
            pairs = [(a, b) for a, b in itertools.permutations(range(len(rows)), 2) if rows[a] != rows[b]]
            return sum(_k(s[rows[a]], s[rows[b]]) for a, b in pairs) / len(pairs) if pairs else 0.0

        cross = sum(_k(x[a], y[b]) for a in rx for b in ry) / 9
        assert value == pytest.approx(within(x, rx) + within(y, ry) - 2 * cross, rel=1e-12)


def test_two_samples_of_one_distribution_score_near_zero_and_a_shift_grows_it():
    rng = np.random.default_rng(0)
    d = 11
    mix = rng.normal(size=(d, d)) / np.sqrt(d)
    ref = rng.normal(size=(256, d)) @ mix
    same = rng.normal(size=(256, d)) @ mix
    summary = kid_summary(same, ref, 200, seed=0)
    assert abs(summary["kid"]) < 0.02 and summary["kid_lo"] <= 0.0 <= summary["kid_hi"]
    shifted = [kid(same + s, ref) for s in (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)]
    assert all(a < b for a, b in zip(shifted, shifted[1:])), shifted
    far = kid_summary(same + 1.0, ref, 200, seed=0)
    assert far["kid_lo"] < far["kid"] < far["kid_hi"]
    assert resolved(far["kid_lo"], summary["kid_hi"]) and not resolved(summary["kid_lo"], summary["kid_hi"])
