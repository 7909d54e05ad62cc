"""Which kernel runs the Wan plugins' self-attention: SDPA through diffusers' dispatcher, or FlashAttention-4.

Backends (``training.model.attention_backend``; validate and the exported pipeline resolve ``auto`` the same way,
through :func:`~distillery.models.wan.inference.load_inference_model`):

- ``auto`` (the default): ``fa4_sparse`` where it can run — a CUDA device of compute capability 9.0 or newer (Hopper,
  Blackwell), ``flash_attn.cute`` importable (``pip install -e ".[gpu]"``), a bf16/fp16 compute dtype — else
  ``native``. Without CUDA or without the package it is ``native``: the SDPA code path of before, unchanged.
- ``native``: torch SDPA picks its kernel; ``cudnn`` / ``flash`` / ``efficient``: only that SDPA kernel (CUDA).
- ``fa4``: every self-attention through FlashAttention-4 (``flash_attn.cute``, CuTe DSL kernels) as the torch
  custom op ``distillery::fa4_attention``, so ``torch.compile`` keeps it whole (one opaque node with a fake
  implementation for tracing and a backward op through ``register_autograd``); the causal Wan's block-causal
  attention as one call per chunk over its key prefix (the query groups of the plan).
- ``fa4_sparse``: as ``fa4``, but a block-causal call that spans several chunks is one FA4 call with block
  sparsity: the kv tiles each q tile attends fully (no mask evaluated), partially (a ``mask_mod`` decides per
  element) or not at all (never loaded) come from :func:`tile_kinds` of the chunk layout.

Cross-attention (text keys) stays on SDPA in every backend.

Layouts: ``q`` ``[B, Lq, heads, head_dim]``, ``k``/``v`` ``[B, Lk, heads, head_dim]`` (the processor layout);
the op returns ``out`` like ``q`` and ``lse`` ``[B, heads, Lq]`` float32 (log-sum-exp of the scaled scores, kept
for the backward; it carries no gradient of its own). Block-causal: query ``i`` (token ``i + q_offset`` of the key
sequence) attends key ``j`` iff ``j // chunk_tokens <= (i + q_offset) // chunk_tokens``; ``chunk_tokens = 0`` is
plain (full) attention.

The op's CPU kernels are the same mathematics written plainly in fp32 over the same block lists
(:func:`reference_attention`, :func:`reference_attention_backward`): what the CPU tests check the op's wiring, its
autograd and the lists against (the FA4 kernels need the GPU; ``bench/fa4_checks.py`` compares them with SDPA there).
"""
# No ``from __future__ import annotations`` here: torch.library.custom_op infers the op schema from the
# annotations, and the CuTe DSL reads the mask_mod's signature.

import functools
import importlib
import math
from typing import NamedTuple

import torch

from distillery.common.errors import UserError

BACKENDS = ("auto", "native", "cudnn", "flash", "efficient", "fa4", "fa4_sparse")
SDPA_KERNELS = {"cudnn": "_native_cudnn", "flash": "_native_flash", "efficient": "_native_efficient"}  # diffusers' names
FA4_MODES = {"fa4": "prefix", "fa4_sparse": "sparse"}  # backend -> how block-causal attention runs
FA4_DTYPES = (torch.bfloat16, torch.float16)
FA4_TILE = (128, 128)  # (q, kv) tokens per tile of the block lists: FA4's SM90 forward tile at head_dim 128


# -- choosing the backend -------------------------------------------------------------------------------
def fa4_import_problem() -> str | None:
    """Why ``flash_attn.cute`` cannot be used in this process (None when it imports)."""
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as exc:  # ImportError, or a CUDA/DSL library that fails to load
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"flash_attn.cute does not import ({type(exc).__name__}: {first[:160]}); install it with pip install -e \".[gpu]\""
    return None


def fa4_problem(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why FA4 cannot run on ``device`` in ``dtype`` (None when it can). The package is checked before the GPU,
    so a machine without it never asks CUDA anything."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"needs a CUDA device (this run computes on {device.type})"
    if dtype not in FA4_DTYPES:
        return f"needs bf16 or fp16 compute (this run computes in {str(dtype).removeprefix('torch.')})"
    problem = fa4_import_problem()
    if problem is not None:
        return problem
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"needs a GPU of compute capability 9.0 or newer (Hopper); this one is {major}.{minor}"
    return None


def resolve_attention_backend(requested: str, device: torch.device | str, dtype: torch.dtype,
                              where: str = "training.model.attention_backend") -> str:
    """The backend that runs: ``auto`` → ``fa4_sparse`` when :func:`fa4_problem` finds nothing (measured on an H200:
    the same as ``fa4`` for bidirectional attention, faster for block-causal: 22.6 vs 24.3 ms per fwd+bwd at 32,760
    tokens, the DFSFT step 1.666 vs 1.730 s; BENCHMARKS.md), else ``native``; an
    explicit ``fa4``/``fa4_sparse`` that cannot run is a :class:`UserError` (one line naming ``where``)."""
    if requested not in BACKENDS:
        raise UserError(f"config error: {where}: {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "fa4_sparse" if fa4_problem(device, dtype) is None else "native"
    if requested in FA4_MODES:
        problem = fa4_problem(device, dtype)
        if problem is not None:
            raise UserError(f"config error: {where}: {requested} {problem}; use auto or native")
    return requested


def fa4_can_run(x: torch.Tensor) -> bool:
    """Whether the FA4 op takes ``x``: a CUDA bf16/fp16 tensor (or a meta one: shapes only, through the op's fake
    implementation); a processor set to FA4 falls back to SDPA otherwise (a CPU or fp32 call)."""
    return (x.is_cuda or x.is_meta) and x.dtype in FA4_DTYPES


# -- block-causal layout: the mask and the block lists -------------------------------------------------------
def block_causal_mask(q_len: int, k_len: int, chunk_tokens: int, q_offset: int = 0,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense ``[q_len, k_len]`` bool: query ``i`` may attend key ``j`` (module doc; ``chunk_tokens`` 0: all True)."""
    if chunk_tokens <= 0:
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    q_chunk = (torch.arange(q_len, device=device) + q_offset) // chunk_tokens
    k_chunk = torch.arange(k_len, device=device) // chunk_tokens
    return k_chunk[None, :] <= q_chunk[:, None]


SKIP, PARTIAL, FULL = 0, 1, 2


def tile_kinds(q_len: int, k_len: int, chunk_tokens: int, q_offset: int = 0, tile: tuple[int, int] = FA4_TILE,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """``int8 [ceil(q_len / tile_q), ceil(k_len / tile_k)]``: per (q tile, kv tile) whether the block-causal
    mask allows every (query, key) pair of the tile (``FULL``), some (``PARTIAL``) or none (``SKIP``). Only
    the real tokens of a ragged last tile count. Built from the chunk layout alone (no dense mask): a query's
    last visible key ``k_end(i) = min(((i + q_offset) // chunk_tokens + 1) · chunk_tokens, k_len)`` grows with
    ``i``, so a tile's first and last query bound it."""
    tq, tk = tile
    mq, nk = -(-q_len // tq), -(-k_len // tk)
    if chunk_tokens <= 0:
        return torch.full((mq, nk), FULL, dtype=torch.int8, device=device)
    first_q = torch.arange(mq, device=device) * tq
    last_q = torch.clamp(first_q + tq, max=q_len) - 1
    k_end_lo = torch.clamp(((first_q + q_offset) // chunk_tokens + 1) * chunk_tokens, max=k_len)
    k_end_hi = torch.clamp(((last_q + q_offset) // chunk_tokens + 1) * chunk_tokens, max=k_len)
    first_k = torch.arange(nk, device=device) * tk
    last_k = torch.clamp(first_k + tk, max=k_len) - 1
    full = last_k[None, :] < k_end_lo[:, None]
    touched = first_k[None, :] < k_end_hi[:, None]
    kinds = torch.full((mq, nk), SKIP, dtype=torch.int8, device=device)
    kinds[touched] = PARTIAL
    kinds[full] = FULL
    return kinds


class BlockLists(NamedTuple):
    """FA4's block-sparse lists of one direction, per row tile: ``full_cnt`` ``int32 [rows]`` and ``full_idx``
    ``int32 [rows, cols]`` (the column tiles attended fully, ascending, packed left, zero after ``full_cnt``),
    likewise ``mask_cnt`` / ``mask_idx`` for the partial ones; tiles in neither list are skipped. Forward:
    rows are q tiles, columns kv tiles; backward: the transpose (rows kv tiles, columns q tiles)."""

    full_cnt: torch.Tensor
    full_idx: torch.Tensor
    mask_cnt: torch.Tensor
    mask_idx: torch.Tensor


def _packed(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cols = selected.shape[1]
    arange = torch.arange(cols, device=selected.device, dtype=torch.int32).expand_as(selected)
    idx = torch.where(selected, arange, torch.full_like(arange, cols)).sort(dim=1).values
    idx = torch.where(idx == cols, torch.zeros_like(idx), idx)
    return selected.sum(dim=1, dtype=torch.int32), idx.to(torch.int32).contiguous()


def block_lists(kinds: torch.Tensor, transpose: bool = False) -> BlockLists:
    """The lists of :class:`BlockLists` from :func:`tile_kinds` (``transpose``: the backward's kv-major lists)."""
    if transpose:
        kinds = kinds.t()
    full_cnt, full_idx = _packed(kinds == FULL)
    mask_cnt, mask_idx = _packed(kinds == PARTIAL)
    return BlockLists(full_cnt, full_idx, mask_cnt, mask_idx)


# -- the reference: the op's CPU kernel ---------------------------------------------------------------------
def lists_mask(q_len: int, k_len: int, chunk_tokens: int, q_offset: int = 0, tile: tuple[int, int] = FA4_TILE,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """``[q_len, k_len]`` bool: what a kernel reading the forward :class:`BlockLists` lets through — every pair of a
    tile the lists call full, the block-causal rule on the partial ones, nothing of a tile they skip."""
    tq, tk = tile
    lists = block_lists(tile_kinds(q_len, k_len, chunk_tokens, q_offset, tile, device))
    rule = block_causal_mask(q_len, k_len, chunk_tokens, q_offset, device)
    allowed = torch.zeros(q_len, k_len, dtype=torch.bool, device=device)
    for m in range(lists.full_cnt.shape[0]):
        rows = slice(m * tq, (m + 1) * tq)
        for n in lists.full_idx[m, :int(lists.full_cnt[m])].tolist():
            allowed[rows, n * tk:(n + 1) * tk] = True
        for n in lists.mask_idx[m, :int(lists.mask_cnt[m])].tolist():
            allowed[rows, n * tk:(n + 1) * tk] = rule[rows, n * tk:(n + 1) * tk]
    return allowed


def _reference_probs(q, k, chunk_tokens, q_offset, tile):
    """``(P [B, H, Lq, Lk], lse [B, H, Lq])`` in fp32 under :func:`lists_mask`, and the softmax scale."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    allowed = lists_mask(q.shape[1], k.shape[1], chunk_tokens, q_offset, tile, q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]), lse, scale


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_tokens: int = 0, q_offset: int = 0,
                        tile: tuple[int, int] = FA4_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out like q, lse [B, heads, Lq] float32)`` in fp32 over the forward :class:`BlockLists` (:func:`lists_mask`:
    the tiles they name, the mask only on the partial ones) — FA4's block-sparse forward written plainly."""
    p, lse, _ = _reference_probs(q, k, chunk_tokens, q_offset, tile)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.float())
    return out.to(q.dtype).contiguous(), lse.contiguous()


def reference_attention_backward(q, k, v, out, dout, chunk_tokens: int = 0, q_offset: int = 0,
                                 tile: tuple[int, int] = FA4_TILE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`reference_attention` for the output gradient ``dout``, in closed form (fp32):
    ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))``, ``dQ = s · dS K``, ``dK = s · dSᵀ Q``."""
    p, _, scale = _reference_probs(q, k, chunk_tokens, q_offset, tile)
    do, vf = dout.float(), v.float()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    delta = (do * out.float()).sum(-1).transpose(1, 2)  # [B, H, Lq]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k.float()) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


# -- FlashAttention-4 ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _block_causal_mask_mod(chunk_tokens: int, q_offset: int):
    """The CuTe ``mask_mod`` of the block-causal rule (evaluated on partial tiles only). Compile-time constants
    (FA4 keys its kernel cache on the function's source and captured values), built once per layout."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils as fa_utils

    chunk, offset = int(chunk_tokens), int(q_offset)

    @cute.jit
    def block_causal_mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        c = fa_utils.scalar_to_ssa(chunk, cutlass.Int32)
        o = fa_utils.scalar_to_ssa(offset, cutlass.Int32)
        return kv_idx // c <= (q_idx + o) // c

    return block_causal_mask_mod


_SPARSE_CACHE: dict[tuple, tuple] = {}


def _fa4_sparse_args(q_len: int, k_len: int, chunk_tokens: int, q_offset: int, device: torch.device) -> tuple:
    """``(mask_mod, forward BlockSparseTensorsTorch, backward BlockSparseTensorsTorch)`` of a layout, built once
    on ``device`` (the lists broadcast over batch and heads: ``[1, 1, ...]``)."""
    key = (q_len, k_len, chunk_tokens, q_offset, str(device))
    if key not in _SPARSE_CACHE:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        kinds = tile_kinds(q_len, k_len, chunk_tokens, q_offset, FA4_TILE, device)

        def fa4_lists(lists: BlockLists) -> BlockSparseTensorsTorch:
            return BlockSparseTensorsTorch(mask_block_cnt=lists.mask_cnt[None, None], mask_block_idx=lists.mask_idx[None, None],
                                           full_block_cnt=lists.full_cnt[None, None], full_block_idx=lists.full_idx[None, None],
                                           block_size=FA4_TILE)

        _SPARSE_CACHE[key] = (_block_causal_mask_mod(chunk_tokens, q_offset), fa4_lists(block_lists(kinds)),
                              fa4_lists(block_lists(kinds, transpose=True)))
    return _SPARSE_CACHE[key]


def _needs_mask(k_len: int, chunk_tokens: int, q_offset: int) -> bool:
    """Whether the block-causal rule hides any key from any query (else the call is plain attention)."""
    return chunk_tokens > 0 and q_offset // chunk_tokens < (k_len - 1) // chunk_tokens  # the first query sees least


@torch.library.custom_op("distillery::fa4_attention", mutates_args=())
def fa4_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_tokens: int, q_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4 forward (module doc for layouts and the block-causal rule); contiguous inputs."""
    from flash_attn.cute.interface import _flash_attn_fwd

    if _needs_mask(k.shape[1], chunk_tokens, q_offset):
        mask_mod, forward_lists, _ = _fa4_sparse_args(q.shape[1], k.shape[1], chunk_tokens, q_offset, q.device)
        out, lse = _flash_attn_fwd(q, k, v, mask_mod=mask_mod, block_sparse_tensors=forward_lists, return_lse=True)[:2]
    else:
        out, lse = _flash_attn_fwd(q, k, v, return_lse=True)[:2]
    return out.contiguous(), lse.contiguous()


@fa4_attention_op.register_fake
def _fa4_attention_fake(q, k, v, chunk_tokens, q_offset):
    b, lq, h, _ = q.shape
    return q.new_empty((b, lq, h, v.shape[-1])), q.new_empty((b, h, lq), dtype=torch.float32)


@fa4_attention_op.register_kernel("cpu")
def _fa4_attention_cpu(q, k, v, chunk_tokens, q_offset):
    return reference_attention(q, k, v, chunk_tokens, q_offset)


@torch.library.custom_op("distillery::fa4_attention_backward", mutates_args=())
def fa4_attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                              lse: torch.Tensor, chunk_tokens: int, q_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4 backward: ``(dq, dk, dv)`` like ``(q, k, v)`` from the forward's ``out`` and ``lse``."""
    from flash_attn.cute.interface import _flash_attn_bwd

    if _needs_mask(k.shape[1], chunk_tokens, q_offset):
        mask_mod, _, backward_lists = _fa4_sparse_args(q.shape[1], k.shape[1], chunk_tokens, q_offset, q.device)
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, mask_mod=mask_mod, block_sparse_tensors=backward_lists)[:3]
    else:
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse)[:3]
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@fa4_attention_backward_op.register_fake
def _fa4_attention_backward_fake(q, k, v, out, dout, lse, chunk_tokens, q_offset):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@fa4_attention_backward_op.register_kernel("cpu")
def _fa4_attention_backward_cpu(q, k, v, out, dout, lse, chunk_tokens, q_offset):
    return reference_attention_backward(q, k, v, out, dout, chunk_tokens, q_offset)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, chunk_tokens, q_offset = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.layout = (chunk_tokens, q_offset)


def _backward(ctx, dout, dlse):
    del dlse  # lse is bookkeeping for the backward, not an output anyone differentiates
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = fa4_attention_backward_op(q, k, v, out, dout.contiguous(), lse, *ctx.layout)
    return dq, dk, dv, None, None


fa4_attention_op.register_autograd(_backward, setup_context=_setup_context)


def fa4_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk_tokens: int = 0, q_offset: int = 0) -> torch.Tensor:
    """Attention ``[B, Lq, heads, head_dim]`` of ``query`` over ``key``/``value`` through the FA4 op (plain, or
    block-causal with ``chunk_tokens``); what the processors call."""
    out, _ = fa4_attention_op(query.contiguous(), key.contiguous(), value.contiguous(), int(chunk_tokens), int(q_offset))
    return out


# -- the processors' shared parts ---------------------------------------------------------------------------
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan rotary embedding of ``x`` ``[B, L, heads, head_dim]`` (interleaved pairs)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def self_attention_qkv(attn, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A Wan self-attention's ``(query, key, value)`` ``[B, L, heads, head_dim]`` after ``norm_q``/``norm_k`` and
    the rotary embedding, as diffusers' ``WanAttnProcessor`` computes them."""
    from diffusers.models.transformers.transformer_wan import _get_qkv_projections

    query, key, value = _get_qkv_projections(attn, hidden_states, None)
    query, key = attn.norm_q(query), attn.norm_k(key)
    query = query.unflatten(2, (attn.heads, -1))
    key = key.unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value


def attention_output(attn, hidden_states: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``to_out`` of the attention result ``[B, L, heads, head_dim]`` (diffusers' order of casts)."""
    hidden_states = hidden_states.flatten(2, 3).type_as(query)
    hidden_states = attn.to_out[0](hidden_states)
    return attn.to_out[1](hidden_states)


def stock_processor(processor):
    """diffusers' ``WanAttnProcessor`` with ``processor``'s SDPA choice (what every non-FA4 call runs)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    stock = WanAttnProcessor()
    stock._attention_backend, stock._parallel_config = processor._attention_backend, processor._parallel_config
    return stock


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend=None) -> torch.Tensor:
    """Plain attention ``[B, Lq, heads, head_dim]`` through diffusers' dispatcher (torch SDPA; ``backend``: the kernel
    ``set_attention_backend`` chose), the call diffusers' ``WanAttnProcessor`` makes."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, backend=backend)


def across_sequence_shards(rotary_emb, attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``attend(query, key, value)`` — whichever attention runs —, or, when ``rotary_emb`` carries a sequence-parallel
    group (a sharded call, :mod:`distillery.models.wan.sequence_parallel`), the same over the whole sequence from this
    rank's token shards: all-to-all in, ``attend``, all-to-all out
    (:meth:`~distillery.components.sequence_parallel.SequenceParallel.attention`)."""
    sp = getattr(rotary_emb, "sequence_parallel", None)
    if sp is None:
        return attend(query, key, value)
    return sp.attention(attend, query, key, value, rotary_emb.tokens)


class FA4WanAttnProcessor:
    """The self-attention (``attn1``) of a bidirectional Wan block through the FA4 op when ``fa4_mode`` is set
    and the activations are CUDA bf16/fp16, and through SDPA in a sequence-parallel call otherwise (both
    :func:`across_sequence_shards`); anything else (cross-attention, a mask, CPU without SP) runs diffusers'
    ``WanAttnProcessor``. A plain picklable object: ``copy.deepcopy`` (the bf16 compute copy) carries it."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, fa4_mode: str | None = "prefix") -> None:
        self.fa4_mode = fa4_mode

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        fa4 = self.fa4_mode is not None and fa4_can_run(hidden_states)
        sharded = getattr(rotary_emb, "sequence_parallel", None) is not None
        if encoder_hidden_states is not None or attention_mask is not None or rotary_emb is None or not (fa4 or sharded):
            return stock_processor(self)(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = self_attention_qkv(attn, hidden_states, rotary_emb[0], rotary_emb[1])
        attend = fa4_attention if fa4 else functools.partial(sdpa_attention, backend=self._attention_backend)
        return attention_output(attn, across_sequence_shards(rotary_emb, attend, query, key, value), query)


def install_attention_backend(transformer: torch.nn.Module, backend: str) -> None:
    """Route ``transformer``'s attention to the resolved ``backend`` (not ``auto``), in place and idempotently.

    A processor that has an ``fa4_mode`` (:class:`FA4WanAttnProcessor`, the causal Wan's) gets the mode of
    ``backend`` (None for the SDPA ones); a stock ``attn1`` gets an :class:`FA4WanAttnProcessor` for the FA4
    backends only. The SDPA kernel choice goes through diffusers' ``set_attention_backend`` (every processor's
    ``_attention_backend``). ``native`` on a transformer that never left it changes nothing.
    """
    mode = FA4_MODES.get(backend)
    for block in transformer.blocks:
        processor = block.attn1.processor
        if hasattr(processor, "fa4_mode"):
            processor.fa4_mode = mode
        elif mode is not None:
            ours = FA4WanAttnProcessor(mode)
            ours._attention_backend, ours._parallel_config = processor._attention_backend, processor._parallel_config
            block.attn1.set_processor(ours)
    name = SDPA_KERNELS.get(backend)
    chosen = [getattr(m.processor, "_attention_backend", None) for m in transformer.modules() if getattr(m, "processor", None) is not None]
    if name is None and all(c is None for c in chosen):
        return  # every processor already dispatches to diffusers' default (torch SDPA picks the kernel)
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # it warns that the dispatcher API is experimental
    try:
        transformer.set_attention_backend(name or "native")
    finally:
        diffusers_logging.set_verbosity(level)
