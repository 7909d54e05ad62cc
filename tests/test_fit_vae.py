"""Fitting the tiny Wan VAE: the framewise init, the unclamped loss, the fit loop, latent stats."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from distillery.common.errors import UserError
from distillery.data.encoders import denormalize_latents, normalize_latents
from distillery.tinybase.fit_vae import (
    VAEFitConfig,
    decode_unclamped,
    encode_moments,
    fit_vae,
    init_as_framewise_autoencoder,
    latent_stats,
    set_latent_stats,
)
from distillery.tinybase.tiny import TinyBaseConfig, build_vae

COLOURS = [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (1.0, 1.0, 0.0)]
DIRECTIONS = [(1, 0), (-1, 0), (0, 1), (0, -1)]


def moving_shapes(n: int, frames: int = 9, size: int = 16, seed: int = 0, speed: float = 1.0) -> torch.Tensor:
    """``[n, 3, frames, size, size]`` in [-1, 1]: a coloured disc or square moving on black."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    r = size / 6
    clips = torch.full((n, 3, frames, size, size), -1.0)
    for i in range(n):
        colour = torch.tensor(COLOURS[i % len(COLOURS)])
        dx, dy = DIRECTIONS[(i // len(COLOURS)) % len(DIRECTIONS)]
        cx, cy = (torch.rand(2, generator=g) * (size - 2 * r) + r).tolist()
        for f in range(frames):
            ax, ay = xx - (cx + dx * speed * f) % size, yy - (cy + dy * speed * f) % size
            dist = (ax**2 + ay**2).sqrt() if i % 2 == 0 else torch.maximum(ax.abs(), ay.abs())
            alpha = (r + 0.5 - dist).clamp(0, 1)
            clips[i, :, f] = -1 + 2 * alpha * colour[:, None, None]
    return clips


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return init_as_framewise_autoencoder(build_vae(TinyBaseConfig()), seed=0)


def test_init_zeroes_past_taps_and_copies_current_frame(vae) -> None:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResample

    causal = [m for m in vae.modules() if isinstance(m, WanCausalConv3d) and m.kernel_size[0] > 1]
    assert len(causal) > 10
    for m in causal:
        assert not m.weight[:, :, :-1].any() and m.weight[:, :, -1].abs().sum() > 0
    resamplers = [m for m in vae.modules() if isinstance(m, WanResample) and hasattr(m, "time_conv")]
    assert {m.mode for m in resamplers} == {"downsample3d", "upsample3d"}
    for m in resamplers:
        w = m.time_conv.weight[:, :, -1, 0, 0]
        dim = w.shape[1]
        for k in range(w.shape[0] // dim):
            assert torch.equal(w[k * dim : (k + 1) * dim], torch.eye(dim))


def test_init_makes_a_per_frame_autoencoder(vae) -> None:
    moving = moving_shapes(2, frames=9)
    static = moving[:, :, :1].expand(-1, -1, 9, -1, -1).contiguous()
    with torch.no_grad():
        z_static = vae.encode(static).latent_dist.mode()  # [2, 8, 3, 4, 4]
        single = vae.decode(vae.encode(static[:, :, :1]).latent_dist.mode()).sample  # one frame
        frames = vae.decode(z_static).sample
        # every latent frame of a static clip is the single-frame latent; every output frame its decode
        for t in range(z_static.shape[2]):
            torch.testing.assert_close(z_static[:, :, t], z_static[:, :, 0], atol=1e-5, rtol=1e-5)
        for t in range(frames.shape[2]):
            torch.testing.assert_close(frames[:, :, t], single[:, :, 0], atol=1e-5, rtol=1e-5)
        # decoding is per latent frame: changing latent frame 1 touches only output frames 1..4
        z = vae.encode(moving).latent_dist.mode()
        z2 = z.clone()
        z2[:, :, 1] += 1.0
        a, b = decode_unclamped(vae, z), decode_unclamped(vae, z2)
        changed = (a - b).abs().amax(dim=(0, 1, 3, 4)) > 1e-6
        assert changed.tolist() == [False, True, True, True, True, False, False, False, False]


def test_unclamped_decode_matches_decode_and_keeps_gradients_on_black(vae) -> None:
    z = torch.randn(2, 8, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(decode_unclamped(vae, z).clamp(-1, 1), vae.decode(z).sample)

    # A decoder that over-shoots below black: the clamped output is exactly -1 = the target.
    import copy

    dark = copy.deepcopy(vae)
    with torch.no_grad():
        dark.decoder.conv_out.weight.mul_(0.01)
        dark.decoder.conv_out.bias.fill_(-3.0)
    black = torch.full((2, 3, 9, 16, 16), -1.0)
    z = dark.encode(black).latent_dist.mode().detach()
    clamped = dark.decode(z).sample
    assert torch.equal(clamped, black)
    torch.nn.functional.mse_loss(clamped, black).backward()
    grads = [p.grad for p in dark.decoder.parameters()]
    assert all(g is None or not g.any() for g in grads), "clamped loss should give no gradient here"
    dark.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(decode_unclamped(dark, z), black)
    assert loss > 1.0
    loss.backward()
    assert dark.decoder.conv_out.bias.grad.abs().min() > 0.1


def test_fit_lowers_loss_and_reports(vae) -> None:
    import copy

    model = copy.deepcopy(vae)
    train, val = moving_shapes(8, frames=9, seed=0), moving_shapes(4, frames=9, seed=1)

    def train_mse() -> float:
        with torch.no_grad():
            mean = encode_moments(model, train)[:, :8]
            return float(torch.nn.functional.mse_loss(decode_unclamped(model, mean), train))

    before = train_mse()
    cfg = VAEFitConfig(seconds=None, max_steps=12, warmup_seconds=None, warmup_steps=4, batch_size=4, log_every=4,
                       eval_every_seconds=None, lr=3e-3)
    report = fit_vae(model, train, val, cfg)
    after = train_mse()
    assert after < 0.7 * before, (before, after)
    assert report.steps == 12 and report.seconds > 0 and not model.training
    assert [e.phase for e in report.history] == ["frames", "clips", "clips"]
    assert [e.step for e in report.history] == [4, 8, 12]
    assert report.history[-1].val_psnr_db == report.val_psnr_db
    # both PSNRs recomputed with numpy: frames mapped from [-1, 1] to [0, 1], PSNR = 10·log10(1 / MSE)
    with torch.no_grad():
        recon = model.decode(model.encode(val).latent_dist.mode()).sample
    target = (val.double().numpy() + 1.0) / 2.0
    mse = np.mean(((recon.double().numpy() + 1.0) / 2.0 - target) ** 2)
    assert report.val_psnr_db == pytest.approx(10.0 * np.log10(1.0 / mse), abs=1e-3)
    assert report.val_psnr_black_db == pytest.approx(10.0 * np.log10(1.0 / np.mean(target**2)), abs=1e-9)  # black = 0


def test_fit_is_deterministic_from_seed(vae) -> None:
    import copy

    train, val = moving_shapes(4, frames=9, seed=2), moving_shapes(2, frames=9, seed=3)
    cfg = VAEFitConfig(seconds=None, max_steps=3, warmup_seconds=None, warmup_steps=1, batch_size=2,
                       eval_every_seconds=None, seed=5)
    a, b = copy.deepcopy(vae), copy.deepcopy(vae)
    ra, rb = fit_vae(a, train, val, cfg), fit_vae(b, train, val, cfg)
    assert [e.loss for e in ra.history] == pytest.approx([e.loss for e in rb.history], rel=1e-5)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)


def test_config_rejects_short_windows_and_no_budget() -> None:
    with pytest.raises(UserError, match="clip_frames"):
        VAEFitConfig(clip_frames=5)
    with pytest.raises(UserError, match="budget"):
        VAEFitConfig(seconds=None, max_steps=None)
    with pytest.raises(UserError, match="lr_cooldown"):
        VAEFitConfig(lr_cooldown=1.5)


def test_lr_cooldown_follows_the_tighter_budget() -> None:
    from distillery.tinybase.fit_vae import _lr_factor

    cfg = VAEFitConfig(seconds=100.0, max_steps=1000, lr_cooldown=0.2)
    assert _lr_factor(cfg, 10.0, 100) == 1.0
    assert _lr_factor(cfg, 90.0, 100) == pytest.approx(0.5)  # time is the tighter budget
    assert _lr_factor(cfg, 10.0, 900) == pytest.approx(0.5)  # steps are
    assert _lr_factor(cfg, 100.0, 1000) == 0.0
    assert _lr_factor(VAEFitConfig(lr_cooldown=0.0), 239.0, 10) == 1.0


def test_latent_stats_round_trip_through_saved_config(vae, tmp_path: Path) -> None:
    import copy

    from diffusers import AutoencoderKLWan

    model = copy.deepcopy(vae)
    clips = moving_shapes(6, frames=9, seed=4)
    mean, std = latent_stats(model, clips, batch_size=4)
    assert mean.shape == std.shape == (8,) and (std > 0).all()
    set_latent_stats(model, mean, std)
    model.save_pretrained(tmp_path / "vae")
    saved = json.loads((tmp_path / "vae" / "config.json").read_text())
    assert saved["latents_mean"] == pytest.approx(mean.tolist()) and saved["latents_std"] == pytest.approx(std.tolist())

    loaded = AutoencoderKLWan.from_pretrained(tmp_path / "vae")
    assert loaded.config.latents_mean == pytest.approx(mean.tolist())
    with torch.no_grad():
        z = loaded.encode(clips).latent_dist.mode()
    x = normalize_latents(loaded, z)
    flat = x.transpose(0, 1).reshape(8, -1)
    torch.testing.assert_close(flat.mean(1), torch.zeros(8), atol=1e-4, rtol=0)
    torch.testing.assert_close(flat.std(1, unbiased=False), torch.ones(8), atol=1e-4, rtol=0)
    torch.testing.assert_close(denormalize_latents(loaded, x), z, atol=1e-5, rtol=1e-5)

    with pytest.raises(UserError):
        set_latent_stats(model, mean[:4], std[:4])
    with pytest.raises(UserError):
        set_latent_stats(model, mean, -std)
