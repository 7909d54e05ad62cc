"""Attention backends of the Wan plugins (models/wan/attention.py, issue 24: FlashAttention-4 on Hopper).

What can be shown without a GPU:

- ``auto`` resolves to SDPA (``native``) without CUDA and without ``flash_attn.cute``, and then nothing changes:
  the processors stay diffusers' own and a forward is bitwise the one of before; an explicit ``fa4`` that cannot run
  is a one-line user error;
- the custom op ``distillery::fa4_attention`` keeps whole under ``torch.compile`` (one node forward, its backward op
  in the backward graph, no graph break), with the fake implementation's shapes and dtypes, on meta tensors —
  also inside a compiled Wan block routed to FA4;
- the block lists (which kv tiles each q tile attends fully, partially, not at all) equal the dense block-causal
  mask, and attention computed tile by tile over them (the op's CPU kernel) equals masked SDPA in fp32, values and
  gradients, eager and compiled; the causal Wan's two FA4 layouts (per-chunk prefix calls, one block-sparse call)
  reduce to the same numbers as its SDPA path, with and without a KV cache;
- ``compile_mode`` compiles each block (``blocks``) or the whole forward module (``model``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from distillery.common.errors import UserError
from distillery.models.wan import WanModel, WanModelConfig
from distillery.models.wan.attention import (
    FA4_TILE,
    FULL,
    PARTIAL,
    SKIP,
    FA4WanAttnProcessor,
    block_causal_mask,
    block_lists,
    fa4_attention,
    fa4_import_problem,
    install_attention_backend,
    lists_mask,
    reference_attention,
    reference_attention_backward,
    resolve_attention_backend,
    tile_kinds,
)
from distillery.tinybase.shipped import shipped_tiny_base

FA4_INSTALLED = importlib.util.find_spec("flash_attn") is not None and fa4_import_problem() is None


def _sdpa(q, k, v, mask=None):
    """Reference: torch SDPA (math in the inputs' dtype) on the processor layout ``[B, L, heads, D]``."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask).transpose(1, 2)


def _tiny_wan(trainable: bool = False) -> WanModel:
    model = WanModel(WanModelConfig(init_from=str(shipped_tiny_base()), trainable=trainable), role="student")
    model.transformer.eval()
    return model


# -- choosing the backend ---------------------------------------------------------------------------------
def test_auto_picks_sdpa_without_cuda_and_without_the_package():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from distillery.config.schema import ModelRuntimeConfig

    assert ModelRuntimeConfig().attention_backend == "auto"  # the default
    for dtype in (torch.bfloat16, torch.float32):
        assert resolve_attention_backend("auto", "cpu", dtype) == "native"
    assert resolve_attention_backend("auto", "cuda", torch.float32) == "native"  # FA4 computes in bf16/fp16 only
    if not FA4_INSTALLED:  # without the package: never FA4, and CUDA is not even asked (this torch has none)
        assert "pip install -e \".[gpu]\"" in fa4_import_problem()
        assert resolve_attention_backend("auto", torch.device("cuda"), torch.bfloat16) == "native"
        with pytest.raises(UserError, match=r"attention_backend: fa4 flash_attn.cute does not import"):
            resolve_attention_backend("fa4", "cuda", torch.bfloat16)
    with pytest.raises(UserError, match="attention_backend: fa4_sparse needs a CUDA device"):
        resolve_attention_backend("fa4_sparse", "cpu", torch.bfloat16)
    with pytest.raises(UserError, match="not one of"):
        resolve_attention_backend("fa5", "cpu", torch.bfloat16)

    model = _tiny_wan()
    model.set_attention_backend("auto", "cpu", torch.float32)
    assert model.attention_backend == "native"
    assert all(type(b.attn1.processor) is WanAttnProcessor and b.attn1.processor._attention_backend is None
               for b in model.transformer.blocks)  # untouched: the SDPA path of before

    from distillery.models.wan import load_inference_model

    plugin = load_inference_model(shipped_tiny_base(), "cpu")  # validate and the exported pipeline: the same rule
    assert plugin.attention_backend == "native"
    assert all(type(b.attn1.processor) is WanAttnProcessor for b in plugin.transformer.blocks)


def test_a_cpu_training_run_refuses_fa4(tmp_path, tiny_base, latent_set):
    from helpers import run_config, train_in_process

    cfg = run_config(tiny_base, latent_set, tmp_path / "run", steps=1)
    cfg["training"]["model"] = {"attention_backend": "fa4"}
    cfg["training"]["distributed"] = {"device": "cpu"}
    with pytest.raises(UserError, match="attention_backend: fa4 needs a CUDA device; use native"):
        train_in_process(cfg)


def test_fa4_processors_on_cpu_fall_back_to_sdpa_bitwise():
    """Routed to FA4, a CPU fp32 forward still runs SDPA (the op takes CUDA bf16/fp16): bitwise the native output;
    switching back restores the dispatch of before."""
    model = _tiny_wan()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 3, 4, 4, generator=g)
    text = torch.randn(1, 6, 32, generator=g)
    t = torch.tensor([500.0])

    def forward():
        with torch.no_grad():
            return model.transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    before = forward()
    install_attention_backend(model.transformer, "fa4")
    assert all(isinstance(b.attn1.processor, FA4WanAttnProcessor) and b.attn1.processor.fa4_mode == "prefix"
               for b in model.transformer.blocks)
    assert torch.equal(forward(), before)
    install_attention_backend(model.transformer, "native")
    assert all(b.attn1.processor.fa4_mode is None for b in model.transformer.blocks)
    assert torch.equal(forward(), before)


# -- the custom op under torch.compile --------------------------------------------------------------------
def _capturing_backend(graphs: dict):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def capture(name):
        def compiler(gm, example_inputs):
            graphs.setdefault(name, []).append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.process
@pytest.mark.parametrize("chunk_tokens,q_offset", [(0, 0), (96, 0), (64, 128)])
def test_fake_implementation_under_torch_compile_on_meta_tensors(chunk_tokens, q_offset):
    torch._dynamo.reset()
    graphs: dict = {}
    q = torch.randn(2, 300, 4, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 300 + q_offset, 4, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    @torch.compile(backend=_capturing_backend(graphs), fullgraph=True)
    def attend(q, k, v):
        return fa4_attention(q * 2, k, v, chunk_tokens, q_offset)

    out = attend(q, k, v)
    assert (out.shape, out.dtype, out.device.type) == ((2, 300, 4, 64), torch.bfloat16, "meta")
    out.float().sum().backward()
    for t in (q, k, v):
        assert (t.grad.shape, t.grad.dtype) == (t.shape, torch.bfloat16)
    forward, backward = graphs["forward"][0], graphs["backward"][0]
    assert _targets(forward).count("distillery.fa4_attention.default") == 1
    assert _targets(backward).count("distillery.fa4_attention_backward.default") == 1
    lse = next(n for n in forward.graph.nodes if n.op == "call_function" and str(n.target) == "distillery.fa4_attention.default")
    out_meta, lse_meta = lse.meta["val"]
    assert (tuple(lse_meta.shape), lse_meta.dtype) == ((2, 4, 300), torch.float32)
    assert out_meta.is_contiguous() and lse_meta.is_contiguous()


@pytest.mark.process
def test_a_compiled_wan_block_keeps_the_fa4_op_whole():
    """A Wan block (head_dim 128 as Wan-1.3B's, 2 heads, meta weights and activations in bf16) routed to FA4
    compiles to one graph per direction (fullgraph: no graph break) with the op as one node and its backward op."""
    from diffusers import WanTransformer3DModel

    torch._dynamo.reset()
    with torch.device("meta"):
        wan = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16,
                                    out_channels=16, text_dim=64, freq_dim=256, ffn_dim=512, num_layers=1,
                                    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6).to(torch.bfloat16)
    install_attention_backend(wan, "fa4")
    block = wan.blocks[0]
    graphs: dict = {}
    compiled = torch.compile(block, backend=_capturing_backend(graphs), fullgraph=True)
    tokens, d = 3 * 4 * 6, 256
    with torch.device("meta"):
        hidden = torch.randn(1, tokens, d, dtype=torch.bfloat16, requires_grad=True)
        text = torch.randn(1, 7, d, dtype=torch.bfloat16)
        temb = torch.randn(1, 6, d, dtype=torch.float32)
        rotary = (torch.randn(1, tokens, 1, 128), torch.randn(1, tokens, 1, 128))
    out = compiled(hidden, text, temb, rotary)
    assert (out.shape, out.dtype) == (hidden.shape, torch.bfloat16)
    out.float().sum().backward()
    assert _targets(graphs["forward"][0]).count("distillery.fa4_attention.default") == 1
    assert _targets(graphs["backward"][0]).count("distillery.fa4_attention_backward.default") == 1


# -- block lists ------------------------------------------------------------------------------------------
LAYOUTS = [  # (q_len, k_len, chunk_tokens, q_offset, tile)
    (60, 60, 12, 0, (8, 16)),  # ragged last tiles, chunks straddling tiles
    (60, 60, 16, 0, (16, 16)),  # chunk boundaries on tile boundaries
    (45, 45, 45, 0, (8, 8)),  # one chunk: everything full
    (37, 37, 5, 0, (4, 8)),
    (24, 48, 12, 24, (8, 8)),  # a streaming call of 2 chunks after 2 cached ones
    (30, 54, 9, 24, (16, 8)),
    (50, 50, 0, 0, (16, 16)),  # plain attention
]


@pytest.mark.parametrize("q_len,k_len,chunk,offset,tile", LAYOUTS)
def test_block_lists_equal_the_dense_block_causal_mask(q_len, k_len, chunk, offset, tile):
    mask = block_causal_mask(q_len, k_len, chunk, offset)
    kinds = tile_kinds(q_len, k_len, chunk, offset, tile)
    tq, tk = tile
    assert kinds.shape == (-(-q_len // tq), -(-k_len // tk))
    for m in range(kinds.shape[0]):
        for n in range(kinds.shape[1]):
            part = mask[m * tq:(m + 1) * tq, n * tk:(n + 1) * tk]
            want = FULL if bool(part.all()) else PARTIAL if bool(part.any()) else SKIP
            assert int(kinds[m, n]) == want, (m, n)
    for transpose in (False, True):  # the forward's q-major lists and the backward's kv-major ones
        lists = block_lists(kinds, transpose)
        rows = kinds.t() if transpose else kinds
        rebuilt = torch.full_like(rows, SKIP)
        for r in range(rows.shape[0]):
            for kind, cnt, idx in ((FULL, lists.full_cnt, lists.full_idx), (PARTIAL, lists.mask_cnt, lists.mask_idx)):
                c = int(cnt[r])
                listed = idx[r, :c]
                assert torch.all(listed[1:] > listed[:-1]) and not idx[r, c:].any()  # ascending, packed left, zeros after
                rebuilt[r, listed.long()] = kind
        assert torch.equal(rebuilt, rows)
        assert all(t.dtype == torch.int32 for t in lists)


def test_block_lists_at_the_training_shape_skip_the_masked_tiles():
    """21×60×104 latents, chunks of 3 frames: 32,760 tokens, 7 chunks of 4,680, FA4's 128×128 tiles. ~43% of the
    tiles are skipped (the masked share of the square, 1 − 8/14, less the tiles a chunk boundary cuts); tile rows
    that hold a chunk boundary, and a sample of the others, against the dense mask of their rows."""
    tokens, chunk = 32760, 4680
    tq, tk = FA4_TILE
    kinds = tile_kinds(tokens, tokens, chunk, 0, FA4_TILE)
    assert kinds.shape == (256, 256)
    assert 0.40 < float((kinds == SKIP).float().mean()) < 1 - 8 / 14
    boundary_rows = {b // tq for b in range(chunk, tokens, chunk)}
    for m in sorted(boundary_rows | {0, 1, 100, 255}):
        rows = min(tq, tokens - m * tq)
        mask = block_causal_mask(rows, tokens, chunk, m * tq)
        padded = torch.zeros(rows, 256 * tk, dtype=torch.bool)
        padded[:, :tokens] = mask
        valid = torch.zeros(256 * tk, dtype=torch.bool)
        valid[:tokens] = True
        per_tile = padded.view(rows, 256, tk)
        full = (per_tile | ~valid.view(1, 256, tk)).all(dim=2).all(dim=0)
        some = per_tile.any(dim=2).any(dim=0)
        want = torch.where(full, FULL, torch.where(some, PARTIAL, SKIP)).to(torch.int8)
        assert torch.equal(kinds[m], want), m
    assert int((kinds[0] == FULL).sum()) == 36 and int((kinds[0] == PARTIAL).sum()) == 1  # 36 × 128 = 4608 < 4680


def _qkv(b, lq, lk, h=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, lq, h, d, generator=g, dtype=dtype), torch.randn(b, lk, h, d, generator=g, dtype=dtype),
            torch.randn(b, lk, h, d, generator=g, dtype=dtype))


@pytest.mark.parametrize("q_len,k_len,chunk,offset,tile", LAYOUTS)
def test_attention_over_the_block_lists_equals_masked_sdpa_in_fp32(q_len, k_len, chunk, offset, tile):
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, q_len, k_len))
    mask = block_causal_mask(q_len, k_len, chunk, offset)
    assert torch.equal(lists_mask(q_len, k_len, chunk, offset, tile), mask)
    out, lse = reference_attention(q, k, v, chunk, offset, tile)
    ref = _sdpa(q, k, v, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1), rtol=1e-5, atol=1e-5)
    go = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), go)
    for got in (torch.autograd.grad(out, (q, k, v), go), reference_attention_backward(q, k, v, out, go, chunk, offset, tile)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.process
def test_the_op_and_its_autograd_equal_sdpa_eager_and_compiled_on_cpu():
    """The op through its registered CPU kernel and backward (the wiring FA4 gets on the GPU), fp32, block-causal
    and plain, against masked SDPA; compiled with aot_eager it gives the same."""
    torch._dynamo.reset()
    for chunk, offset, lk in ((0, 0, 300), (96, 0, 300), (64, 128, 428)):
        q, k, v = (t.requires_grad_(True) for t in _qkv(1, 300, lk, h=2, d=32, seed=chunk))
        ref = _sdpa(q, k, v, block_causal_mask(300, lk, chunk, offset))
        go = torch.randn_like(ref)
        want = torch.autograd.grad(ref, (q, k, v), go)
        eager = fa4_attention(q, k, v, chunk, offset)
        compiled = torch.compile(fa4_attention, backend="aot_eager", fullgraph=True)(q, k, v, chunk, offset)
        for out in (eager, compiled):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            for a, b in zip(torch.autograd.grad(out, (q, k, v), go), want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_causal_wans_fa4_layouts_equal_its_sdpa_path():
    """``fa4_block_causal`` (what the causal processor runs on the GPU) in both modes, through the op's CPU kernel,
    equals the per-chunk SDPA calls — the training plan over a whole video and a streaming plan of several chunks
    after a KV cache (the layout's q_offset)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from distillery.models.wan.causal import _AttentionPlan, fa4_block_causal

    per_frame = 4
    for plan in (_AttentionPlan(3, per_frame, 0, 8), _AttentionPlan(2, per_frame, 4, 5), _AttentionPlan(2, per_frame, 2, 2)):
        q, k, v = _qkv(2, plan.frames * per_frame, (plan.start_frame + plan.frames) * per_frame, seed=plan.frames)
        sdpa = torch.cat([dispatch_attention_fn(q[:, a:b], k[:, :e], v[:, :e]) for a, b, e in plan.query_groups()], dim=1)
        for mode in ("prefix", "sparse"):
            torch.testing.assert_close(fa4_block_causal(q, k, v, plan, mode), sdpa, rtol=1e-5, atol=1e-5)


# -- compile modes ----------------------------------------------------------------------------------------
@pytest.mark.process
@pytest.mark.parametrize("mode", ["blocks", "model"])
def test_compile_mode_compiles_each_block_or_the_whole_module(mode):
    from distillery.components.distributed import DistEnv
    from distillery.config.schema import DistributedConfig, ModelRuntimeConfig
    from distillery.engine.builder import place_model

    model = _tiny_wan(trainable=True)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", mesh=None,
                  compute_dtype=torch.float32)
    place_model(model, env, DistributedConfig(), ModelRuntimeConfig(compile=True, compile_mode=mode))
    blocks = [b._compiled_call_impl is not None for b in model.shardable_blocks(model.forward_module)]
    root = model.forward_module._compiled_call_impl is not None
    assert (all(blocks), root) == ((True, False) if mode == "blocks" else (False, True))
