"""Teacher-Forcing SFT (src/distillery/methods/tfsft.py) and the causal Wan's teacher-forcing forward on the tiny Wan.

- the teacher-forcing forward gives each chunk what streaming gives it against a cache of the clean earlier chunks
  stored at t = 0, bit for bit (for chunks of 1 and 2, a short last chunk included; a causal Cosmos within fp32
  rounding), and its gradient reaches the weights through the clean context too;
- TFSFT is DFSFT's draws and loss through that forward: the same draws, another forward (the context is clean);
- refusals: a bidirectional student (from the config), an image-to-video student.

Its loss and gradients against FastVideo's own code, and the mask against FastVideo's: tests/test_fastvideo_differential.py.
Through the trainer: tests/test_consistency_runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_config, tiny_raw_batch

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.dfsft import DFSFTConfig, DFSFTMethod
from distillery.methods.tfsft import TFSFTConfig, TFSFTMethod
from distillery.models.base import Conditioning
from distillery.models.wan import CausalWanModel, CausalWanModelConfig


@pytest.fixture(scope="module")
def training(tiny_base: Path, latent_set: Path):
    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def _causal(base: Path, chunk: int, trainable: bool = True) -> CausalWanModel:
    return CausalWanModel(CausalWanModelConfig(init_from=str(base), trainable=trainable, chunk_size=chunk), "student")


@pytest.mark.parametrize("chunk", [1, 2])
def test_teacher_forcing_is_streaming_over_a_clean_cache(tiny_base, chunk):
    model = _causal(tiny_base, chunk)
    g = torch.Generator().manual_seed(0)
    b, frames = 2, 5
    clean, noisy = (torch.randn(b, model.in_channels, frames, 8, 8, generator=g) for _ in range(2))
    t = torch.rand(b, frames, generator=g) * 1000
    cond = Conditioning(torch.randn(b, 8, model.text_dim, generator=g))
    forced = model.predict_noise_teacher_forcing(noisy, t, cond, clean)
    streamed = []
    for start in range(0, frames, chunk):
        end = min(start + chunk, frames)
        streamed.append(model.predict_noise_streaming(noisy[:, :, start:end], t[:, start:end], cond, cache_tag="tf",
                                                      store_kv=False, cur_start_frame=start))
        model.predict_noise_streaming(clean[:, :, start:end], torch.zeros(b, end - start), cond, cache_tag="tf",
                                      store_kv=True, cur_start_frame=start)
    assert torch.equal(forced, torch.cat(streamed, dim=2))


def test_teacher_forcing_is_the_block_causal_half_of_every_family(tmp_path):
    """The teacher-forcing forward belongs to the block-causal half every family's causal student shares: a causal
    Cosmos gives each chunk what streaming over a clean cache gives it too (fp32 rounding)."""
    from distillery.models.cosmos.causal import CausalCosmosModel, CausalCosmosModelConfig
    from distillery.tinybase.cosmos import make_tiny_cosmos

    model = CausalCosmosModel(CausalCosmosModelConfig(init_from=str(make_tiny_cosmos(tmp_path / "cosmos", seed=0)),
                                                      chunk_size=1), "student")
    g = torch.Generator().manual_seed(0)
    clean, noisy = (torch.randn(1, model.in_channels, 3, 8, 8, generator=g) for _ in range(2))
    t = torch.rand(1, 3, generator=g) * 1000
    cond = Conditioning(torch.randn(1, 8, model.text_dim, generator=g))
    forced = model.predict_noise_teacher_forcing(noisy, t, cond, clean)
    streamed = []
    for start in range(3):
        streamed.append(model.predict_noise_streaming(noisy[:, :, start:start + 1], t[:, start:start + 1], cond,
                                                      cache_tag="tf", store_kv=False, cur_start_frame=start))
        model.predict_noise_streaming(clean[:, :, start:start + 1], torch.zeros(1, 1), cond, cache_tag="tf", store_kv=True,
                                      cur_start_frame=start)
    torch.testing.assert_close(forced, torch.cat(streamed, dim=2), rtol=1e-5, atol=1e-5)


def test_the_gradient_reaches_the_weights_through_the_clean_context(tiny_base):
    """The first chunk's clean frames are context of the later chunks: the loss of the later chunks has a gradient
    with respect to them (and so through their keys and values to the weights), the first noisy chunk none."""
    model = _causal(tiny_base, 1)
    g = torch.Generator().manual_seed(1)
    clean = torch.randn(1, model.in_channels, 3, 8, 8, generator=g).requires_grad_()
    noisy = torch.randn(1, model.in_channels, 3, 8, 8, generator=g).requires_grad_()
    cond = Conditioning(torch.randn(1, 8, model.text_dim, generator=g))
    v = model.predict_noise_teacher_forcing(noisy, torch.full((1,), 500.0), cond, clean)
    v[:, :, 1:].square().sum().backward()
    assert clean.grad[:, :, 0].abs().sum() > 0 and clean.grad[:, :, 2].abs().sum() == 0  # earlier context only
    assert noisy.grad[:, :, 0].abs().sum() == 0


def test_tfsft_is_dfsfts_draws_through_the_teacher_forcing_forward(tiny_base, training):
    """Same seed, same batch: the same timesteps and noise as DFSFT; a different loss (clean context); the student's
    gradients finite."""
    tf = TFSFTMethod(TFSFTConfig(chunk_size=1), {"student": _causal(tiny_base, 1)}, training)
    df = DFSFTMethod(DFSFTConfig(chunk_size=1), {"student": _causal(tiny_base, 1)}, training)
    seen = {}
    for name, method in (("tf", tf), ("df", df)):
        method.on_train_start(torch.device("cpu"))
        method.build_optimizers()
        prepare = method.student.prepare_batch

        def recording(*args, name=name, prepare=prepare, **kwargs):
            seen[name] = prepare(*args, **kwargs)
            return seen[name]

        method.student.prepare_batch = recording
        out = method.single_train_step(tiny_raw_batch(), 1)
        method.backward(out)
        seen[name + "_loss"] = float(out.losses["total_loss"].detach())
        assert all(torch.isfinite(p.grad).all() for p in method.student.transformer.parameters())
    assert torch.equal(seen["tf"].timesteps, seen["df"].timesteps) and torch.equal(seen["tf"].noise, seen["df"].noise)
    assert seen["tf_loss"] != seen["df_loss"]
    assert tf.sampling_contract() == df.sampling_contract()


def test_refusals_are_one_line(tiny_base, latent_set, tmp_path, training):
    from distillery.engine.builder import check_roles_early
    from distillery.tinybase.tiny_i2v import make_tiny_i2v_base

    cfg = run_config(tiny_base, latent_set, tmp_path / "run", method="distillery.methods.tfsft.TFSFTMethod")
    with pytest.raises(UserError, match="TFSFTMethod needs a CausalModelBase as its student"):
        check_roles_early(load_run_config(raw=cfg, prefixes=allowed_prefixes()))
    base = make_tiny_i2v_base(tmp_path / "i2v", seed=0, captions=["a red circle"])
    with pytest.raises(UserError, match="Teacher-Forcing SFT of an image-to-video student is not supported"):
        TFSFTMethod(TFSFTConfig(chunk_size=1), {"student": _causal(base, 1)}, training)
