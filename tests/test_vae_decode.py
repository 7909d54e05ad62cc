"""The VAE decode in larger time chunks and with fused residual blocks is diffusers' decode, and stays off on CPU.

Every check is against the installed diffusers' own ``AutoencoderKLWan.decode`` of a small Wan 2.1 VAE (random
weights, base_dim 8): chunking computes the same function (fp32 within a few 1e-6; chunk 1 bit for bit), the
fused residual blocks too (and switch back to diffusers' forwards exactly; in bf16 no further from the fp32 decode
than diffusers' bf16 decode), the GPU's Triton kernels equal the reference (in Triton's interpreter, where Triton
is installed), the GPU-sized chunk follows the GPU's memory, and
validate on CPU decodes exactly as before (no chunking, no fusing, nothing new in the sample cache's material).
The Wan 2.2 VAE (residual up blocks with a ``DupUp3D`` shortcut that drops its duplicated first frame on the first
call, 2×2-patchified output) too, in two tiny layouts: tinybase's (two temporal upsamplers) and TI2V-5B's own
(``dim_mult [1, 2, 4, 4]``, ``temperal_downsample [False, True, True]``, spatial factor 16), base_dim 8.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from distillery.data import vae_kernels
from distillery.data.vae_decode import (
    auto_chunk_frames,
    bias_residual_,
    chunk_spans,
    chunked_decode_applies,
    decode_video,
    dup_up_add_,
    full_resolution_layout,
    fused_decode_applies,
    norm_silu,
    norm_silu_reference,
    set_fused_decode,
)


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8).eval()


@pytest.fixture(scope="module")
def latents():
    return torch.randn(1, 16, 6, 6, 8, generator=torch.Generator().manual_seed(1))


def _diffusers(vae, z):
    set_fused_decode(vae, False)
    with torch.no_grad():
        return vae.decode(z, return_dict=False)[0]


def test_chunk_spans_start_with_frame_zero_alone_and_cover_every_frame():
    assert chunk_spans(21, 4) == [(0, 1), (1, 5), (5, 9), (9, 13), (13, 17), (17, 21)]
    assert chunk_spans(21, 20) == [(0, 1), (1, 21)]
    assert chunk_spans(21, 1) == [(0, 1)] + [(i, i + 1) for i in range(1, 21)]
    assert chunk_spans(1, 8) == [(0, 1)]
    with pytest.raises(ValueError, match="chunk_frames"):
        chunk_spans(21, 0)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 100])
def test_chunked_decode_is_diffusers_decode(vae, latents, chunk):
    reference = _diffusers(vae, latents)
    out = decode_video(vae, latents, chunk)
    assert out.shape == reference.shape == (1, 3, 21, 48, 64)
    if chunk == 1:
        assert torch.equal(out, reference)  # diffusers' own loop
    else:
        assert float((out - reference).abs().max()) < 2e-5  # the same sums, in another order
    assert vae._feat_map is not None and all(f is None for f in vae._feat_map)  # no activations left in the cache


def test_fused_blocks_are_diffusers_decode_and_switch_back_exactly(vae, latents):
    reference = _diffusers(vae, latents)
    assert set_fused_decode(vae, True)
    try:
        replaced = [m for m in vae.decoder.modules() if "forward" in m.__dict__]
        assert replaced, "no decoder module got the fused forward"
        assert vae.decoder in replaced  # the head's norm + SiLU + padding too
        for chunk in (1, 4):
            assert float((decode_video(vae, latents, chunk) - reference).abs().max()) < 2e-5
    finally:
        assert not set_fused_decode(vae, False)
    assert not any("forward" in m.__dict__ for m in vae.decoder.modules())
    assert torch.equal(decode_video(vae, latents, 1), reference)


def test_fused_upsampler_is_bit_exact_in_bfloat16(vae):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanUpsample

    upsampler = next(m for m in vae.decoder.modules() if isinstance(m, WanUpsample))
    x = torch.randn(3, 8, 5, 7).bfloat16()
    before = upsampler(x)
    set_fused_decode(vae, True)
    try:
        assert torch.equal(upsampler(x), before)  # nearest-exact copies values: no need for the fp32 round trip
    finally:
        set_fused_decode(vae, False)


def test_norm_silu_is_wans_rms_norm_then_silu():
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    norm = WanRMS_norm(24, images=False)
    with torch.no_grad():
        norm.gamma.normal_()
    x = torch.randn(2, 24, 3, 5, 6)
    x[0, :, 0, 0, 0] = 0.0  # an all-zero channel vector: F.normalize's eps, not a NaN
    with torch.no_grad():
        expected = torch.nn.functional.silu(norm(x))
        got = norm_silu_reference(x, norm.gamma)
    assert torch.isfinite(got).all()
    assert float((got - expected).abs().max()) < 1e-5


def test_norm_silu_folds_the_bias_and_follows_the_prefix():
    x, gamma, bias = torch.randn(1, 32, 3, 6, 5), torch.randn(32, 1, 1, 1), torch.randn(32)
    shifted = norm_silu_reference(x + bias.reshape(1, -1, 1, 1, 1), gamma)
    assert float((norm_silu_reference(x, gamma, bias=bias) - shifted).abs().max()) < 1e-6
    prefix = torch.randn(1, 32, 2, 6, 5)  # a causal convolution's cached frames: the result follows them in time
    padded = norm_silu(x, gamma, prefix, bias)
    assert padded.shape == (1, 32, 5, 6, 5) and torch.equal(padded[:, :, :2], prefix)
    assert float((padded[:, :, 2:] - shifted).abs().max()) < 1e-6


def test_a_failing_kernel_falls_back_to_the_eager_passes_once_and_says_so(monkeypatch, caplog):
    """Where Triton imports but cannot compile or launch (an older GPU, a broken toolchain) the decode carries on
    with the eager passes, which compute the same, and the log says why once."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("PTX .version 8.7 does not support .target sm_61")

    monkeypatch.setattr(vae_kernels, "_failure", None)
    monkeypatch.setattr(vae_kernels, "_triton_importable", lambda: True)
    monkeypatch.setattr(vae_kernels, "_interpreting", lambda: True)  # CPU tensors count as the kernels' device
    monkeypatch.setattr(vae_kernels, "norm_silu_into", broken)
    monkeypatch.setattr(vae_kernels, "bias_residual_", broken)
    x, gamma, bias, prefix = torch.randn(1, 8, 3, 4, 5), torch.randn(8), torch.randn(8), torch.randn(1, 8, 2, 4, 5)
    with caplog.at_level("WARNING", logger="distillery.data.vae_kernels"):
        got = norm_silu(x, gamma, prefix, bias)
        assert torch.equal(got, norm_silu_reference(x, gamma, prefix, bias))
        h = torch.randn_like(x)
        expected = x + h + bias.reshape(1, -1, 1, 1, 1)
        assert float((bias_residual_(x, h, bias) - expected).abs().max()) < 1e-6
    assert len(calls) == 1 and not vae_kernels.available(x)  # disabled after the first failure
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "sm_61" in caplog.records[0].getMessage()


def _assert_fused_bf16_within_diffusers_rounding(vae, z: torch.Tensor) -> None:
    """The fused decode of ``vae`` cast to bf16, chunks of 3, against the fp32 decode: no more error than
    diffusers' own bf16 decode (it rounds less, not more)."""
    from diffusers import AutoencoderKLWan

    reference = _diffusers(vae, z)
    half = AutoencoderKLWan.from_config(vae.config).eval()
    half.load_state_dict(vae.state_dict())
    half.to(torch.bfloat16)
    with torch.no_grad():
        diffusers_bf16 = half.decode(z.bfloat16(), return_dict=False)[0].float()
    assert set_fused_decode(half, True)
    out = decode_video(half, z.bfloat16(), 3).float()
    ours, theirs = float((out - reference).abs().max()), float((diffusers_bf16 - reference).abs().max())
    assert ours < 0.1 and ours <= 1.5 * theirs  # fewer roundings than diffusers' bf16 decode, not more error


def test_fused_decode_in_bfloat16_is_diffusers_decode_within_its_rounding(vae, latents):
    _assert_fused_bf16_within_diffusers_rounding(vae, latents)


INTERPRETED_KERNELS = """
import torch
from distillery.data import vae_kernels
from distillery.data.vae_decode import norm_silu_reference

for channels in (24, 384, 1024):  # Wan 2.1's decoder: ≤ 384 channels, Wan 2.2's: ≤ 1024
    x = torch.randn(2, channels, 3, 5, 7)
    gamma, bias = torch.randn(channels), torch.randn(channels)
    out = torch.full((2, channels, 5, 5, 7), 7.0)
    assert vae_kernels.available(x)
    vae_kernels.norm_silu_into(x, gamma, out, 2, bias)
    assert torch.equal(out[:, :, :2], torch.full_like(out[:, :, :2], 7.0))  # the prefix frames untouched
    assert float((out[:, :, 2:] - norm_silu_reference(x, gamma, bias=bias)).abs().max()) < 1e-5
x, h, bias = torch.randn(3, 6, 3, 5, 7), torch.randn(3, 6, 3, 5, 7), torch.randn(6)
expected = x + h + bias.reshape(1, -1, 1, 1, 1)
assert float((vae_kernels.bias_residual_(x, h, bias) - expected).abs().max()) < 1e-5
assert float((x - expected).abs().max()) < 1e-5  # in place
vae_kernels.MAX_GRID_ROWS = 12  # two samples a launch: the batch split over launches adds the same
x = torch.randn(3, 6, 3, 5, 7)
expected = x + h
assert float((vae_kernels.bias_residual_(x, h) - expected).abs().max()) < 1e-5
print("kernels ok")
"""


@pytest.mark.process
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (GPU machines have it)")
def test_triton_kernels_equal_the_reference_in_the_interpreter():
    """The GPU kernels run on CPU tensors in Triton's interpreter (a fresh process: Triton reads
    ``TRITON_INTERPRET`` when it is imported): the norm (with bias, into a padded buffer, 24, 384 and 1024 channels, a
    spatial size no tile divides) and the bias + shortcut add."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED_KERNELS], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "kernels ok" in done.stdout, done.stderr[-3000:]


def test_auto_chunk_follows_the_gpus_memory_and_is_one_on_cpu():
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        real = AutoencoderKLWan()  # Wan 2.1's configuration, no weights allocated
    cuda, shape = torch.device("cuda"), (16, 21, 60, 104)  # 81×480×832
    h200, h100 = 143771 * 2**20, 81559 * 2**20
    real.to(dtype=torch.bfloat16)
    assert (auto_chunk_frames(real, shape, cuda, h200), auto_chunk_frames(real, shape, cuda, h100)) == (10, 7)  # ≤ 13 and 7 fit: 2 and 3 even calls
    real.to(dtype=torch.float32)
    assert (auto_chunk_frames(real, shape, cuda, h200), auto_chunk_frames(real, shape, cuda, h100)) == (5, 3)  # ≤ 6 and 3 fit: 4 and 7 calls
    assert auto_chunk_frames(real, (16, 5, 4, 4), cuda, h200) == 4  # never more than the frames after the first
    assert auto_chunk_frames(real, (16, 2, 60, 104), cuda, h200) == 1
    assert auto_chunk_frames(real, shape, torch.device("cpu")) == 1


def test_a_tiling_vae_goes_through_diffusers_decode(vae, latents):
    reference = _diffusers(vae, latents)
    vae.enable_tiling()
    try:
        assert not set_fused_decode(vae, True)  # refused: not a layout this module checked
        with torch.no_grad():
            tiled = vae.decode(latents, return_dict=False)[0]
        assert torch.equal(decode_video(vae, latents, 5), tiled)
    finally:
        vae.disable_tiling()
    assert torch.equal(decode_video(vae, latents, 1), reference)


def test_base_encoders_decode_chunked_and_fused_to_the_same_frames(tmp_path):
    from distillery.data.encoders import BaseEncoders
    from distillery.tinybase.shipped import shipped_tiny_base

    enc = BaseEncoders(shipped_tiny_base(), text_encoder=False)
    latents = torch.randn(1, enc.z_dim, 5, 4, 4, generator=torch.Generator().manual_seed(2))
    assert (enc.decode_chunk_frames, enc.fused_decode) == (1, False)  # the default: diffusers' decode
    plain = enc.decode_latents(latents)
    enc.configure_decode(3, True)
    assert enc.chunk_frames_for(tuple(latents.shape)) == 3 and enc.fused_decode
    faster = enc.decode_latents(latents)
    assert plain.dtype == faster.dtype == np.uint8 and plain.shape == faster.shape
    assert int(np.abs(plain.astype(int) - faster.astype(int)).max()) <= 1  # rounding at a grey level's edge at most
    enc.configure_decode(None, False)
    assert enc.chunk_frames_for(tuple(latents.shape)) == 1  # auto on CPU: diffusers' loop
    assert np.array_equal(enc.decode_latents(latents), plain)
    with pytest.raises(ValueError, match="decode_chunk_frames"):
        enc.configure_decode(0, False)


def test_validate_on_cpu_decodes_as_before():
    from distillery.common.errors import UserError
    from distillery.evaluation.sampling_context import resolve_vae_decode
    from distillery.evaluation.validation_config import ValidationConfig

    assert resolve_vae_decode(None, torch.device("cpu")) == (1, False)
    assert resolve_vae_decode(4, torch.device("cpu")) == (4, False)
    assert resolve_vae_decode(None, torch.device("cuda")) == (None, True)
    with pytest.raises(UserError, match="vae_chunk_frames"):
        ValidationConfig(vae_chunk_frames=0)


def _wan22_ti2v_layout():
    """The TI2V-5B VAE's layout (three up-sampling stages, the first one spatial only; spatial factor 16) with
    base_dim 8."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                            temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                            patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                            latents_mean=[0.0] * 48, latents_std=[1.0] * 48).eval()


@pytest.fixture(scope="module", params=["tinybase", "ti2v-5b-layout"])
def wan22_vae(request):
    from distillery.tinybase.wan22 import build_wan22_vae

    torch.manual_seed(3)
    vae = build_wan22_vae() if request.param == "tinybase" else _wan22_ti2v_layout()
    assert vae.config.is_residual and vae.config.patch_size == 2
    return vae


@pytest.mark.parametrize("frames", [1, 2, 5, 8])
def test_wan22_chunked_and_fused_decode_is_diffusers_decode(wan22_vae, frames):
    """Frame 0 alone (``first_chunk``: the upsamplers keep one frame, ``DupUp3D`` drops its duplicate), then 1, 2, 3
    or all the remaining latent frames a call, unpatchified and clamped: diffusers' frame-by-frame decode (chunk 1 and
    every decode of ≤ 2 latent frames: the same calls, bit for bit). The fused residual blocks too."""
    z = torch.randn(1, 48, frames, 3, 4, generator=torch.Generator().manual_seed(frames))
    reference = _diffusers(wan22_vae, z)
    spatial = int(wan22_vae.config.scale_factor_spatial)
    assert reference.shape == (1, 3, 4 * (frames - 1) + 1, 3 * spatial, 4 * spatial)
    assert chunked_decode_applies(wan22_vae) and fused_decode_applies(wan22_vae)
    for chunk in (1, 2, 3, frames):
        out = decode_video(wan22_vae, z, chunk)
        assert out.shape == reference.shape and out.dtype == reference.dtype
        if chunk == 1 or frames <= 2:
            assert torch.equal(out, reference)
        else:
            assert float((out - reference).abs().max()) < 5e-6  # measured ≤ 1.2e-6
        assert all(f is None for f in wan22_vae._feat_map)
    assert set_fused_decode(wan22_vae, True)
    try:
        fused = {type(m).__name__ for m in wan22_vae.decoder.modules() if "forward" in m.__dict__}
        assert {"WanDecoder3d", "WanResidualUpBlock", "WanResidualBlock", "WanCausalConv3d", "WanUpsample"} <= fused
        for chunk in (1, 3, frames):
            assert float((decode_video(wan22_vae, z, chunk) - reference).abs().max()) < 5e-6  # measured ≤ 1.7e-6
    finally:
        assert not set_fused_decode(wan22_vae, False)
    assert torch.equal(decode_video(wan22_vae, z, 1), reference)


def test_wan22_chunks_need_first_chunk_on_the_first_call_only(wan22_vae):
    """What the chunked decode relies on, shown failing when broken: with ``first_chunk`` on a later call, or a
    first call of two latent frames, the residual up block's upsampler and ``DupUp3D`` shortcut disagree in frames."""
    z = torch.randn(1, 48, 5, 3, 4, generator=torch.Generator().manual_seed(9))
    reference = _diffusers(wan22_vae, z)

    def decode(spans, first):
        wan22_vae.clear_cache()
        with torch.no_grad():
            x = wan22_vae.post_quant_conv(z)
            parts = []
            for i, (start, end) in enumerate(spans):
                wan22_vae._conv_idx = [0]
                parts.append(wan22_vae.decoder(x[:, :, start:end], feat_cache=wan22_vae._feat_map,
                                               feat_idx=wan22_vae._conv_idx, first_chunk=first(i)))
        wan22_vae.clear_cache()
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        return unpatchify(torch.cat(parts, dim=2), 2).clamp(-1.0, 1.0)

    assert float((decode(chunk_spans(5, 2), lambda i: i == 0) - reference).abs().max()) < 5e-6
    with pytest.raises(RuntimeError, match="size of tensor"):  # the shortcut drops a frame the upsampler keeps
        decode(chunk_spans(5, 2), lambda i: True)
    with pytest.raises(RuntimeError, match="size of tensor"):  # the first upsampling call doubles no frame
        decode([(0, 2), (2, 5)], lambda i: i == 0)


def test_wan22_fused_decode_in_bfloat16_is_diffusers_decode_within_its_rounding(wan22_vae):
    _assert_fused_bf16_within_diffusers_rounding(wan22_vae, torch.randn(1, 48, 5, 3, 4, generator=torch.Generator().manual_seed(4)))


def test_wan22_chunk_sizing_counts_the_wide_half_resolution_activations():
    """TI2V-5B's VAE (no weights): activations at half the video's size (2×2 patches) and 512 channels (its last
    upsampler's width, before the last up block narrows to 256) — 8.3 GB a latent frame in bf16 at 704×1280, so
    4 latent frames a call on an H200 (30 frames after the first in 8 calls), 2 on an H100."""
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        real = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                                out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4)
        wan21 = AutoencoderKLWan()
    assert full_resolution_layout(real) == (512, 8) and full_resolution_layout(wan21) == (96, 8)
    real.to(dtype=torch.bfloat16)
    cuda, shape = torch.device("cuda"), (48, 31, 44, 80)  # 121×704×1280
    assert auto_chunk_frames(real, shape, cuda, 143771 * 2**20) == 4
    assert auto_chunk_frames(real, shape, cuda, 81559 * 2**20) == 2
    assert auto_chunk_frames(real, shape, torch.device("cpu")) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("factor_t", "frames", "first_chunk"), [(1, 3, False), (1, 1, True), (2, 3, False),
                                                                 (2, 1, True), (2, 3, True)])
def test_dup_up_add_is_diffusers_shortcut_add_bit_for_bit(dtype, factor_t, frames, first_chunk):
    """The in-place ``DupUp3D`` add of the lean residual up block equals diffusers' ``x + shortcut(source)`` exactly
    (the same values, one rounding), into an upsampler's permuted (non-contiguous) output too; ``first_chunk`` of
    more than one frame (no decode does it) takes diffusers' own way."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    shortcut = DupUp3D(16, 8, factor_t=factor_t, factor_s=2)
    generator = torch.Generator().manual_seed(factor_t * 10 + frames)
    source = torch.randn(1, 16, frames, 3, 5, generator=generator).to(dtype)
    out_frames = frames * factor_t - (factor_t - 1 if first_chunk else 0)
    x = torch.randn(1, out_frames, 8, 6, 10, generator=generator).to(dtype).permute(0, 2, 1, 3, 4)  # WanResample's layout
    expected = x + shortcut(source, first_chunk=first_chunk)
    got = dup_up_add_(x, shortcut, source, first_chunk)
    assert got is x and torch.equal(got, expected)
