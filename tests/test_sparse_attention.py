"""Trained block-sparse video attention (models/wan/sparse_attention.py, models/wan/sparse.py; issue 64).

What the CPU can show (the FA4 kernel needs a Hopper GPU: ``bench/export_latency.py`` runs it there):

- the torch path — tiles laid out with padding (as FA4 reads them, more slots than tokens, or the tile's volume), the
  coarse selection, each query tile's kept key tiles gathered and attended — equals a dense masked reference written
  independently in raster order, values and gradients, bidirectional, block-causal and streaming; the block lists FA4
  reads (forward, and transposed for its backward) let through exactly what the selection kept;
- sparsity 0 is dense attention (block-causal: the block-causal attention), and a sparsity that drops whole tiles
  changes the output;
- the coarse stage keeps, per query tile, the key tiles of highest pooled score; what trains gets gradients;
- the FA4 mask of a ragged tile's pads (:func:`slot_holds_token`, the CuTe ``mask_mod``'s arithmetic) marks exactly
  the slots that hold no token; the custom ops' fake implementations give the kernels' shapes;
- the Wan plugins: ``attention: sparse`` at sparsity 0 is the dense model, the causal plugin streams chunk by chunk
  what its block-causal forward gives, the spec is recorded in the config and read back (``attention: auto``), and
  settings that cannot work are one-line user errors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from distillery.common.errors import UserError
from distillery.models.base import Conditioning
from distillery.models.wan import CausalWanModel, CausalWanModelConfig, WanModel, WanModelConfig
from distillery.models.wan import sparse_attention as sa
from distillery.tinybase.shipped import shipped_tiny_base

GRID = (4, 5, 7)  # frames, rows, columns: ragged tiles in every direction for the tiles below


def _qkv(grid=GRID, batch=2, heads=3, dim=8, seed=0, q_frames=None, grad=False):
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    lq = (q_frames if q_frames is not None else t) * h * w
    q = torch.randn(batch, lq, heads, dim, generator=g)
    k, v = (torch.randn(batch, t * h * w, heads, dim, generator=g) for _ in range(2))
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


CASES = [  # (tile, sparsity, causal, q_start)
    ((1, 2, 3), 0.5, None, 0),
    ((2, 2, 2), 0.7, None, 0),
    ((1, 2, 3), 0.6, sa.Causal(2), 0),
    ((2, 3, 4), 0.5, sa.Causal(2), 0),
    ((1, 2, 3), 0.6, sa.Causal(2), 2),  # streaming: the last chunk's queries over the cached frames and their own
    ((1, 2, 3), 0.5, sa.Causal(2, lead=1), 1),  # the given frame 0 a block of its own
]


@pytest.mark.parametrize("padded", [False, True])  # a tile's slots: its volume (CPU), or more than it holds (as FA4's 128)
@pytest.mark.parametrize("tile,sparsity,causal,q_start", CASES)
def test_the_sparse_path_equals_the_dense_masked_reference(tile, sparsity, causal, q_start, padded):
    capacity = math.prod(tile) + 5 if padded else None
    q, k, v = _qkv(q_frames=GRID[0] - q_start, grad=True)
    spec = sa.SparseSpec(sparsity, tile)
    out = sa.video_sparse_attention(q, k, v, spec, GRID, q_start=q_start, causal=causal, capacity=capacity)
    ref = sa.masked_reference(q, k, v, spec, GRID, q_start=q_start, causal=causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-6)
        assert a.abs().sum() > 0  # q, k and v are what trains: each gets a gradient


def _sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask).transpose(1, 2)


def test_sparsity_zero_is_dense_attention_and_block_causal_attention():
    q, k, v = _qkv()
    for tile in ((1, 2, 3), (2, 2, 2), (4, 5, 7)):
        out = sa.video_sparse_attention(q, k, v, sa.SparseSpec(0.0, tile), GRID)
        torch.testing.assert_close(out, _sdpa(q, k, v), rtol=0, atol=2e-6)
    t, h, w = GRID
    frame = torch.arange(t * h * w) // (h * w)
    block_causal = (frame[None, :] // 2) <= (frame[:, None] // 2)
    out = sa.video_sparse_attention(q, k, v, sa.SparseSpec(0.0, (1, 2, 3)), GRID, causal=sa.Causal(2))
    torch.testing.assert_close(out, _sdpa(q, k, v, block_causal), rtol=0, atol=2e-6)


def test_a_sparsity_that_drops_whole_tiles_changes_the_output():
    q, k, v = _qkv()
    lay = sa.layout(GRID, (1, 2, 3), 6, torch.device("cpu"))
    assert lay.blocks == 4 * 3 * 3 and sa.keep_count(0.75, lay.blocks) == 9  # each query tile reads 9 of 36 key tiles
    out = sa.video_sparse_attention(q, k, v, sa.SparseSpec(0.75, (1, 2, 3)), GRID)
    assert (out - _sdpa(q, k, v)).abs().max() > 1e-2


def test_the_coarse_stage_keeps_the_key_tiles_of_highest_pooled_score():
    q, k, _ = _qkv(seed=1)
    lay = sa.layout(GRID, (1, 2, 3), 6, torch.device("cpu"))
    allowed = sa.allowed_tiles(lay, lay, 0, None)
    sel = sa.select_tiles(q, k, lay, lay, allowed, 0.75)
    scores = torch.einsum("bqhd,bkhd->bhqk", sa.tile_means(q, lay), sa.tile_means(k, lay))
    keep = int(sel.count[0])
    best = scores.topk(keep, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(sel.idx, best)
    means = sa.tile_means(q, lay)  # a tile's mean counts only its tokens (a ragged tile has fewer)
    tokens = sa.to_tiles(q, lay).view(2, lay.blocks, 6, 3, 8)
    assert torch.allclose(means[:, 6], tokens[:, 6, :3].mean(1))  # frame 0's 7th tile: row 4, columns 0–2 (3 of 6 slots)


def test_keep_counts_and_the_causal_rule():
    assert [sa.keep_count(s, 10) for s in (0.0, 0.5, 0.9, 0.95, 0.999)] == [10, 5, 1, 1, 1]
    assert sa.keep_count(0.7, 3) == 1 and sa.keep_count(0.0, 3) == 3
    lay = sa.layout((4, 2, 2), (1, 2, 2), 4, torch.device("cpu"))  # one tile a frame
    allowed = sa.allowed_tiles(lay, lay, 0, sa.Causal(2))
    assert allowed.tolist() == [[True, True, False, False]] * 2 + [[True] * 4] * 2
    lead = sa.allowed_tiles(lay, lay, 0, sa.Causal(2, lead=1))
    assert lead.tolist() == [[True, False, False, False], [True, True, True, False], [True, True, True, False], [True] * 4]
    assert sa.causal_problem((2, 4, 4), 3, 0) and sa.causal_problem((3, 4, 4), 3, 1) and sa.causal_problem((3, 4, 4), 3, 0) is None


def test_backward_lists_are_the_forward_lists_transposed():
    q, k, _ = _qkv(seed=2)
    q_lay = k_lay = sa.layout(GRID, (1, 2, 3), 16, torch.device("cpu"))
    sel = sa.select_tiles(q, k, q_lay, k_lay, sa.allowed_tiles(q_lay, k_lay, 0, sa.Causal(2)), 0.6)
    fwd = sa.lists_mask(sa.forward_lists(sel, k_lay.complete), q_lay, k_lay)
    bwd = sa.lists_mask(sa.backward_lists(sel, k_lay.complete), q_lay, k_lay, transpose=True)
    assert torch.equal(fwd, bwd)
    kept = sa.selected_map(sel, k_lay.blocks)  # what FA4 lets through is what the selection kept, pads masked
    holds = (k_lay.slot_token >= 0).view(k_lay.blocks, 16)
    want = (kept[..., :, None] & holds[None, None, None]).flatten(-2).repeat_interleave(16, dim=-2)
    assert torch.equal(fwd, want)
    lists = sa.forward_lists(sel, k_lay.complete)  # FA4's: full blocks need no mask, every ragged tile is partial
    assert not k_lay.complete.any()  # 16 slots hold at most 6 tokens: every block is partial
    assert int(lists.full_cnt.sum()) == 0 and torch.equal(lists.mask_cnt.long(), sel.count.expand_as(lists.mask_cnt))


@pytest.mark.parametrize("grid,tile,capacity", [((4, 5, 7), (1, 2, 3), 6), ((5, 5, 7), (2, 2, 3), 128),
                                                ((21, 30, 52), (1, 16, 8), 128), ((3, 30, 52), (3, 4, 8), 128)])
def test_the_pad_mask_marks_exactly_the_slots_without_a_token(grid, tile, capacity):
    lay = sa.layout(grid, tile, capacity, torch.device("cpu"))
    slots = torch.arange(lay.blocks * capacity)
    assert torch.equal(sa.slot_holds_token(slots, sa.key_layout_of(lay), int), lay.slot_token >= 0)
    assert torch.equal(sa.from_tiles(sa.to_tiles(torch.arange(math.prod(grid))[None, :, None, None], lay), lay).flatten(),
                       torch.arange(math.prod(grid)))


def test_the_real_shape_layout():
    lay = sa.layout((21, 30, 52), sa.DEFAULT_TILE, 128, torch.device("cpu"))
    assert lay.blocks == 294 and lay.counts == (21, 2, 7)
    assert abs(1 - 21 * 30 * 52 / (294 * 128) - 0.13) < 0.01  # 13% of the slots are padding
    assert sa.key_layout_of(lay)[0] == sa.NO_FRAME_BOUND  # whole in time: one FA4 kernel for every frame count


def test_the_fa4_ops_fake_implementations_give_the_kernels_shapes():
    sa._define_ops()
    sa._define_ops()  # once per process, whichever copy of the module asks
    q = torch.empty(1, 256, 2, 8, device="meta", dtype=torch.bfloat16)
    cnt, idx = torch.empty(1, 2, 2, dtype=torch.int32, device="meta"), torch.empty(1, 2, 2, 1, dtype=torch.int32, device="meta")
    out, lse = torch.ops.distillery_sparse.fa4_block_sparse(q, q, q, cnt, idx, cnt, idx, [0] * 9)
    assert out.shape == q.shape and lse.shape == (1, 2, 256) and lse.dtype == torch.float32
    dq, dk, dv = torch.ops.distillery_sparse.fa4_block_sparse_backward(q, q, q, q, q, lse, cnt, idx, cnt, idx, [0] * 9)
    assert dq.shape == dk.shape == dv.shape == q.shape


def test_settings_that_cannot_work_are_refused():
    assert sa.spec_problem(1.0, [1, 2, 2]) and sa.spec_problem(0.5, [1, 2]) and sa.spec_problem(0.5, [1, 0, 2])
    assert sa.spec_problem(0.5, [1, 16, 8]) is None
    with pytest.raises(ValueError, match="_sparse_attention"):
        sa.read_record({"_sparse_attention": {"sparsity": 0.5}})
    assert sa.read_record({}) is None and sa.read_record({"_sparse_attention": None}) is None
    assert sa.read_record({"_sparse_attention": {"sparsity": 0.5, "tile": [1, 2, 2]}}) == sa.SparseSpec(0.5, (1, 2, 2))


# -- the Wan plugins ---------------------------------------------------------------------------------------------------
C, LATENT = 8, (5, 8, 8)  # tiny base: z_dim 8; patch (1, 2, 2): a 5 × 4 × 4 token grid


def _wan(cls=WanModel, cfg=WanModelConfig, **kw):
    model = cls(cfg(init_from=str(shipped_tiny_base()), trainable=kw.pop("trainable", False), **kw), role="student")
    model.transformer.eval()
    return model


@pytest.fixture(scope="module")
def cond() -> Conditioning:
    return Conditioning(torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3)))


def _latents(frames=LATENT[0], seed=0):
    return torch.randn(2, C, frames, *LATENT[1:], generator=torch.Generator().manual_seed(seed))


def test_a_sparse_wan_at_sparsity_zero_is_the_dense_wan_and_drops_tiles_above(cond):
    x, t = _latents(), torch.tensor([500.0, 200.0])
    dense = _wan()
    with torch.no_grad():
        want = dense.predict_noise(x, t, cond)
        got = _wan(attention="sparse", sparsity=0.0, sparse_tile=[1, 2, 2]).predict_noise(x, t, cond)
        sparse = _wan(attention="sparse", sparsity=0.75, sparse_tile=[1, 2, 2]).predict_noise(x, t, cond)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (sparse - want).abs().max() > 1e-3


def test_gradients_reach_the_attention_weights_through_the_sparse_path(cond):
    model = _wan(attention="sparse", sparsity=0.5, sparse_tile=[1, 2, 2], trainable=True)
    model.predict_noise(_latents(), torch.tensor([500.0, 200.0]), cond).square().mean().backward()
    for name in ("to_q", "to_k", "to_v"):
        grad = getattr(model.transformer.blocks[0].attn1, name).weight.grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_the_causal_sparse_wan_streams_what_its_block_causal_forward_gives(cond):
    model = _wan(CausalWanModel, CausalWanModelConfig, attention="sparse", sparsity=0.5, sparse_tile=[1, 2, 2], chunk_size=2)
    x = _latents()
    t = torch.rand(2, x.shape[2], generator=torch.Generator().manual_seed(1)) * 1000
    with torch.no_grad():
        whole = model.predict_noise(x, t, cond)
        parts, start = [], 0
        for f in (2, 2, 1):
            parts.append(model.predict_noise_streaming(x[:, :, start:start + f], t[:, start:start + f], cond, cache_tag="c",
                                                       store_kv=True, cur_start_frame=start))
            start += f
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=0, atol=1e-5)
    dense = _wan(CausalWanModel, CausalWanModelConfig, chunk_size=2)
    with torch.no_grad():
        assert (dense.predict_noise(x, t, cond) - whole).abs().max() > 1e-3


def test_the_spec_is_recorded_and_read_back_by_auto(tmp_path, cond):
    model = _wan(attention="sparse", sparsity=0.75, sparse_tile=[1, 2, 2])
    assert model.transformer.config[sa.RECORD_KEY] == {"sparsity": 0.75, "tile": [1, 2, 2]}
    model.transformer.save_pretrained(tmp_path / "transformer")
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text((shipped_tiny_base() / "scheduler" / "scheduler_config.json").read_text())
    again = WanModel(WanModelConfig(init_from=str(tmp_path), trainable=False), role="validate")  # attention: auto
    assert again.sparse == sa.SparseSpec(0.75, (1, 2, 2))
    x, t = _latents(), torch.tensor([500.0, 200.0])
    with torch.no_grad():
        torch.testing.assert_close(again.predict_noise(x, t, cond), model.predict_noise(x, t, cond), rtol=0, atol=0)
    dense = WanModel(WanModelConfig(init_from=str(tmp_path), trainable=False, attention="dense"), role="critic")
    assert dense.sparse is None and dense.transformer.config[sa.RECORD_KEY] is None  # its own checkpoints say dense


def test_a_tile_that_straddles_chunks_and_bad_settings_are_one_line_errors():
    with pytest.raises(UserError, match=r"models.student: sparse_tile \[2, 2, 2\]: a tile of 2 frames straddles chunks of 3"):
        _wan(CausalWanModel, CausalWanModelConfig, attention="sparse", sparse_tile=[2, 2, 2], chunk_size=3)
    with pytest.raises(UserError, match=r"models.student: the tile must be 3 integers"):
        _wan(attention="sparse", sparse_tile=[2, 2])


def test_the_shipped_module_s_default_tile_is_the_configs():
    """The export ships sparse_attention.py importing nothing of distillery: its default tile is its own, held equal
    to the one the run config and params.yaml declare."""
    from distillery.config.attention import DEFAULT_TILE

    assert sa.DEFAULT_TILE == DEFAULT_TILE
