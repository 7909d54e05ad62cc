"""Block-causal self-attention and its KV cache: the Self-Forcing student of an exported distilled Wan
samples chunk by chunk through this (stdlib + torch + diffusers only).

Block-causal: latent frame ``f`` is in chunk ``f // chunk_size`` and attends to every token of its own
chunk and of every earlier one. An image-to-video student (``given_first_frame``, from ``sampling.json``) has the
given frame as a block of its own: frame 0, then chunks of ``chunk_size`` from frame 1. Tokens are frame-major after patchify (temporal patch 1), so a chunk
is a contiguous token range and its queries attend a key *prefix*: one SDPA call (diffusers'
attention dispatcher, no mask) per chunk over the keys of frames ``[0, end of its chunk)``.

How a call's plan reaches the attention: :class:`CausalWanDenoiser` sets :data:`_PLAN` for the
transformer call; a forward hook on ``transformer.rope`` returns the rotary ``(cos, sin)`` with the
plan attached (:class:`PlannedRotary`), the positions shifted so the call's first frame sits at
``start_frame``; every block hands it to its ``attn1``, whose :class:`CausalAttnProcessor` reads it.
Outside a planned call the processor is diffusers' ``WanAttnProcessor`` unchanged.

KV cache (per tag; the conditional and unconditional passes keep their own): per block the keys and
values (after ``norm_k`` and RoPE) ``[B, frames · tokens_per_frame, heads, head_dim]`` of the frames
written so far. Streaming calls start at a chunk boundary equal to the cached frame count. Two experts (Wan 2.2
A14B): each expert keeps its own cache (tags ``<tag>@0`` / ``<tag>@1``); a call denoises with the expert of its
timestep against that expert's cache, and a call that stores writes the frames into both experts' caches — as
distillery's ``CausalWanModel`` does.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .distilled_fast import FA4SelfAttnProcessor, attention_output, fa4_attention, fa4_can_run, self_attention_qkv
from .distilled_wan import Conditioning, WanDenoiser, WanLayout
from .sparse_attention import Causal, video_sparse_attention


class AttentionPlan:
    """One transformer call's self-attention: queries are frames ``[start_frame, start_frame + frames)``
    (``tokens_per_frame`` tokens each); keys are ``past[i]`` (block i's cached frames, or none) ⊕ the
    call's own; ``store`` (when not None) receives each block's own keys/values."""

    __slots__ = ("chunk_size", "tokens_per_frame", "start_frame", "frames", "past", "store", "lead", "frame_grid")

    def __init__(self, chunk_size: int, tokens_per_frame: int, start_frame: int, frames: int,
                 past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 store: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None, lead: int = 0,
                 frame_grid: tuple[int, int] | None = None) -> None:
        self.chunk_size, self.tokens_per_frame = chunk_size, tokens_per_frame
        self.start_frame, self.frames, self.past, self.store = start_frame, frames, past, store
        self.lead = lead  # 1: frame 0 is a block of its own (the given first frame)
        self.frame_grid = frame_grid  # a frame's (rows, columns) of tokens: what sparse attention tiles

    def chunk_end(self, frame: int) -> int:
        """The first frame after the chunk that holds ``frame``."""
        if frame < self.lead:
            return self.lead
        return self.lead + ((frame - self.lead) // self.chunk_size + 1) * self.chunk_size

    def query_groups(self) -> list[tuple[int, int, int]]:
        """``(query token begin, query token end, key token end)`` per chunk the call's frames touch
        (queries counted from the call's first token, keys from frame 0 of the video)."""
        groups = []
        frame, end, n = self.start_frame, self.start_frame + self.frames, self.tokens_per_frame
        while frame < end:
            chunk_end = min(self.chunk_end(frame), end)
            groups.append(((frame - self.start_frame) * n, (chunk_end - self.start_frame) * n, chunk_end * n))
            frame = chunk_end
        return groups


_PLAN: contextvars.ContextVar[AttentionPlan | None] = contextvars.ContextVar("distilled_causal_plan", default=None)


class PlannedRotary(NamedTuple):
    """diffusers' rotary ``(freqs_cos, freqs_sin)`` (each ``[1, tokens, 1, head_dim]``) carrying the plan."""

    freqs_cos: torch.Tensor
    freqs_sin: torch.Tensor
    plan: AttentionPlan


def planned_rotary(rope: torch.nn.Module, args: tuple, output: Any, device: Any = "meta", token_dim: int = 1) -> Any:
    """What a forward hook of ``transformer.rope`` returns in a planned call (None outside one): the rotary of frames
    ``[start_frame, start_frame + frames)`` (computed for the whole prefix and sliced) with the plan. ``device``: where
    the whole prefix's shape is made (``meta``: a rope that reads only the shape, Wan's; None: the input's device, for
    one that computes on it, Cosmos'); ``token_dim``: the axis of ``cos``/``sin`` over tokens (Wan's: 1)."""
    plan = _PLAN.get()
    if plan is None:
        return None
    cos, sin = output
    if plan.start_frame:
        b, c, f, h, w = args[0].shape
        whole = torch.empty((b, c, plan.start_frame + f, h, w), device=args[0].device if device is None else device)
        cos_all, sin_all = rope.forward(whole)
        skip = plan.start_frame * plan.tokens_per_frame
        keep = cos_all.shape[token_dim] - skip
        cos, sin = cos_all.narrow(token_dim, skip, keep).contiguous(), sin_all.narrow(token_dim, skip, keep).contiguous()
    return PlannedRotary(cos, sin, plan)


def _rotary_hook(rope: torch.nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook of Wan's ``transformer.rope`` (:func:`planned_rotary`)."""
    return planned_rotary(rope, args, output)


class CausalAttnProcessor:
    """``attn1`` of block ``block_index``: block-causal + KV cache under a plan, else diffusers' ``WanAttnProcessor``
    (or, with ``fa4`` set by :func:`distilled_fast.install_fa4`, FlashAttention-4 for CUDA bf16/fp16 activations)."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, block_index: int) -> None:
        self.block_index = block_index
        self.fa4 = False
        self.sparse = None  # a SparseSpec (distilled_sparse.install_sparse): block-sparse video attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        plan = getattr(rotary_emb, "plan", None)
        if plan is None or encoder_hidden_states is not None:
            if self.fa4 and encoder_hidden_states is None:
                stock = FA4SelfAttnProcessor()
            else:
                from diffusers.models.transformers.transformer_wan import WanAttnProcessor

                stock = WanAttnProcessor()
            stock._attention_backend, stock._parallel_config = self._attention_backend, self._parallel_config
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = self_attention_qkv(attn, hidden_states, (rotary_emb.freqs_cos, rotary_emb.freqs_sin))
        return attention_output(attn, _planned_attention(self, query, key, value, plan), query)


@torch.compiler.disable
def _planned_attention(processor: CausalAttnProcessor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       plan: AttentionPlan) -> torch.Tensor:
    """The call's queries ``[B, L, heads, head_dim]`` (after norm + RoPE) over the cached keys/values ⊕ the call's
    own, one call per chunk over its key prefix; stores the call's keys/values in ``plan.store``. Kept out of
    ``torch.compile`` regions: it reads per-call Python state (the plan, the block index), so compiled blocks stay
    one graph for every block and call."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    if plan.store is not None:
        plan.store[processor.block_index] = (key.detach(), value.detach())
    if plan.past is not None:
        past_k, past_v = plan.past[processor.block_index]
        key = torch.cat([past_k.to(key.dtype), key], dim=1)
        value = torch.cat([past_v.to(value.dtype), value], dim=1)
    sparse = getattr(processor, "sparse", None)  # a Wan processor's (Cosmos' attend densely)
    if sparse is not None:
        rows, cols = plan.frame_grid
        return video_sparse_attention(query, key, value, sparse, (key.shape[1] // (rows * cols), rows, cols),
                                      q_start=plan.start_frame, causal=Causal(plan.chunk_size, plan.lead), fa4=processor.fa4)
    fa4 = processor.fa4 and fa4_can_run(query)
    outs = [fa4_attention(query[:, qb:qe], key[:, :ke], value[:, :ke]) if fa4 else
            dispatch_attention_fn(query[:, qb:qe], key[:, :ke], value[:, :ke], attn_mask=None, dropout_p=0.0,
                                  is_causal=False, backend=processor._attention_backend)
            for qb, qe, ke in plan.query_groups()]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def install_causal_attention(transformer: torch.nn.Module) -> None:
    """Every block's ``attn1`` gets a :class:`CausalAttnProcessor`, ``rope`` the plan hook (idempotent)."""
    blocks = transformer.blocks
    if blocks and isinstance(blocks[0].attn1.processor, CausalAttnProcessor):
        return
    for i, block in enumerate(blocks):
        processor = CausalAttnProcessor(i)
        processor._attention_backend = getattr(block.attn1.processor, "_attention_backend", None)
        block.attn1.set_processor(processor)
    transformer.rope.register_forward_hook(_rotary_hook)


@dataclass
class KVCache:
    """One tag's cache: ``frames`` latent frames; per block ``(k, v)`` ``[B, frames · tokens_per_frame, heads, head_dim]``."""

    frames: int = 0
    tokens_per_frame: int = 0
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class BlockCausalDenoiser:
    """The block-causal half of a causal student's denoiser of any family (a mixin before it: ``class
    Causal<Family>Denoiser(BlockCausalDenoiser, <Family>Denoiser)``, which installs its own processors and gives
    :meth:`plain_velocity`, its velocity as the processors read the plan): the per-tag KV cache, the whole-video
    and streaming calls. Needs ``patch_size`` of the family's denoiser (a temporal patch of 1)."""

    patch_size: tuple[int, int, int]

    def attach_block_causal(self, chunk_size: int, given_first_frame: bool) -> None:
        """``chunk_size`` latent frames per chunk; ``given_first_frame``: frame 0 is a block of its own."""
        if self.patch_size[0] != 1:
            raise ValueError(f"a causal student needs a temporal patch size of 1, got patch_size {self.patch_size}")
        self.chunk_size = int(chunk_size)
        self.given_first_frame = bool(given_first_frame)
        self.lead = 1 if self.given_first_frame else 0
        self.caches: dict[str, KVCache] = {}

    def plain_velocity(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool) -> torch.Tensor:
        raise NotImplementedError  # the family's

    def clear_caches(self, tag: str | None = None) -> None:
        """Forget the cache ``tag`` (every cache when None)."""
        if tag is None:
            self.caches.clear()
        else:
            self.caches.pop(tag, None)

    def _frame_grid(self, x: torch.Tensor) -> tuple[int, int]:
        return x.shape[3] // self.patch_size[1], x.shape[4] // self.patch_size[2]

    def _tokens_per_frame(self, x: torch.Tensor) -> int:
        rows, cols = self._frame_grid(x)
        return rows * cols

    def _planned(self, plan: AttentionPlan, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning,
                 conditional: bool) -> torch.Tensor:
        token = _PLAN.set(plan)
        try:
            return self.plain_velocity(x, timesteps, cond, conditional)
        finally:
            _PLAN.reset(token)

    def velocity(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool = True) -> torch.Tensor:
        """The whole video under the block-causal mask (no cache read or written)."""
        return self._planned(AttentionPlan(self.chunk_size, self._tokens_per_frame(x), 0, x.shape[2], lead=self.lead,
                                           frame_grid=self._frame_grid(x)), x, timesteps, cond, conditional)

    def velocity_streaming(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, *, tag: str,
                           store_kv: bool, start_frame: int, conditional: bool = True) -> torch.Tensor:
        """Frames ``[start_frame, start_frame + f)`` attending to the cache ``tag`` (frames ``[0, start_frame)``)
        and block-causally to themselves; ``store_kv``: append their keys/values to the cache."""
        cache = self.caches.get(tag)
        held = cache.frames if cache is not None else 0
        start = int(start_frame)
        if start != held or ((start - self.lead) % self.chunk_size if start >= self.lead else start):
            raise ValueError(f"cache {tag!r} holds {held} frames; a call must start there, at a chunk boundary "
                             f"(chunks of {self.chunk_size}), not at frame {start_frame}")
        cond = cond.frames(int(start_frame), x.shape[2])  # an image-to-video chunk: its frames' condition
        tokens = self._tokens_per_frame(x)
        past = cache.layers if cache is not None and held else None
        store: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if store_kv else None
        v = self._planned(AttentionPlan(self.chunk_size, tokens, held, x.shape[2], past=past, store=store, lead=self.lead,
                                        frame_grid=self._frame_grid(x)), x, timesteps, cond, conditional)
        if store is not None:
            layers = [store[i] for i in range(len(store))]
            if past is not None:
                layers = [(torch.cat([pk, k], dim=1), torch.cat([pv, v_], dim=1)) for (pk, pv), (k, v_) in zip(past, layers)]
            self.caches[tag] = KVCache(held + x.shape[2], tokens, layers)
        return v


class CausalWanDenoiser(BlockCausalDenoiser, WanDenoiser):
    """:class:`WanDenoiser` attending block-causally over ``chunk_size``-frame chunks, with a KV cache per tag;
    ``given_first_frame``: an image-to-video student whose frame 0 is the given frame (a block of its own)."""

    def __init__(self, transformer: torch.nn.Module, shift: float, chunk_size: int, num_train_timesteps: int = 1000,
                 given_first_frame: bool = False, *, layout: WanLayout | None = None) -> None:
        WanDenoiser.__init__(self, transformer, shift, num_train_timesteps, layout=layout)
        self.attach_block_causal(chunk_size, given_first_frame)
        install_causal_attention(transformer)
        if self.layout.second is not None:  # two experts: each its own processors, plan hook and caches (module doc)
            install_causal_attention(self.layout.second)

    def plain_velocity(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool) -> torch.Tensor:
        return WanDenoiser.velocity(self, x, timesteps, cond, conditional)

    def velocity_streaming(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, *, tag: str,
                           store_kv: bool, start_frame: int, conditional: bool = True) -> torch.Tensor:
        """:meth:`BlockCausalDenoiser.velocity_streaming`; of two experts, through the expert of ``timesteps`` (one for
        the call) against its own cache, the frames of a storing call written to both experts' caches (module doc)."""
        if self.layout.second is None:
            return BlockCausalDenoiser.velocity_streaming(self, x, timesteps, cond, tag=tag, store_kv=store_kv,
                                                          start_frame=start_frame, conditional=conditional)
        low = timesteps < self.boundary_timestep
        if bool((low != low[0]).any()):
            raise ValueError("a streaming call's samples fall to both experts; each call is one expert's")
        expert = int(bool(low[0]))
        out = None
        for e in (0, 1):
            if e != expert and not store_kv:
                continue
            self.routed_expert = e
            try:
                v = BlockCausalDenoiser.velocity_streaming(self, x, timesteps, cond, tag=f"{tag}@{e}", store_kv=store_kv,
                                                           start_frame=start_frame, conditional=conditional)
            finally:
                self.routed_expert = None
            if e == expert:
                out = v
        return out
