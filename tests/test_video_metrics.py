"""Fréchet distance, sharpness and per-video features of distillery.evaluation.video_metrics."""

from __future__ import annotations

import numpy as np
import pytest

from distillery.evaluation.video_metrics import (
    FEATURE_NAMES,
    Standardiser,
    bootstrap_frechet,
    fit_gaussian,
    frechet_distance,
    gaussian_frechet,
    sharpness,
    video_features,
)


def _gaussian_set(rng: np.random.Generator, n: int, dim: int, shift: float = 0.0) -> np.ndarray:
    mix = rng.normal(size=(dim, dim)) / np.sqrt(dim)
    return rng.normal(size=(n, dim)) @ mix + shift


def _moving_square(frames: int = 9, size: int = 32, rgb=(230, 40, 40)) -> np.ndarray:
    """uint8 [T, H, W, 3]: a coloured square moving right on black."""
    video = np.zeros((frames, size, size, 3), dtype=np.uint8)
    for t in range(frames):
        video[t, 12:20, 4 + 2 * t: 12 + 2 * t] = rgb
    return video


def _box_blur(video: np.ndarray, radius: int = 1) -> np.ndarray:
    """3×3 (radius 1) box blur of each frame, edges replicated; uint8 in, uint8 out."""
    x = video.astype(np.float64)
    padded = np.pad(x, ((0, 0), (radius, radius), (radius, radius), (0, 0)), mode="edge")
    k = 2 * radius + 1
    out = sum(padded[:, dy: dy + x.shape[1], dx: dx + x.shape[2]] for dy in range(k) for dx in range(k)) / k**2
    return np.round(out).astype(np.uint8)


def test_identical_sets_score_exactly_zero():
    x = _gaussian_set(np.random.default_rng(0), 16, 11)
    assert frechet_distance(x, x) == 0.0
    assert frechet_distance(x, x.copy()) == 0.0
    assert frechet_distance(x[:1], x[:1]) == 0.0  # one vector: covariance eps·I on both sides


def test_symmetric():
    rng = np.random.default_rng(1)
    x, y = _gaussian_set(rng, 16, 11), _gaussian_set(rng, 20, 11, shift=0.3)
    assert frechet_distance(x, y) > 0
    assert frechet_distance(x, y) == pytest.approx(frechet_distance(y, x), rel=1e-9, abs=1e-12)


def test_matches_the_closed_form_for_diagonal_gaussians():
    mu1, mu2 = np.array([0.0, 1.0, -2.0]), np.array([0.5, 1.0, 1.0])
    s1, s2 = np.array([1.0, 2.0, 0.5]), np.array([3.0, 2.0, 0.1])
    expected = float(np.sum((mu1 - mu2) ** 2) + np.sum((s1 - s2) ** 2))  # 0.25 + 9 + 4 + 0 + 0.16
    assert gaussian_frechet(mu1, np.diag(s1**2), mu2, np.diag(s2**2)) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(13.41)


def test_matches_scipy_sqrtm_for_full_covariances():
    from scipy.linalg import sqrtm

    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(5, 5)), rng.normal(size=(5, 5))
    cov1, cov2 = a @ a.T + 0.1 * np.eye(5), b @ b.T + 0.1 * np.eye(5)
    mu1, mu2 = rng.normal(size=5), rng.normal(size=5)
    expected = np.sum((mu1 - mu2) ** 2) + np.trace(cov1 + cov2 - 2 * np.real(sqrtm(cov1 @ cov2)))
    assert gaussian_frechet(mu1, cov1, mu2, cov2) == pytest.approx(float(expected), rel=1e-8)


def test_fit_gaussian_is_the_sample_mean_and_covariance_plus_eps():
    x = _gaussian_set(np.random.default_rng(3), 12, 4)
    mean, cov = fit_gaussian(x, eps=1e-3)
    np.testing.assert_allclose(mean, x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(cov, np.cov(x, rowvar=False) + 1e-3 * np.eye(4), rtol=1e-10)


def test_grows_with_a_shift():
    x = _gaussian_set(np.random.default_rng(4), 16, 11)
    distances = [frechet_distance(x, x + d) for d in (0.1, 0.5, 1.0, 2.0)]
    assert all(a < b for a, b in zip(distances, distances[1:]))
    assert distances[2] == pytest.approx(11.0, rel=1e-6)  # a pure shift by 1 in 11 dims: ‖Δμ‖² = 11


def test_standardiser_makes_units_irrelevant():
    rng = np.random.default_rng(5)
    ref, other = _gaussian_set(rng, 16, 3), _gaussian_set(rng, 16, 3, shift=0.5)
    scaled = np.array([1.0, 1000.0, 0.001])
    dist = frechet_distance(Standardiser.fit(ref)(other), Standardiser.fit(ref)(ref))
    dist_scaled = frechet_distance(Standardiser.fit(ref * scaled)(other * scaled), Standardiser.fit(ref * scaled)(ref * scaled))
    assert dist_scaled == pytest.approx(dist, rel=1e-6)
    z = Standardiser.fit(ref)(ref)
    np.testing.assert_allclose(z.mean(axis=0), 0, atol=1e-12)
    np.testing.assert_allclose(z.std(axis=0), 1, rtol=1e-12)
    const = np.ones((5, 2))  # constant features get scale 1, not a division by zero
    assert np.isfinite(Standardiser.fit(const)(const + 1)).all()


def test_bootstrap_is_seeded_and_spreads():
    rng = np.random.default_rng(6)
    x, ref = _gaussian_set(rng, 16, 4, shift=0.5), _gaussian_set(rng, 16, 4)
    a, b = bootstrap_frechet(x, ref, 50, seed=0), bootstrap_frechet(x, ref, 50, seed=0)
    assert a.shape == (50,) and np.array_equal(a, b)
    assert not np.array_equal(a, bootstrap_frechet(x, ref, 50, seed=1))
    assert a.std(ddof=1) > 0 and (a >= 0).all()


def test_sharpness_drops_with_blur():
    video = _moving_square()
    sharp, blurred = sharpness(video), sharpness(_box_blur(video))
    assert sharp > blurred > 0
    assert sharpness(_box_blur(_box_blur(video))) < blurred
    assert sharpness(np.zeros((3, 8, 8, 3), np.uint8)) == 0.0
    assert sharpness(video) == pytest.approx(sharpness(video.astype(np.float64) / 255.0), rel=1e-12)


def test_sharpness_of_a_known_frame():
    frame = np.zeros((5, 5, 3))
    frame[2, 2] = 1.0  # one white pixel: interior Laplacian is −4 at the centre, 1 at its 4 neighbours, 0 elsewhere
    lap = np.zeros((3, 3))
    lap[1, 1], lap[0, 1], lap[2, 1], lap[1, 0], lap[1, 2] = -4, 1, 1, 1, 1
    assert sharpness(frame) == pytest.approx(float(lap.var()), rel=1e-9)


def test_features_have_the_documented_dimension_and_are_finite():
    assert len(FEATURE_NAMES) == 11
    for video in (_moving_square(), np.zeros((9, 32, 32, 3), np.uint8), np.full((9, 32, 32, 3), 128, np.uint8),
                  np.full((1, 16, 16, 3), 1.0)):
        feats = video_features(video)
        assert feats.shape == (len(FEATURE_NAMES),) and feats.dtype == np.float64
        assert np.isfinite(feats).all(), video.shape
    black = dict(zip(FEATURE_NAMES, video_features(np.zeros((9, 32, 32, 3), np.uint8))))
    assert all(v == 0.0 for v in black.values())
    moving = dict(zip(FEATURE_NAMES, video_features(_moving_square())))
    assert moving["vx"] == pytest.approx(2.0, abs=0.2) and abs(moving["vy"]) < 0.2  # 2 px/frame to the right
    assert moving["area"] == pytest.approx(64 / 32**2, rel=0.2)  # an 8×8 square on 32×32
    assert moving["mean_r"] > moving["mean_g"] and moving["motion"] > 0 and moving["sharpness"] > 0
    assert moving["h4"] > moving["h3"]  # a square: a 4-fold moment term, no 3-fold one


def test_paired_mse_is_the_float_formula_from_exact_integer_sums():
    from distillery.evaluation.video_metrics import paired_mse

    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, size=(5, 7, 9, 3), dtype=np.uint8)
    b = rng.integers(0, 256, size=(5, 7, 9, 3), dtype=np.uint8)
    by_hand = float(np.mean((a.astype(np.float64) / 255.0 - b.astype(np.float64) / 255.0) ** 2))
    assert paired_mse(a, b) == pytest.approx(by_hand, rel=1e-13)
    assert paired_mse(a, a) == 0.0
    assert paired_mse(np.zeros_like(a), np.full_like(a, 255)) == 1.0  # the largest value: every pixel 0 against 1
    big = np.full((2, 480, 832, 3), 255, np.uint8)  # a frame's sum of squares (7.8e10 at 81 frames) overflows int32
    assert paired_mse(big, np.zeros_like(big)) == 1.0
    with pytest.raises(ValueError, match="one shape"):
        paired_mse(a, b[:, :6])
    with pytest.raises(ValueError, match="uint8"):
        paired_mse(a.astype(np.float32), b)
