"""Trained block-sparse video attention: coarse attention over pooled 3-D tiles picks, per query tile, the key tiles
its fine attention reads (the behaviour of FastVideo's VSA, written here; standard library + torch, FlashAttention-4
only where it runs). Shared by the training library and the export folder, which ships this file beside its
``pipeline.py`` (one and the same code trains and samples).

**Tiles.** A video's tokens (after patchify) form a grid of ``(T, H, W)`` — frames × rows × columns, frame-major in
the sequence. A :class:`SparseSpec`'s ``tile`` ``(ft, fh, fw)`` cuts it into ``ceil(T/ft) · ceil(H/fh) · ceil(W/fw)``
tiles, numbered frame-tile-major (then row, then column); the last tile along an axis may be ragged (fewer tokens).
In the *tiled layout* every tile owns ``capacity`` consecutive slots (≥ its volume ``ft·fh·fw``): slot
``(lt·fh + lh)·fw + lw`` holds the token at ``(bt·ft + lt, bh·fh + lh, bw·fw + lw)`` where that lies in the grid,
else nothing (a pad, zeros). The capacity is the volume on the CPU and a multiple of 128 for FlashAttention-4 (its
tile), so one FA4 block is one video tile.

**One call** (:func:`video_sparse_attention`), per batch row and head:

1. *coarse*: ``q`` and ``k`` averaged over each tile's tokens (fp32); scores ``q̄ k̄ᵀ / √d`` between tiles;
2. *select*: each query tile keeps the ``ceil((1 − sparsity) · n)`` key tiles of highest score among the ``n`` it
   may attend (all of them, or, block-causal, the tiles of its own and earlier chunks), at least one; no gradient
   flows through the choice (as VSA's);
3. *fine*: exact softmax attention of each query over the tokens of its tile's kept key tiles only — one
   block-sparse FA4 call on the GPU (kept tiles whose slots are all tokens are *full* blocks; ragged ones *partial*,
   their pads masked by a ``mask_mod``); elsewhere (the CPU, a GPU without FA4, fp32) the kept key tiles gathered per
   query tile and one SDPA call over them (:func:`gathered_attention`).

Sparsity 0 keeps every tile: the fine attention is dense attention (block-causal: the block-causal attention). What
trains is every weight that shapes ``q``, ``k`` and ``v``: the gradient reaches them through the fine attention of
the tiles kept; the coarse scores only choose. (VSA also adds the coarse attention's output through a learnt gate;
that branch and its weights are left out here, so a sparse student keeps diffusers' Wan layout exactly.)

Block-causal (a causal student): latent frame ``f`` is in chunk ``(f − lead) // chunk_size`` (``lead`` 1: frame 0 is a
block of its own, the given frame of an image-to-video student); a tile's frames must lie in one chunk
(``chunk_size % ft == 0``; with a lead, ``ft == 1``), and a query tile may keep the key tiles of its own and earlier
chunks. Streaming (a KV cache): the queries are frames ``[q_start, q_start + Tq)`` of the key grid's ``T`` frames
(``q_start`` a multiple of ``ft``).

Layouts: ``q`` ``[B, Lq, heads, d]``, ``k``/``v`` ``[B, Lk, heads, d]`` in raster (frame-major) token order; the
result is like ``q``.
"""
# No ``from __future__ import annotations``: torch.library.custom_op reads the ops' annotations.

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

FA4_DTYPES = (torch.bfloat16, torch.float16)
FA4_BLOCK = 128  # FlashAttention-4's tile (tokens): a tile's capacity on the FA4 path is a multiple of it
OP_NAMESPACE = "distillery_sparse"  # the ops' namespace; defined once per process (:func:`_define_ops`)
DEFAULT_TILE = (1, 16, 8)  # 81×480×832 (a 21×30×52 token grid): 14 tiles a frame, 294 in all, 15% of slots padding


class SparseSpec(NamedTuple):
    """How a model's self-attention is sparse: ``sparsity`` in ``[0, 1)`` (the share of the key tiles a query tile
    may attend that it skips) and ``tile`` ``(frames, rows, columns)`` in tokens."""

    sparsity: float
    tile: tuple[int, int, int] = DEFAULT_TILE

    def record(self) -> dict:
        """The JSON form a trained transformer's config keeps (:data:`RECORD_KEY`)."""
        return {"sparsity": float(self.sparsity), "tile": [int(t) for t in self.tile]}


RECORD_KEY = "_sparse_attention"  # in a transformer's config.json: the SparseSpec it was trained with


def spec_problem(sparsity: object, tile: object) -> str | None:
    """What is wrong with a sparse attention's settings (None when nothing)."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= float(sparsity) < 1.0:
        return f"sparsity must be a number in [0, 1), got {sparsity!r}"
    if (not isinstance(tile, (list, tuple)) or len(tile) != 3
            or any(isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= 4096 for t in tile)):
        return f"the tile must be 3 integers in [1, 4096] (frames, rows, columns), got {tile!r}"
    if math.prod(tile) > 16384:
        return f"a tile of {math.prod(tile)} tokens is larger than 16384"
    return None


def read_record(config: dict) -> SparseSpec | None:
    """The :class:`SparseSpec` a transformer config (``config.json``'s mapping) records, or None (dense). A record that
    does not hold one is a ``ValueError``."""
    record = config.get(RECORD_KEY)
    if record is None:
        return None
    if not isinstance(record, dict) or set(record) != {"sparsity", "tile"}:
        raise ValueError(f"{RECORD_KEY} must be {{'sparsity': s, 'tile': [f, h, w]}}, got {record!r}")
    problem = spec_problem(record["sparsity"], record["tile"])
    if problem:
        raise ValueError(f"{RECORD_KEY}: {problem}")
    return SparseSpec(float(record["sparsity"]), tuple(int(t) for t in record["tile"]))


def causal_problem(tile: tuple[int, int, int], chunk_size: int, lead: int) -> str | None:
    """Why block-causal attention over chunks of ``chunk_size`` frames (after ``lead`` given frames) cannot be cut into
    tiles of ``tile``'s frames (None when it can): a tile must not straddle a chunk's border."""
    ft = int(tile[0])
    if chunk_size % ft:
        return f"a tile of {ft} frames straddles chunks of {chunk_size}: the tile's frames must divide the chunk size"
    if lead and ft != 1:
        return f"a tile of {ft} frames straddles the given first frame's own block: image-to-video needs tiles of 1 frame"
    return None


def keep_count(sparsity: float, allowed: int) -> int:
    """Key tiles a query tile keeps of the ``allowed`` it may attend: ``ceil((1 − sparsity) · allowed)``, at least 1."""
    return max(1, min(allowed, math.ceil(round((1.0 - float(sparsity)) * allowed, 9))))


def capacity_for(tile: tuple[int, int, int], fa4: bool) -> int:
    """Slots a tile owns in the tiled layout: its volume, rounded up to FA4's 128 on the FA4 path."""
    volume = math.prod(tile)
    return -(-volume // FA4_BLOCK) * FA4_BLOCK if fa4 else volume


class GridRotary(NamedTuple):
    """diffusers' rotary ``(freqs_cos, freqs_sin)`` (each ``[1, L, 1, head_dim]``) carrying the call's token grid
    ``(frames, rows, columns)``: what a bidirectional model's sparse processors tile."""

    freqs_cos: torch.Tensor
    freqs_sin: torch.Tensor
    grid: tuple


def grid_rotary_hook(rope: torch.nn.Module, args: tuple, output) -> GridRotary:
    """Forward hook of a Wan ``transformer.rope``: its rotary embedding with the token grid of its input
    ``[B, C, F, H, W]`` (divided by the rope's ``patch_size``)."""
    _, _, f, h, w = args[0].shape
    pt, ph, pw = rope.patch_size
    return GridRotary(output[0], output[1], (f // pt, h // ph, w // pw))


def install_grid_hook(transformer: torch.nn.Module) -> None:
    """:func:`grid_rotary_hook` on ``transformer.rope``, once."""
    hooks = transformer.rope._forward_hooks.values()
    if not any(getattr(hook, "__name__", "") == grid_rotary_hook.__name__ for hook in hooks):
        transformer.rope.register_forward_hook(grid_rotary_hook)


# -- the tiled layout -----------------------------------------------------------------------------------------
class Layout(NamedTuple):
    """A grid ``(T, H, W)`` cut by ``tile`` into ``counts = (nt, nh, nw)`` tiles of ``capacity`` slots.

    ``slot_token`` ``int64 [blocks · capacity]``: the raster token of each slot, ``-1`` at a pad; ``token_slot``
    ``int64 [T · H · W]``: the slot of each token; ``sizes`` ``float32 [blocks]``: tokens per tile; ``complete``
    ``bool [blocks]``: whether every slot of the tile holds a token (its FA4 block needs no mask)."""

    grid: tuple[int, int, int]
    tile: tuple[int, int, int]
    capacity: int
    counts: tuple[int, int, int]
    slot_token: torch.Tensor
    token_slot: torch.Tensor
    sizes: torch.Tensor
    complete: torch.Tensor

    @property
    def blocks(self) -> int:
        return self.counts[0] * self.counts[1] * self.counts[2]


@functools.lru_cache(maxsize=64)
def layout(grid: tuple[int, int, int], tile: tuple[int, int, int], capacity: int, device: torch.device) -> Layout:
    """The :class:`Layout` of ``grid`` cut by ``tile`` (built once per shape and device)."""
    t, h, w = grid
    ft, fh, fw = tile
    if capacity < ft * fh * fw:
        raise ValueError(f"capacity {capacity} is smaller than a tile of {ft * fh * fw} tokens")
    nt, nh, nw = -(-t // ft), -(-h // fh), -(-w // fw)
    # slot coordinates: [nt, nh, nw, ft, fh, fw] → global (frame, row, column)
    gt = (torch.arange(nt)[:, None] * ft + torch.arange(ft)[None, :])[:, None, None, :, None, None]
    gh = (torch.arange(nh)[:, None] * fh + torch.arange(fh)[None, :])[None, :, None, None, :, None]
    gw = (torch.arange(nw)[:, None] * fw + torch.arange(fw)[None, :])[None, None, :, None, None, :]
    inside = (gt < t) & (gh < h) & (gw < w)
    token = torch.where(inside, (gt * h + gh) * w + gw, torch.full_like(gt * gh * gw, -1))
    token = token.reshape(nt * nh * nw, ft * fh * fw)
    slot_token = torch.full((nt * nh * nw, capacity), -1, dtype=torch.int64)
    slot_token[:, :ft * fh * fw] = token
    slot_token = slot_token.reshape(-1)
    valid = slot_token >= 0
    token_slot = torch.empty(t * h * w, dtype=torch.int64)
    token_slot[slot_token[valid]] = torch.nonzero(valid).squeeze(1)
    sizes = valid.reshape(-1, capacity).sum(1)
    return Layout(grid, tile, capacity, (nt, nh, nw), slot_token.to(device), token_slot.to(device),
                  sizes.float().to(device), (sizes == capacity).to(device))


def to_tiles(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Raster ``x [B, L, heads, d]`` → tiled ``[B, blocks · capacity, heads, d]`` (zeros at the pads)."""
    padded = torch.cat([x, x.new_zeros(x.shape[0], 1, *x.shape[2:])], dim=1)
    index = torch.where(lay.slot_token >= 0, lay.slot_token, x.shape[1])
    return padded[:, index]


def from_tiles(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Tiled ``x [B, blocks · capacity, heads, d]`` → raster ``[B, L, heads, d]`` (the pads dropped)."""
    return x[:, lay.token_slot]


def tile_means(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Each tile's mean token ``float32 [B, blocks, heads, d]`` of raster ``x [B, L, heads, d]``."""
    tiled = to_tiles(x.float(), lay)
    b, _, heads, d = tiled.shape
    return tiled.view(b, lay.blocks, lay.capacity, heads, d).sum(2) / lay.sizes[None, :, None, None]


# -- which key tiles each query tile attends ---------------------------------------------------------------------
class Causal(NamedTuple):
    """Block-causal attention over chunks of ``chunk_size`` latent frames after ``lead`` given frames."""

    chunk_size: int
    lead: int = 0


@functools.lru_cache(maxsize=64)
def allowed_tiles(q_lay: Layout, k_lay: Layout, q_start: int, causal: Causal | None) -> torch.Tensor:
    """``bool [q blocks, k blocks]`` on the layouts' device: the key tiles each query tile may attend (all, or
    block-causally: those whose chunk is not after the query tile's; the query grid's frame 0 is the key grid's
    ``q_start``). Built once per layout pair."""
    nq, nk = q_lay.blocks, k_lay.blocks
    if causal is None:
        return torch.ones(nq, nk, dtype=torch.bool, device=q_lay.sizes.device)
    ft = q_lay.tile[0]
    q_frame = q_start + torch.arange(nq) // (q_lay.counts[1] * q_lay.counts[2]) * ft
    k_frame = torch.arange(nk) // (k_lay.counts[1] * k_lay.counts[2]) * ft

    def chunk(frame: torch.Tensor) -> torch.Tensor:
        return torch.where(frame < causal.lead, torch.full_like(frame, -1),
                           torch.div(frame - causal.lead, causal.chunk_size, rounding_mode="floor"))

    return (chunk(k_frame)[None, :] <= chunk(q_frame)[:, None]).to(q_lay.sizes.device)


@functools.lru_cache(maxsize=64)
def keep_counts(allowed: torch.Tensor, sparsity: float) -> tuple[torch.Tensor, int]:
    """``(count int64 [nq] on allowed's device, its maximum)``: the key tiles each query tile keeps (:func:`keep_count`
    of the tiles it may attend). Counted on the host once per layout (no device sync on later calls)."""
    counts = [keep_count(sparsity, int(n)) for n in allowed.sum(1).cpu().tolist()]
    return torch.tensor(counts, dtype=torch.int64, device=allowed.device), max(counts)


class Selection(NamedTuple):
    """The key tiles each (batch row, head, query tile) keeps: ``idx`` ``int64 [B, heads, nq, keep]`` ascending and
    packed left (``count`` of them valid, the rest 0), ``count`` ``int64 [nq]``."""

    idx: torch.Tensor
    count: torch.Tensor


@torch.no_grad()
def select_tiles(q: torch.Tensor, k: torch.Tensor, q_lay: Layout, k_lay: Layout, allowed: torch.Tensor,
                 sparsity: float) -> Selection:
    """The coarse stage: tile means of ``q`` and ``k``, their scaled scores, the ``keep_count`` best allowed key tiles
    per query tile (module doc)."""
    qm, km = tile_means(q, q_lay), tile_means(k, k_lay)  # [B, n, heads, d]
    scores = torch.einsum("bqhd,bkhd->bhqk", qm, km) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    count, keep = keep_counts(allowed, float(sparsity))
    top = scores.topk(keep, dim=-1).indices  # [B, heads, nq, keep]
    used = torch.arange(keep, device=q.device)[None, None, None, :] < count[None, None, :, None]
    nk = k_lay.blocks
    idx = torch.where(used, top, torch.full_like(top, nk)).sort(dim=-1).values
    return Selection(torch.where(idx == nk, torch.zeros_like(idx), idx), count)


def selected_map(sel: Selection, nk: int) -> torch.Tensor:
    """``bool [B, heads, nq, nk]``: whether query tile q keeps key tile k."""
    b, h, nq, keep = sel.idx.shape
    used = torch.arange(keep, device=sel.idx.device)[None, None, None, :] < sel.count[None, None, :, None]
    dense = torch.zeros(b, h, nq, nk + 1, dtype=torch.bool, device=sel.idx.device)
    dense.scatter_(-1, torch.where(used, sel.idx, torch.full_like(sel.idx, nk)), True)
    return dense[..., :nk]


class BlockLists(NamedTuple):
    """FA4's block-sparse lists of one direction (rows: q tiles forward, kv tiles backward): ``full_cnt`` ``int32 [B,
    heads, rows]``, ``full_idx`` ``int32 [B, heads, rows, n]`` (ascending, packed left), the same for the partial
    (masked) blocks."""

    full_cnt: torch.Tensor
    full_idx: torch.Tensor
    mask_cnt: torch.Tensor
    mask_idx: torch.Tensor


def _packed(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(count int32 [..., rows], idx int32 [..., rows, cols])`` of a bool ``[..., rows, cols]``: the selected
    columns ascending, packed left, zeros after."""
    cols = selected.shape[-1]
    arange = torch.arange(cols, device=selected.device).expand_as(selected)
    idx = torch.where(selected, arange, torch.full_like(arange, cols)).sort(dim=-1).values
    idx = torch.where(idx == cols, torch.zeros_like(idx), idx)
    return selected.sum(-1, dtype=torch.int32), idx.to(torch.int32).contiguous()


def forward_lists(sel: Selection, complete: torch.Tensor) -> BlockLists:
    """The forward lists of a selection: per query tile, its kept key tiles — full where the key tile is ``complete``,
    partial where it is ragged."""
    kept = selected_map(sel, complete.shape[0])  # [B, heads, nq, nk]
    return BlockLists(*_packed(kept & complete), *_packed(kept & ~complete))


def backward_lists(sel: Selection, complete: torch.Tensor) -> BlockLists:
    """The backward (kv-major) lists: per key tile, the query tiles that kept it — full where the key tile is
    complete, partial where it is ragged."""
    kept = selected_map(sel, complete.shape[0]).transpose(-1, -2)  # [B, heads, nk, nq]
    return BlockLists(*_packed(kept & complete[:, None]), *_packed(kept & ~complete[:, None]))


def lists_mask(lists: BlockLists, q_lay: Layout, k_lay: Layout, transpose: bool = False) -> torch.Tensor:
    """``bool [B, heads, Lq_tiled, Lk_tiled]``: what a kernel reading ``lists`` lets through — every slot pair of a full
    block; of a partial block, the key slots that hold a token; nothing of a block the lists skip. ``transpose``:
    ``lists`` are backward (kv-major) lists."""
    rows = k_lay.blocks if transpose else q_lay.blocks
    cols = q_lay.blocks if transpose else k_lay.blocks

    def dense(cnt: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        used = torch.arange(idx.shape[-1], device=idx.device)[None, None, None, :] < cnt[..., None]
        out = torch.zeros(*idx.shape[:2], rows, cols + 1, dtype=torch.bool, device=idx.device)
        out.scatter_(-1, torch.where(used, idx.long(), torch.full_like(idx.long(), cols)), True)
        out = out[..., :cols]
        return out.transpose(-1, -2) if transpose else out

    full, partial = dense(lists.full_cnt, lists.full_idx), dense(lists.mask_cnt, lists.mask_idx)
    key_valid = (k_lay.slot_token >= 0).view(k_lay.blocks, k_lay.capacity)
    cq, ck = q_lay.capacity, k_lay.capacity
    full_slots = full.repeat_interleave(cq, dim=-2).repeat_interleave(ck, dim=-1)
    partial_slots = (partial[..., :, :, None] & key_valid[None, None, None, :, :]).flatten(-2)
    return full_slots | partial_slots.repeat_interleave(cq, dim=-2)


# -- the fine attention: FA4 on the GPU, gathered SDPA calls elsewhere ------------------------------------------
GATHER_BYTES = 1 << 30  # the torch path gathers the kept key tiles of this many bytes of query tiles at a time


def gathered_attention(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, sel: Selection, q_lay: Layout,
                       k_lay: Layout) -> torch.Tensor:
    """The fine attention in torch (any device and dtype, differentiable): per query tile, its kept key tiles gathered
    from tiled ``kt``/``vt`` ``[B, nk · C, heads, d]`` and one SDPA call over them, their pad slots and the unused
    entries of the selection masked out. Returns like tiled ``qt`` ``[B, nq · C, heads, d]``. Query tiles go in groups
    of about :data:`GATHER_BYTES` of gathered keys."""
    b, _, heads, d = qt.shape
    nq, nk, c = q_lay.blocks, k_lay.blocks, k_lay.capacity
    keep = sel.idx.shape[-1]
    q = qt.view(b, nq, q_lay.capacity, heads, d).permute(0, 3, 1, 2, 4)  # [B, heads, nq, C, d]
    k, v = (x.view(b, nk, c, heads, d).permute(0, 3, 1, 2, 4) for x in (kt, vt))  # [B, heads, nk, C, d]
    valid = k_lay.slot_token.view(nk, c) >= 0
    used = torch.arange(keep, device=qt.device)[None, :] < sel.count[:, None]  # [nq, keep]
    rows_b = torch.arange(b, device=qt.device)[:, None, None, None]
    rows_h = torch.arange(heads, device=qt.device)[None, :, None, None]
    group = max(1, GATHER_BYTES // max(1, 2 * b * heads * keep * c * d * qt.element_size()))
    outs = []
    for start in range(0, nq, group):
        idx = sel.idx[:, :, start:start + group]  # [B, heads, g, keep]
        g = idx.shape[2]
        kg = k[rows_b, rows_h, idx].reshape(b * heads * g, 1, keep * c, d)
        vg = v[rows_b, rows_h, idx].reshape(b * heads * g, 1, keep * c, d)
        mask = (valid[idx] & used[start:start + g, :, None]).reshape(b * heads * g, 1, 1, keep * c)
        qg = q[:, :, start:start + g].reshape(b * heads * g, 1, q_lay.capacity, d)
        outs.append(F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask).view(b, heads, g, q_lay.capacity, d))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.permute(0, 2, 3, 1, 4).reshape(b, nq * q_lay.capacity, heads, d)


NO_FRAME_BOUND = 2**30  # a key layout's frame bound when no tile is ragged in time (:func:`key_layout_of`)


def slot_holds_token(kv_idx, key_layout, const):
    """Whether tiled key slot ``kv_idx`` holds a token of the grid, from the slot's index alone: ``key_layout`` (:func:
    `key_layout_of`) and ``const`` (how a Python int becomes a value ``kv_idx`` computes with: ``int`` for tensors,
    an SSA constant in the CuTe ``mask_mod``). Integer ``//``, ``%``, ``*``, ``<`` and ``&`` only, no branches."""
    t, h, w, ft, fh, fw, cap, nh, nw = key_layout
    block, slot = kv_idx // const(cap), kv_idx % const(cap)
    frame = block // const(nh * nw) * const(ft) + slot // const(fh * fw)
    row = block // const(nw) % const(nh) * const(fh) + slot % const(fh * fw) // const(fw)
    col = block % const(nw) * const(fw) + slot % const(fw)
    return (slot < const(ft * fh * fw)) & (frame < const(t)) & (row < const(h)) & (col < const(w))


@functools.lru_cache(maxsize=64)
def _pad_mask_mod(key_layout: tuple[int, ...]):
    """The CuTe ``mask_mod`` of a tiled key layout (FA4 evaluates it on partial blocks only): a key slot attends when
    it holds a token (:func:`slot_holds_token`). The layout's numbers are constants of the kernel (FA4 keys its cache on
    the function's source and captured values); a layout whose tiles are whole in time does not name its frame count,
    so one kernel serves every streaming call."""
    import cutlass.cute as cute

    layout_ints = tuple(int(x) for x in key_layout)  # the only captured value: FA4's cache key stays the same per layout

    @cute.jit
    def tile_slot_mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return slot_holds_token(kv_idx, layout_ints, _ssa_int32)

    return tile_slot_mask_mod


def _ssa_int32(x: int):
    """``x`` as a CuTe Int32 SSA constant (what the ``mask_mod``'s arithmetic takes)."""
    import cutlass
    from flash_attn.cute import utils as fa_utils

    return fa_utils.scalar_to_ssa(x, cutlass.Int32)


def _fa4_lists(lists: BlockLists, capacity: int):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    return BlockSparseTensorsTorch(mask_block_cnt=lists.mask_cnt, mask_block_idx=lists.mask_idx, full_block_cnt=lists.full_cnt,
                                   full_block_idx=lists.full_idx, block_size=(capacity, capacity))


def key_layout_of(lay: Layout) -> list[int]:
    """``[frame bound, H, W, ft, fh, fw, capacity, nh, nw]`` of a key layout: what :func:`slot_holds_token` reads (the
    frame bound :data:`NO_FRAME_BOUND` when every tile is whole in time)."""
    t, h, w = lay.grid
    ft, fh, fw = lay.tile
    return [NO_FRAME_BOUND if t % ft == 0 else t, h, w, ft, fh, fw, lay.capacity, lay.counts[1], lay.counts[2]]


def _define_ops() -> None:
    """Define ``distillery_sparse::fa4_block_sparse`` (forward) and its backward op once per process (the export's
    copy of this module and the library's may both be imported: the first defines them, both call them)."""
    try:
        torch.ops.distillery_sparse.fa4_block_sparse  # noqa: B018  (raises when not defined yet)
        return
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op(f"{OP_NAMESPACE}::fa4_block_sparse", mutates_args=())
    def fa4_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, full_cnt: torch.Tensor, full_idx: torch.Tensor,
                         mask_cnt: torch.Tensor, mask_idx: torch.Tensor, key_layout: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """FA4's block-sparse forward of tiled ``q``/``k``/``v`` over the forward lists: ``(out, lse)``."""
        from flash_attn.cute.interface import _flash_attn_fwd

        lists = _fa4_lists(BlockLists(full_cnt, full_idx, mask_cnt, mask_idx), key_layout[6])
        out, lse = _flash_attn_fwd(q, k, v, mask_mod=_pad_mask_mod(tuple(key_layout)), block_sparse_tensors=lists,
                                   return_lse=True)[:2]
        return out.contiguous(), lse.contiguous()

    @fa4_block_sparse.register_fake
    def _(q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, key_layout):
        b, lq, h, _ = q.shape
        return q.new_empty((b, lq, h, v.shape[-1])), q.new_empty((b, h, lq), dtype=torch.float32)

    @torch.library.custom_op(f"{OP_NAMESPACE}::fa4_block_sparse_backward", mutates_args=())
    def fa4_block_sparse_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                                  lse: torch.Tensor, full_cnt: torch.Tensor, full_idx: torch.Tensor, mask_cnt: torch.Tensor,
                                  mask_idx: torch.Tensor, key_layout: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FA4's block-sparse backward over the backward (kv-major) lists: ``(dq, dk, dv)``."""
        from flash_attn.cute.interface import _flash_attn_bwd

        lists = _fa4_lists(BlockLists(full_cnt, full_idx, mask_cnt, mask_idx), key_layout[6])
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, mask_mod=_pad_mask_mod(tuple(key_layout)),
                                     block_sparse_tensors=lists)[:3]
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    @fa4_block_sparse_backward.register_fake
    def _(q, k, v, out, dout, lse, full_cnt, full_idx, mask_cnt, mask_idx, key_layout):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FA4BlockSparse(torch.autograd.Function):
    """The forward op with the backward op as its gradient; the backward lists ride on the context (they are built
    from the selection only when a gradient is wanted)."""

    @staticmethod
    def forward(ctx, q, k, v, sel_idx, sel_count, complete, key_layout, lists):
        out, lse = torch.ops.distillery_sparse.fa4_block_sparse(q, k, v, *lists, key_layout)
        ctx.save_for_backward(q, k, v, out, lse, sel_idx, sel_count, complete)
        ctx.key_layout = key_layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sel_idx, sel_count, complete = ctx.saved_tensors
        lists = backward_lists(Selection(sel_idx, sel_count), complete)
        dq, dk, dv = torch.ops.distillery_sparse.fa4_block_sparse_backward(q, k, v, out, dout.contiguous(), lse, *lists,
                                                                            ctx.key_layout)
        return dq, dk, dv, None, None, None, None, None


def fa4_can_run(x: torch.Tensor) -> bool:
    """Whether the FA4 kernels take ``x`` (CUDA, bf16/fp16); the caller says whether FlashAttention-4 is installed."""
    return x.is_cuda and x.dtype in FA4_DTYPES


def video_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: SparseSpec,
                           grid: tuple[int, int, int], *, q_start: int = 0, causal: Causal | None = None,
                           fa4: bool = False, capacity: int | None = None) -> torch.Tensor:
    """Sparse attention of raster ``q [B, Tq·H·W, heads, d]`` (frames ``[q_start, q_start + Tq)``) over raster
    ``k``/``v`` ``[B, T·H·W, heads, d]`` (frames ``[0, T)``) of the token ``grid`` ``(T, H, W)`` (module doc); ``fa4``:
    run FlashAttention-4 (the caller checked it is installed; taken for CUDA bf16/fp16 only); ``capacity``: slots a
    tile owns (None: :func:`capacity_for`; the tests lay the CPU path out as FA4's). Returns ``[B, Lq, heads, d]`` like
    ``q``. Its callers keep it out of ``torch.compile`` regions (it builds layouts from Python ints per call)."""
    t, h, w = (int(x) for x in grid)
    tile = tuple(int(x) for x in spec.tile)
    tq = q.shape[1] // (h * w)
    if q.shape[1] != tq * h * w or k.shape[1] != t * h * w or q_start + tq > t:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} do not fit the grid {grid} from frame {q_start}")
    if q_start % tile[0]:
        raise ValueError(f"queries from frame {q_start} start inside a tile of {tile[0]} frames")
    use_fa4 = fa4 and fa4_can_run(q) and _fa4_failure is None
    capacity = capacity_for(tile, use_fa4) if capacity is None else int(capacity)
    q_lay = layout((tq, h, w), tile, capacity, q.device)
    k_lay = layout((t, h, w), tile, capacity, q.device)
    allowed = allowed_tiles(q_lay, k_lay, int(q_start), causal)
    sel = select_tiles(q, k, q_lay, k_lay, allowed, spec.sparsity)
    qt, kt, vt = to_tiles(q, q_lay).contiguous(), to_tiles(k, k_lay).contiguous(), to_tiles(v, k_lay).contiguous()
    out = None
    if use_fa4:
        _define_ops()
        try:
            out = _FA4BlockSparse.apply(qt, kt, vt, sel.idx, sel.count, k_lay.complete, key_layout_of(k_lay),
                                        forward_lists(sel, k_lay.complete))
        except Exception as error:  # noqa: BLE001 - the CuTe DSL's compile and launch errors have no common type
            _disable_fa4(error)
    if out is None:  # the same attention in torch (tiles of the FA4 layout: the same function)
        out = gathered_attention(qt, kt, vt, sel, q_lay, k_lay)
    return from_tiles(out, q_lay)


_fa4_failure: str | None = None  # why the block-sparse FA4 kernel failed in this process (then: the torch path)


def _disable_fa4(error: BaseException) -> None:
    """Stop calling the block-sparse FA4 kernel in this process after ``error`` (it could not compile or launch here);
    says so once on stderr. The attention stays right: :func:`gathered_attention` computes the same."""
    global _fa4_failure
    if _fa4_failure is None:
        import sys

        _fa4_failure = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        print(f"block-sparse FlashAttention-4 failed ({_fa4_failure}); the sparse attention runs its torch path",
              file=sys.stderr, flush=True)


def masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: SparseSpec, grid: tuple[int, int, int], *,
                     q_start: int = 0, causal: Causal | None = None) -> torch.Tensor:
    """What :func:`video_sparse_attention` computes, written independently of the tiled layout and the block lists:
    the same selection turned into a token mask in raster order, and masked softmax attention over it in fp32 (what
    the tests compare the sparse path against)."""
    t, h, w = grid
    tile = tuple(spec.tile)
    tq = q.shape[1] // (h * w)
    q_lay, k_lay = layout((tq, h, w), tile, math.prod(tile), q.device), layout((t, h, w), tile, math.prod(tile), q.device)
    sel = select_tiles(q, k, q_lay, k_lay, allowed_tiles(q_lay, k_lay, q_start, causal), spec.sparsity)
    kept = selected_map(sel, k_lay.blocks)  # [B, heads, nq, nk]

    def tile_of(frames: int) -> torch.Tensor:  # raster token of a grid of `frames` frames → its tile's index
        f, r, c = torch.arange(frames)[:, None, None], torch.arange(h)[None, :, None], torch.arange(w)[None, None, :]
        nh, nw = -(-h // tile[1]), -(-w // tile[2])
        return ((f // tile[0] * nh + r // tile[1]) * nw + c // tile[2]).reshape(-1).to(q.device)

    q_tile, k_tile = tile_of(tq), tile_of(t)
    mask = kept[:, :, q_tile][..., k_tile]  # [B, heads, Lq, Lk]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.float()).to(q.dtype)
