"""SFT and Diffusion-Forcing SFT steps, checked against losses recomputed by hand.

Each test runs a real method step on the tiny Wan and records what the step drew (the
``TrainingBatch`` its model built) and what the transformer saw and returned (a forward hook).
From those it recomputes the documented quantities independently — the shifted timestep table,
the Gaussian index weights, per-chunk timesteps, ``x_t``, the velocity / x0 loss, caption dropout —
and compares them with what the method did and returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import run_config

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.dfsft import DFSFTConfig, DFSFTMethod
from distillery.methods.sft import SFTMethod
from distillery.models.wan import WanModel, WanModelConfig

N = 1000  # num_train_timesteps
SHIFT = 3.0  # the tiny base's scheduler shift


def table_by_hand(n: int = N, shift: float = SHIFT) -> np.ndarray:
    """Entry i = n · shift((n − i)/n) with shift(σ) = sσ / (1 + (s − 1)σ), float64."""
    u = (n - np.arange(n, dtype=np.float64)) / n
    return n * shift * u / (1.0 + (shift - 1.0) * u)


def weights_by_hand(n: int = N) -> np.ndarray:
    """w(i) = g(i) − min g, g(i) = exp(−2((i − n/2)/n)²), scaled to mean 1."""
    i = np.arange(n, dtype=np.float64)
    g = np.exp(-2.0 * ((i - n / 2) / n) ** 2)
    w = g - g.min()
    return w / w.mean()


@dataclass
class Step:
    """What one ``single_train_step`` did: the batch its model prepared, the transformer's inputs and output."""

    loss: torch.Tensor
    flow_loss: torch.Tensor
    batch: Any  # TrainingBatch after the step (caption dropout applied in place)
    calls: list[dict[str, torch.Tensor]] = field(default_factory=list)  # one per transformer forward


@pytest.fixture(scope="module")
def training(tiny_base: Path, latent_set: Path):
    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def make(method_cls, knobs, tiny_base: Path, training):
    model = WanModel(WanModelConfig(init_from=str(tiny_base)), "student")
    assert model.schedule.shift == SHIFT
    config = method_cls.config_class(**knobs)
    return method_cls(config, {"student": model}, training)


def raw_batch(b: int, t: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(b, 8, t, 8, 8, generator=g), "text_embeds": torch.randn(b, 8, 32, generator=g),
            "empty_text_embeds": torch.randn(8, 32, generator=g)}  # a non-zero empty prompt, to tell the two apart


def run_step(method, raw: dict[str, torch.Tensor]) -> Step:
    student = method.student
    prepared: list[Any] = []
    calls: list[dict[str, torch.Tensor]] = []
    prepare = student.prepare_batch

    def recording_prepare(*args, **kwargs):
        prepared.append(prepare(*args, **kwargs))
        return prepared[-1]

    def hook(_module, _args, kwargs, output):
        calls.append({"hidden_states": kwargs["hidden_states"].detach().clone(), "timestep": kwargs["timestep"].detach().clone(),
                      "text": kwargs["encoder_hidden_states"].detach().clone(), "v": output[0].detach().clone()})

    student.prepare_batch = recording_prepare
    handle = student.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        out = method.single_train_step(raw, step=1)
    finally:
        handle.remove()
        del student.prepare_batch
    assert len(prepared) == 1 and len(calls) == 1
    return Step(out.losses["total_loss"].detach(), out.losses["flow_loss"].detach(), prepared[0], calls)


def table_indices(timesteps: torch.Tensor) -> np.ndarray:
    """Index of each timestep in the hand-made table (every timestep must be a table entry)."""
    table = table_by_hand()
    t = timesteps.double().numpy()
    idx = np.abs(t[..., None] - table).argmin(-1)
    np.testing.assert_allclose(t, table[idx], rtol=0, atol=1e-3)  # fp32 table vs float64
    return idx


def per_frame_loss(step: Step, precondition: bool) -> torch.Tensor:
    """``[B, T]`` squared error of the velocity (or of x0 = x_t − σ v) averaged over C, H, W."""
    tb, v = step.batch, step.calls[0]["v"].float()
    sigma = (tb.timesteps.double() / N).float()[:, None, :, None, None]
    if precondition:
        err = (tb.noisy_latents - sigma * v) - tb.latents
    else:
        err = v - (tb.noise - tb.latents)
    return err.pow(2).mean(dim=(1, 3, 4))


# -- DFSFT ----------------------------------------------------------------------------------------
def test_dfsft_index_weights_and_table_are_the_documented_ones():
    from distillery.methods.dfsft import dfsft_index_weights
    from distillery.models.schedule import FlowMatchSchedule

    w = dfsft_index_weights(N).double().numpy()
    np.testing.assert_allclose(w, weights_by_hand(), rtol=1e-6, atol=1e-6)
    assert w[0] == 0.0 and int(np.argmax(w)) == N // 2 and w.mean() == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(FlowMatchSchedule(shift=SHIFT).timestep_table().double().numpy(), table_by_hand(),
                               rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("chunk_size, chunks", [(3, [[0, 1, 2], [3, 4, 5], [6]]), (2, [[0, 1], [2, 3], [4, 5], [6]]),
                                                (7, [[0, 1, 2, 3, 4, 5, 6]])])
def test_dfsft_frames_of_a_chunk_share_one_timestep_and_chunks_differ(tiny_base, training, chunk_size, chunks):
    method = make(DFSFTMethod, {"chunk_size": chunk_size}, tiny_base, training)
    raw = raw_batch(6, 7)
    step = run_step(method, raw)
    tb = step.batch
    assert tb.timesteps.shape == (6, 7)
    for row in tb.timesteps:
        per_chunk = [row[c] for c in chunks]
        assert all(torch.equal(t, t[:1].expand_as(t)) for t in per_chunk), row  # one timestep per chunk
        firsts = [t[0].item() for t in per_chunk]
        assert len(set(firsts)) == len(chunks), row  # independent draws per chunk (no collision for this seed)
    assert len({tuple(r.tolist()) for r in tb.timesteps}) == 6  # and per sample
    table_indices(tb.timesteps)  # every timestep is an entry of the shifted table
    # x_t = (1 − σ_f) x0 + σ_f ε per frame f, with the frame's own σ
    sigma = (tb.timesteps / N)[:, None, :, None, None]
    torch.testing.assert_close(tb.noisy_latents, (1 - sigma) * raw["latents"] + sigma * tb.noise, rtol=0, atol=1e-6)
    # the transformer sees each frame's timestep on each of its (H/2)·(W/2) = 16 tokens
    call = step.calls[0]
    assert torch.equal(call["hidden_states"], tb.noisy_latents)
    torch.testing.assert_close(call["timestep"], tb.timesteps.repeat_interleave(16, dim=1), rtol=0, atol=0)


@pytest.mark.parametrize("precondition", [False, True])
def test_dfsft_loss_is_the_index_weighted_per_frame_loss(tiny_base, training, precondition):
    method = make(DFSFTMethod, {"chunk_size": 2, "precondition_outputs": precondition}, tiny_base, training)
    step = run_step(method, raw_batch(4, 5, seed=1))
    frame_loss = per_frame_loss(step, precondition).double()
    weights = torch.from_numpy(weights_by_hand()[table_indices(step.batch.timesteps)])
    torch.testing.assert_close(step.loss.double(), (weights * frame_loss).mean(), rtol=1e-5, atol=0)
    torch.testing.assert_close(step.flow_loss.double(), frame_loss.mean(), rtol=1e-5, atol=0)
    assert not torch.allclose(step.loss.double(), frame_loss.mean(), rtol=1e-2)  # the weighting does change it
    if precondition:  # x0 error = σ·(velocity error): the preconditioned loss is σ² × the velocity loss per frame
        sigma = step.batch.timesteps.double() / N
        torch.testing.assert_close(frame_loss, sigma**2 * per_frame_loss(step, False).double(), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("lo, hi", [(0.25, 0.5), (0.9, 1.0), (0.0, 0.001)])
def test_dfsft_timestep_ratios_bound_the_table_indices(tiny_base, training, lo, hi):
    method = make(DFSFTMethod, {"chunk_size": 1, "min_timestep_ratio": lo, "max_timestep_ratio": hi}, tiny_base, training)
    idx = method.sample_frame_indices(256, 8).numpy()  # 2048 draws
    first, last = int(round(lo * N)), max(int(round(hi * N)), int(round(lo * N)) + 1)  # [first, last) by hand
    assert idx.min() == first and idx.max() == last - 1, (idx.min(), idx.max())
    assert set(np.unique(idx).tolist()) == set(range(first, last))  # and every index in between is drawn
    step = run_step(method, raw_batch(8, 4, seed=2))
    got = table_indices(step.batch.timesteps)
    assert got.min() >= first and got.max() < last
    t = step.batch.timesteps.double().numpy()  # descending table: high ratio = low timestep
    table = table_by_hand()
    assert (t <= table[first] + 1e-3).all() and (t >= table[last - 1] - 1e-3).all()


def test_dfsft_caption_dropout_swaps_in_the_empty_prompt(tiny_base, training):
    raw = raw_batch(64, 2, seed=3)
    empty = raw["empty_text_embeds"].expand(64, -1, -1)
    for p, expect in ((0.0, 0), (1.0, 64)):
        step = run_step(make(DFSFTMethod, {"chunk_size": 1, "caption_dropout": p}, tiny_base, training), raw)
        dropped = [torch.equal(step.calls[0]["text"][i], empty[i]) for i in range(64)]
        kept = [torch.equal(step.calls[0]["text"][i], raw["text_embeds"][i]) for i in range(64)]
        assert sum(dropped) == expect and sum(kept) == 64 - expect
    step = run_step(make(DFSFTMethod, {"chunk_size": 1, "caption_dropout": 0.5}, tiny_base, training), raw)
    seen = step.calls[0]["text"]
    dropped = [torch.equal(seen[i], empty[i]) for i in range(64)]
    kept = [torch.equal(seen[i], raw["text_embeds"][i]) for i in range(64)]
    assert all(d != k for d, k in zip(dropped, kept))  # each row is exactly one of the two
    assert 20 <= sum(dropped) <= 44, sum(dropped)  # Binomial(64, 0.5): 4 standard deviations


def test_dfsft_config_rejects_bad_knobs():
    # chunk_size: its declared range (a UserError naming the key, as a run config's); the rest: the class's own rules
    with pytest.raises(UserError, match=r"^config error: method.chunk_size: 0: must be ≥ 1$"):
        DFSFTConfig(chunk_size=0)
    for bad in ({"min_timestep_ratio": 0.5, "max_timestep_ratio": 0.5}, {"max_timestep_ratio": 1.5}, {"caption_dropout": -0.1}):
        with pytest.raises(ValueError):
            DFSFTConfig(**bad)


# -- SFT ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precondition", [False, True])
def test_sft_loss_is_the_per_sample_flow_matching_loss(tiny_base, training, precondition):
    method = make(SFTMethod, {"precondition_outputs": precondition}, tiny_base, training)
    step = run_step(method, raw_batch(4, 3, seed=4))
    tb = step.batch
    assert tb.timesteps.shape == (4,)
    assert ((tb.timesteps >= 0) & (tb.timesteps <= N)).all() and len(set(tb.timesteps.tolist())) == 4
    torch.testing.assert_close(step.calls[0]["timestep"], tb.timesteps, rtol=0, atol=0)
    sigma = (tb.timesteps / N)[:, None, None, None, None]
    torch.testing.assert_close(tb.noisy_latents, (1 - sigma) * tb.latents + sigma * tb.noise, rtol=0, atol=1e-6)
    v = step.calls[0]["v"]
    err = (tb.noisy_latents - sigma * v - tb.latents) if precondition else (v - (tb.noise - tb.latents))
    torch.testing.assert_close(step.loss, err.pow(2).mean(), rtol=1e-5, atol=0)


def test_sft_caption_dropout_swaps_in_the_empty_prompt(tiny_base, training):
    raw = raw_batch(64, 1, seed=5)
    step = run_step(make(SFTMethod, {"caption_dropout": 0.5}, tiny_base, training), raw)
    seen = step.calls[0]["text"]
    dropped = sum(torch.equal(seen[i], raw["empty_text_embeds"]) for i in range(64))
    kept = sum(torch.equal(seen[i], raw["text_embeds"][i]) for i in range(64))
    assert dropped + kept == 64 and 20 <= dropped <= 44, (dropped, kept)
    step = run_step(make(SFTMethod, {"caption_dropout": 1.0}, tiny_base, training), raw)
    assert all(torch.equal(step.calls[0]["text"][i], raw["empty_text_embeds"]) for i in range(64))


def test_caption_dropout_refuses_a_latent_set_without_the_empty_prompt(tiny_base, training):
    """Issue 46: without the empty prompt's embedding, a dropped caption became zeros (not the empty prompt)."""
    raw = {k: v for k, v in raw_batch(4, 1, seed=6).items() if k != "empty_text_embeds"}
    for cls, knobs in ((SFTMethod, {"caption_dropout": 0.5}), (DFSFTMethod, {"chunk_size": 1, "caption_dropout": 0.5})):
        with pytest.raises(UserError, match=r"has no empty_prompt\.safetensors.*caption dropout \(0\.5\).*zeros are not it"):
            run_step(make(cls, knobs, tiny_base, training), raw)
        run_step(make(cls, {**knobs, "caption_dropout": 0.0}, tiny_base, training), raw)  # not needed: no refusal
