"""The VAE decode in larger time chunks and with fused residual blocks is diffusers' decode, and stays off on CPU.

Every check is against the installed diffusers' own ``AutoencoderKLWan.decode`` of a small Wan 2.1 VAE (random
weights, base_dim 8): chunking computes the same function (fp32 within a few 1e-6; chunk 1 bit for bit), the
fused residual blocks too (and switch back to diffusers' forwards exactly), the compiled norm + SiLU stays within
its recompile budget over a whole decode in two dtypes, the GPU-sized chunk follows the GPU's memory, and
validate on CPU decodes exactly as before (no chunking, no fusing, nothing new in the sample cache's material).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distillery.data import vae_decode
from distillery.data.vae_decode import (
    NORM_SILU_GRAPHS,
    auto_chunk_frames,
    chunk_spans,
    decode_video,
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


def test_compiled_norm_silu_covers_a_decode_in_two_dtypes_within_its_graph_budget(vae, latents, monkeypatch):
    """The compiled path (CPU Inductor here, as on CUDA): equal to the reference, and a whole decode in fp32 and
    in bf16 with uneven chunks compiles a handful of graphs, far from the limit past which dynamo runs eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(vae_decode, "norm_silu", lambda x, gamma: norm_silu(x, gamma, compiled=True))
    x, gamma = torch.randn(1, 32, 3, 6, 5), torch.randn(32, 1, 1, 1)
    assert float((norm_silu(x, gamma, compiled=True) - norm_silu_reference(x, gamma)).abs().max()) < 1e-5
    reference = _diffusers(vae, latents)
    from diffusers import AutoencoderKLWan

    half = AutoencoderKLWan.from_config(vae.config).eval()
    half.load_state_dict(vae.state_dict())
    half.to(torch.bfloat16)
    set_fused_decode(vae, True)
    set_fused_decode(half, True)
    try:
        assert float((decode_video(vae, latents, 4) - reference).abs().max()) < 2e-5
        out = decode_video(half, latents.bfloat16(), 3).float()
        assert float((out - reference).abs().max()) < 0.1  # bf16's rounding
    finally:
        set_fused_decode(vae, False)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= NORM_SILU_GRAPHS // 2, f"{graphs} graphs for one decode per dtype"


def test_auto_chunk_follows_the_gpus_memory_and_is_one_on_cpu():
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        real = AutoencoderKLWan()  # Wan 2.1's configuration, no weights allocated
    cuda, shape = torch.device("cuda"), (16, 21, 60, 104)  # 81×480×832
    h200, h100 = 143771 * 2**20, 81559 * 2**20
    real.to(dtype=torch.bfloat16)
    assert (auto_chunk_frames(real, shape, cuda, h200), auto_chunk_frames(real, shape, cuda, h100)) == (13, 7)
    real.to(dtype=torch.float32)
    assert (auto_chunk_frames(real, shape, cuda, h200), auto_chunk_frames(real, shape, cuda, h100)) == (6, 3)
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
    from distillery.evaluation.validate import ValidationConfig, resolve_vae_decode

    assert resolve_vae_decode(None, torch.device("cpu")) == (1, False)
    assert resolve_vae_decode(4, torch.device("cpu")) == (4, False)
    assert resolve_vae_decode(None, torch.device("cuda")) == (None, True)
    with pytest.raises(UserError, match="vae_chunk_frames"):
        ValidationConfig(vae_chunk_frames=0)
