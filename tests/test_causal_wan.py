"""Causal Wan (models/wan/causal.py) and the ``causal_streaming`` sampler on the shipped tiny Wan.

The key property: streaming a video chunk by chunk through the KV cache gives every chunk what one
block-causal forward over the whole video gives it (fp32, ≤ 1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch

from distillery.common.errors import UserError
from distillery.models.base import CausalModelBase, Conditioning
from distillery.models.wan import CausalWanModel, CausalWanModelConfig, WanModel, WanModelConfig
from distillery.sampling import build_sampler
from distillery.tinybase.shipped import shipped_tiny_base

C, H, W = 8, 4, 4  # tiny base: z_dim 8; patch (1, 2, 2) → 4 tokens per latent frame


def _causal(chunk_size: int, trainable: bool = False) -> CausalWanModel:
    model = CausalWanModel(CausalWanModelConfig(init_from=str(shipped_tiny_base()), trainable=trainable,
                                                chunk_size=chunk_size), role="student")
    model.transformer.eval()  # no dropout either way
    return model


@pytest.fixture(scope="module")
def causal2() -> CausalWanModel:
    return _causal(2)


@pytest.fixture(scope="module")
def bidirectional() -> WanModel:
    return WanModel(WanModelConfig(init_from=str(shipped_tiny_base()), trainable=False), role="teacher")


@pytest.fixture(scope="module")
def cond() -> Conditioning:
    g = torch.Generator().manual_seed(3)
    return Conditioning(torch.randn(2, 6, 32, generator=g), torch.randn(2, 6, 32, generator=g))


def _video(frames: int, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, C, frames, H, W, generator=torch.Generator().manual_seed(seed))


def _stream(model: CausalWanModel, video: torch.Tensor, t: torch.Tensor, cond: Conditioning, sizes: list[int],
            tag: str = "pos") -> torch.Tensor:
    """Stream ``video`` in pieces of ``sizes`` frames with store_kv=True; per-frame ``t`` [B, T] sliced."""
    model.clear_caches(tag)
    outs, start = [], 0
    for f in sizes:
        outs.append(model.predict_noise_streaming(video[:, :, start:start + f], t[:, start:start + f], cond,
                                                  cache_tag=tag, store_kv=True, cur_start_frame=start))
        start += f
    model.clear_caches(tag)
    return torch.cat(outs, dim=2)


def _masked_reference(model: CausalWanModel, video: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    """The block-causal forward written the plain way: a copy of the stock transformer whose
    self-attention gets an explicit boolean mask [L, L] (query frame's chunk ≥ key frame's chunk)."""
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    stock = WanTransformer3DModel.from_pretrained(shipped_tiny_base() / "transformer", torch_dtype=torch.float32).eval()
    frames, tokens = video.shape[2], (H // 2) * (W // 2)
    chunk = torch.arange(frames).repeat_interleave(tokens) // model.chunk_size
    mask = chunk[None, :] <= chunk[:, None]  # [query, key]

    class Masked(WanAttnProcessor):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
            return super().__call__(attn, hidden_states, encoder_hidden_states, mask, rotary_emb)

    for block in stock.blocks:
        block.attn1.set_processor(Masked())
    per_token = model._model_timesteps(t, video)
    with torch.no_grad():
        return stock(hidden_states=video, timestep=per_token, encoder_hidden_states=cond.text_embeds, return_dict=False)[0]


def test_full_forward_is_block_causal(causal2, cond):
    video = _video(6)
    t = torch.tensor([[0.0, 0.0, 300.0, 300.0, 800.0, 800.0], [100.0, 100.0, 500.0, 500.0, 900.0, 900.0]])
    with torch.no_grad():
        out = causal2.predict_noise(video, t, cond)
        later = video.clone()
        later[:, :, 4:] += 1.0  # change the last chunk: the first two chunks do not see it
        moved = causal2.predict_noise(later, t, cond)
        earlier = video.clone()
        earlier[:, :, 2] += 1.0  # change frame 2: its chunk mate (frame 3) and the last chunk see it, chunk 0 does not
        moved_earlier = causal2.predict_noise(earlier, t, cond)
    assert torch.equal(out[:, :, :4], moved[:, :, :4]) and not torch.allclose(out[:, :, 4:], moved[:, :, 4:])
    assert torch.equal(out[:, :, :2], moved_earlier[:, :, :2])
    assert not torch.allclose(out[:, :, 3], moved_earlier[:, :, 3]) and not torch.allclose(out[:, :, 4:], moved_earlier[:, :, 4:])
    torch.testing.assert_close(out, _masked_reference(causal2, video, t, cond), rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_size, sizes", [(2, [2, 2, 2]), (3, [3, 3]), (4, [4, 2]), (2, [4, 1]), (1, [1, 2, 3])])
def test_streaming_equals_one_block_causal_forward(causal2, cond, chunk_size, sizes):
    """Chunk by chunk with store_kv=True (same latents, same per-frame timesteps) = one full forward,
    also when a call covers several chunks or the video ends inside a chunk."""
    model = causal2 if chunk_size == 2 else _causal(chunk_size)
    frames = sum(sizes)
    video = _video(frames, seed=1)
    t = torch.tensor([[0.0, 0.0, 0.0, 250.0, 600.0, 950.0], [10.0, 20.0, 30.0, 400.0, 700.0, 1000.0]])[:, :frames]
    with torch.no_grad():
        full = model.predict_noise(video, t, cond)
        streamed = _stream(model, video, t, cond, sizes)
    assert (streamed - full).abs().max().item() <= 1e-5


def test_streaming_with_per_sample_timesteps_and_unconditional(causal2, cond):
    """[B] timesteps per call = per-frame timesteps constant within the chunk; conditional=False uses
    the negative embeddings on both paths."""
    video = _video(4, seed=2)
    t_chunks = [torch.tensor([0.0, 0.0]), torch.tensor([500.0, 700.0])]
    per_frame = torch.cat([tc[:, None].expand(-1, 2) for tc in t_chunks], dim=1)
    with torch.no_grad():
        full = causal2.predict_noise(video, per_frame, cond, conditional=False)
        causal2.clear_caches()
        first = causal2.predict_noise_streaming(video[:, :, :2], t_chunks[0], cond, cache_tag="neg", store_kv=True,
                                                cur_start_frame=0, conditional=False)
        second = causal2.predict_noise_streaming(video[:, :, 2:], t_chunks[1], cond, cache_tag="neg", store_kv=False,
                                                 cur_start_frame=2, conditional=False)
        causal2.clear_caches()
    torch.testing.assert_close(torch.cat([first, second], dim=2), full, rtol=0, atol=1e-5)


def test_one_chunk_is_the_bidirectional_model(cond, bidirectional):
    model = _causal(6)
    video = _video(5, seed=3)
    t = torch.tensor([[0.0, 200.0, 400.0, 600.0, 800.0], [900.0, 100.0, 0.0, 0.0, 50.0]])
    with torch.no_grad():
        assert torch.equal(model.predict_noise(video, t, cond), bidirectional.predict_noise(video, t, cond))
        assert torch.equal(model.predict_noise(video, t[:, 0], cond), bidirectional.predict_noise(video, t[:, 0], cond))


def test_streaming_bookkeeping(causal2, cond):
    assert isinstance(causal2, CausalModelBase) and causal2.chunk_size == 2
    video, t = _video(4, seed=4), torch.tensor([700.0, 700.0])
    causal2.clear_caches()
    with torch.no_grad():
        causal2.predict_noise_streaming(video[:, :, :2], torch.zeros(2), cond, cache_tag="pos", store_kv=True, cur_start_frame=0)
        assert causal2.cached_frames("pos") == 2 and causal2.cached_frames("neg") == 0
        with pytest.raises(ValueError, match="holds 2 frames"):
            causal2.predict_noise_streaming(video[:, :, 2:], t, cond, cache_tag="pos", store_kv=False, cur_start_frame=0)
        with pytest.raises(ValueError, match="inside a chunk"):
            causal2.predict_noise_streaming(video[:, :, :1], t, cond, cache_tag="odd", store_kv=True, cur_start_frame=0)
            causal2.predict_noise_streaming(video[:, :, 1:2], t, cond, cache_tag="odd", store_kv=True, cur_start_frame=1)
        with pytest.raises(ValueError, match="holds 0 frames"):
            causal2.predict_noise_streaming(video[:, :, 2:], t, cond, cache_tag="neg", store_kv=False, cur_start_frame=2)
        with pytest.raises(ValueError, match="batch"):
            causal2.predict_noise_streaming(video[:1, :, 2:], t[:1], cond, cache_tag="pos", store_kv=False, cur_start_frame=2)
        a = causal2.predict_noise_streaming(video[:, :, 2:], t, cond, cache_tag="pos", store_kv=False, cur_start_frame=2)
        assert causal2.cached_frames("pos") == 2  # store_kv=False leaves the cache
        b = causal2.predict_noise_streaming(video[:, :, 2:], t, cond, cache_tag="pos", store_kv=False, cur_start_frame=2)
        assert torch.equal(a, b)
        x0 = causal2.predict_x0_streaming(video[:, :, 2:], t, cond, cache_tag="pos", store_kv=False, cur_start_frame=2)
        torch.testing.assert_close(x0, video[:, :, 2:] - 0.7 * a)
        # a second tag holding other context gives another answer; the first tag is untouched
        causal2.predict_noise_streaming(video[:, :, :2] + 1, torch.zeros(2), cond, cache_tag="other", store_kv=True, cur_start_frame=0)
        c = causal2.predict_noise_streaming(video[:, :, 2:], t, cond, cache_tag="other", store_kv=False, cur_start_frame=2)
        assert not torch.allclose(a, c)
        assert torch.equal(a, causal2.predict_noise_streaming(video[:, :, 2:], t, cond, cache_tag="pos", store_kv=False, cur_start_frame=2))
        causal2.clear_caches("pos")
        assert causal2.cached_frames("pos") == 0 and causal2.cached_frames("other") == 2 and causal2.cached_frames("odd") == 1
        causal2.clear_caches()
        assert causal2.cached_frames("other") == 0


def _streaming_grad(cond: Conditioning, checkpointing: bool | float) -> torch.Tensor:
    """Under grad mode a streaming call backpropagates into the weights and its input latents (the
    cache itself is detached context); activation checkpointing (every block: True; a share: a
    fraction) recomputes with the same cache."""
    from distillery.components.activation_checkpoint import checkpoint_blocks

    model = _causal(2, trainable=True)
    if checkpointing is True:
        model.enable_activation_checkpointing()
    elif checkpointing:
        assert 0 < len(checkpoint_blocks(model.shardable_blocks(), checkpointing)) < len(model.shardable_blocks())
    video = _video(4, seed=5)
    with torch.no_grad():
        model.predict_noise_streaming(video[:, :, :2], torch.zeros(2), cond, cache_tag="pos", store_kv=True, cur_start_frame=0)
    chunk = video[:, :, 2:].clone().requires_grad_(True)
    v = model.predict_noise_streaming(chunk, torch.full((2,), 600.0), cond, cache_tag="pos", store_kv=True, cur_start_frame=2)
    assert v.requires_grad and model.cached_frames("pos") == 4
    v.square().mean().backward()
    q_grad = model.transformer.blocks[0].attn1.to_q.weight.grad
    assert chunk.grad is not None and chunk.grad.abs().sum() > 0
    assert q_grad is not None and q_grad.abs().sum() > 0
    with torch.no_grad():  # the cache written under grad equals the one written without
        full = model.predict_noise(video, torch.tensor([[0.0, 0.0, 600.0, 600.0]] * 2), cond)
    torch.testing.assert_close(v.detach(), full[:, :, 2:], rtol=0, atol=1e-5)
    model.clear_caches()
    return q_grad.clone()


def test_gradients_flow_through_streaming_also_with_activation_checkpointing(cond):
    grads = [_streaming_grad(cond, flag) for flag in (False, True, 0.5)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[0], grads[2], rtol=1e-5, atol=1e-7)


def test_same_weights_and_layout_as_stock_wan(causal2, bidirectional, tmp_path):
    from diffusers import WanTransformer3DModel

    assert causal2.transformer_config() == bidirectional.transformer_config()
    ours, stock = causal2.transformer.state_dict(), bidirectional.transformer.state_dict()
    assert list(ours) == list(stock) and all(torch.equal(ours[k], stock[k]) for k in ours)
    causal2.transformer.save_pretrained(tmp_path / "transformer")
    WanTransformer3DModel.from_pretrained(tmp_path / "transformer")  # stock diffusers loads what it exports


def test_a_deep_copied_compute_module_keeps_the_causal_attention(cond):
    """The bf16 compute copy is a deepcopy of the master: processors and the rope hook travel with it."""
    from distillery.components.precision import ComputeCopy

    model = _causal(2)
    video, t = _video(4, seed=6), torch.tensor([[0.0, 0.0, 500.0, 500.0]] * 2)
    with torch.no_grad():
        want = model.predict_noise(video, t, cond)
        model.bind_device(torch.device("cpu"), torch.float32, ComputeCopy(model.transformer, torch.float32, torch.device("cpu")))
        assert model.forward_module is not model.transformer
        assert torch.equal(model.predict_noise(video, t, cond), want)
        assert (_stream(model, video, t, cond, [2, 2]) - want).abs().max() <= 1e-5
    copied = copy.deepcopy(model.transformer)
    assert type(copied.blocks[0].attn1.processor).__name__ == "CausalWanAttnProcessor"


# --- the causal_streaming sampler ---------------------------------------------------------------

CONTRACT = {"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 700.0, 300.0]}


def test_sampler_equals_the_streaming_loop_written_with_full_forwards(causal2, cond):
    """ODE re-noise (no draws after the initial noise): each chunk denoised through the step list
    against its clean predecessors = full block-causal forwards over [finished chunks at t=0 ⊕ chunk]."""
    sampler = build_sampler({**CONTRACT, "renoise": "ode", "chunk_size": 2})
    initial = _video(5, seed=7)
    with torch.no_grad():
        out = sampler.sample(causal2, cond, (C, 5, H, W), None, initial=initial)
        done = torch.zeros(2, C, 0, H, W)
        for start in range(0, 5, 2):
            x = initial[:, :, start:start + 2]
            f = x.shape[2]
            for k, t in enumerate(CONTRACT["timesteps"]):
                per_frame = torch.tensor([0.0] * start + [t] * f).expand(2, -1)
                v = causal2.predict_noise(torch.cat([done, x], dim=2), per_frame, cond)[:, :, start:]
                sigma = t / 1000
                x0 = x - sigma * v
                if k + 1 < 3:
                    nxt = CONTRACT["timesteps"][k + 1] / 1000
                    x = (1 - nxt) * x0 + nxt * (x0 + v)
            done = torch.cat([done, x0], dim=2)
    assert out.shape == (2, C, 5, H, W)
    torch.testing.assert_close(out, done, rtol=0, atol=1e-4)
    assert causal2.cached_frames("cond") == 0  # the sampler leaves no cache behind


def test_sampler_with_one_chunk_is_few_step_x0(cond, bidirectional):
    """One chunk covering the video: the streaming sampler is the few-step x0/re-noise sampler (same draws)."""
    model = _causal(4)
    streaming = build_sampler(CONTRACT)
    few = build_sampler({**CONTRACT, "sampler": "few_step_x0"})
    with torch.no_grad():
        a = streaming.sample(model, cond, (C, 3, H, W), torch.Generator().manual_seed(1), guidance_scale=3.0)
        b = few.sample(bidirectional, cond, (C, 3, H, W), torch.Generator().manual_seed(1), guidance_scale=3.0)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_sampler_cfg_context_noise_and_nfe(causal2, cond):
    sampler = build_sampler({**CONTRACT, "chunk_size": 2, "context_noise": 100.0, "guidance_scale": 4.0})
    calls = []
    handle = causal2.transformer.register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            a = sampler.sample(causal2, cond, (C, 6, H, W), torch.Generator().manual_seed(0))
            b = sampler.sample(causal2, cond, (C, 6, H, W), torch.Generator().manual_seed(0))
            clean = build_sampler({**CONTRACT, "chunk_size": 2, "guidance_scale": 4.0}).sample(
                causal2, cond, (C, 6, H, W), torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    assert torch.equal(a, b) and torch.isfinite(a).all()
    torch.testing.assert_close(a[:, :, :2], clean[:, :, :2])  # chunk 0 sees no context either way
    assert not torch.allclose(a[:, :, 2:], clean[:, :, 2:])  # later chunks see noised context
    # 3 chunks × 3 steps + 2 context writes, conditional and unconditional: 22 forwards per sample call
    assert len(calls) == 3 * 22 and sampler.nfe(num_frames=6) == 22 and sampler.nfe(num_frames=6, guidance_scale=1.0) == 11
    assert causal2.cached_frames("cond") == 0 and causal2.cached_frames("uncond") == 0


def test_sampler_contract_errors(causal2, bidirectional, cond):
    with pytest.raises(UserError, match="needs a causal model"):
        build_sampler(CONTRACT).sample(bidirectional, cond, (C, 2, H, W), None)
    with pytest.raises(UserError, match="chunk_size 3 differs from the model's 2"):
        build_sampler({**CONTRACT, "chunk_size": 3}).sample(causal2, cond, (C, 2, H, W), None)
    with pytest.raises(UserError, match="context_noise"):
        build_sampler({**CONTRACT, "context_noise": 1000})
    with pytest.raises(UserError, match="renoise"):
        build_sampler({**CONTRACT, "renoise": "heun"})
    with pytest.raises(UserError, match="descending"):
        build_sampler({**CONTRACT, "timesteps": [100, 500]})
    with pytest.raises(UserError, match="chunk_size"):
        build_sampler({**CONTRACT, "chunk_size": 0})


def test_the_plan_survives_fsdp_input_casting(cond):
    """FSDP2 casts each sharded block's inputs with ``_apply_to_tensors`` (bf16 mixed precision): the
    rotary tuple is rebuilt, but it still carries the same plan (and the store the model reads)."""
    from torch.distributed.utils import _apply_to_tensors

    from distillery.models.wan.causal import _AttentionPlan, _PlannedRotary

    plan = _AttentionPlan(2, 4, 0, 2, store={})
    rotary = _PlannedRotary(torch.ones(1, 8, 1, 32), torch.zeros(1, 8, 1, 32), plan)
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16), (torch.ones(2), rotary))[1]
    assert isinstance(cast, _PlannedRotary) and cast.plan is plan and cast.plan.store is plan.store
    assert cast.freqs_cos.dtype == torch.bfloat16


def test_a_causal_dfsft_student_samples_causally_and_plain_folders_load_causal(causal2, tmp_path):
    """DFSFT on a causal student declares Euler under the block-causal mask (``chunk_size`` in the
    contract) and refuses a noise chunk that differs from the attention chunk; the contract's
    ``model_options`` make validate/export load a plain folder as the causal model it is, and the
    samplers refuse a model that is not causal or has other chunks."""
    from pathlib import Path

    from helpers import run_config

    from distillery.config import allowed_prefixes, load_run_config
    from distillery.methods.dfsft import DFSFTConfig, DFSFTMethod
    from distillery.models.wan import load_inference_model

    base = shipped_tiny_base()
    training = load_run_config(raw=run_config(base, tmp_path, Path("unused")), prefixes=allowed_prefixes()).training
    student = _causal(2, trainable=True)
    contract = DFSFTMethod(DFSFTConfig(chunk_size=2), {"student": student}, training).sampling_contract()
    assert contract == {"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000, "chunk_size": 2}
    with pytest.raises(UserError, match="method.chunk_size 3 differs from models.student.chunk_size 2"):
        DFSFTMethod(DFSFTConfig(chunk_size=3), {"student": student}, training)
    bidirectional = WanModel(WanModelConfig(init_from=str(base)), "student")
    assert "chunk_size" not in DFSFTMethod(DFSFTConfig(chunk_size=3), {"student": bidirectional}, training).sampling_contract()

    euler = build_sampler(contract)
    streaming = build_sampler({**contract, "sampler": "causal_streaming"})
    assert euler.model_options() == streaming.model_options() == {"chunk_size": 2}
    assert build_sampler({"sampler": "euler"}).model_options() == {}
    loaded = load_inference_model(base, **euler.model_options())
    assert isinstance(loaded, CausalWanModel) and loaded.chunk_size == 2 and not loaded.transformer.training
    with pytest.raises(UserError, match="names no chunk_size"):
        build_sampler({"sampler": "causal_streaming"}).model_options()
    cond = Conditioning(torch.randn(1, 6, 32))
    x = torch.randn(1, C, 5, H, W)
    t = torch.full((1,), 500.0)
    with torch.no_grad():  # the same weights, the same block-causal forward as the fixture's model
        torch.testing.assert_close(loaded.predict_noise(x, t, cond), causal2.predict_noise(x, t, cond))
    for sampler in (euler, streaming):
        with pytest.raises(UserError, match="needs a causal model"):
            sampler.sample(bidirectional, cond, (C, 5, H, W), torch.Generator().manual_seed(0), num_steps=2)
        with pytest.raises(UserError, match="chunk_size 2 differs from the model's 3"):
            sampler.sample(_causal(3), cond, (C, 5, H, W), torch.Generator().manual_seed(0), num_steps=2)
    assert euler.nfe(num_steps=40, num_frames=5) == 40  # one full-sequence forward per step
    assert streaming.nfe(num_steps=40, num_frames=5) == 3 * 40 + 2  # 3 chunks of 2, 2, 1 frames + 2 cache writes


@pytest.mark.process
def test_streaming_with_each_block_compiled_samples_what_eager_does(cond):
    """validate's ``compile`` on a causal student: each block compiled by Inductor (CPU here), the streaming
    sampler's KV-cache forwards (growing context, CFG) give the eager latents up to rounding and leave no cache."""
    from torch._dynamo.utils import counters

    sampler = build_sampler({**CONTRACT, "chunk_size": 2, "guidance_scale": 4.0})
    eager, compiled = _causal(2), _causal(2)
    for block in compiled.shardable_blocks():
        block.compile()
    counters.clear()
    with torch.no_grad():
        a = sampler.sample(eager, cond, (C, 6, H, W), torch.Generator().manual_seed(0))
        b = sampler.sample(compiled, cond, (C, 6, H, W), torch.Generator().manual_seed(0))
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert compiled.cached_frames("cond") == 0 and compiled.cached_frames("uncond") == 0
