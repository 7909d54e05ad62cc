"""Causal Wan 2.1: block-causal attention over chunks of latent frames, with a KV cache for streaming.

Same ``diffusers.WanTransformer3DModel`` and weights as :class:`~distillery.models.wan.WanModel`
(any Wan2.1 folder or an earlier stage's ``transformer/``); ``transformer_config()`` and the state
dict are unchanged, so export and stock loading work as for the bidirectional model. Only the
self-attention (``attn1``) of every block gets a different processor; cross-attention, RoPE, the
time and text embeddings are diffusers' own.

Block-causal: latent frame ``f`` belongs to chunk ``f // chunk_size`` and attends to every token of
its own chunk and of every earlier chunk. An image-to-video student (the folder's transformer takes a first-frame
condition) has the given frame as a block of its own: frame 0, then chunks of ``chunk_size`` from frame 1
(``given_first_frame``, :attr:`~distillery.models.base.CausalModelBase.given_first_frame`). Tokens are frame-major after patchify (patch ``(1, 2, 2)``:
each latent frame is ``H/2 · W/2`` consecutive tokens), so a chunk is a contiguous token range and
the attention of a chunk's queries is plain attention over a key *prefix* — no mask tensor is built:
each chunk's queries run one SDPA call over the keys of frames ``[0, end of its chunk)`` (FlashAttention-4,
:mod:`.attention`: the same prefix calls with ``fa4``, or one block-sparse call skipping the masked tiles with
``fa4_sparse``).

How the plan reaches the attention processors: :meth:`CausalWanModel._forward` sets a context
variable for the duration of the transformer call; a forward hook on ``transformer.rope`` turns it
into the rotary embedding it returns (a :class:`_PlannedRotary`: the ``(cos, sin)`` tuple plus the
plan, with the rotary positions shifted to ``cur_start_frame …`` when streaming). Every block hands
that tuple to ``attn1``, so the plan also survives activation-checkpoint recomputation (the block is
re-run with the same arguments). Without a plan (the hook does nothing outside
:meth:`CausalWanModel._forward`) the processor is diffusers' ``WanAttnProcessor`` unchanged. Hook
and processors are plain picklable objects and module-level functions, so ``copy.deepcopy`` of the
transformer (the bf16 compute copy) carries them. The part that reads per-call Python state (cache,
block index, chunk groups) is kept out of torch.compile regions (:func:`_block_causal_attention`), so
regional compilation of the blocks compiles one graph for all blocks (recompiling only on shapes).

KV cache (per ``cache_tag``): for every block, the keys and values (after ``norm_k`` and RoPE)
``[B, frames · tokens_per_frame, heads, head_dim]`` of the frames stored so far, in the compute
dtype, detached (Self-Forcing writes context without gradient; the current chunk's own computation
keeps its graph).

Two experts (a Wan 2.2 A14B folder, :class:`~distillery.models.wan.experts.WanExperts`): each expert attends through
its own keys and values, so **each keeps its own cache** (tag ``<cache_tag>@0`` for ``transformer``, ``@1`` for
``transformer_2``). A streaming call denoises with the expert of its timestep (every sample of a call must fall to one
expert) against that expert's cache; a call that stores (``store_kv``) writes the frames into both experts' caches —
one forward of each on the same latents at the same timesteps (the context a later step of either expert attends to),
the velocity returned being the call's expert's. The full-sequence forward routes each sample to the expert of its
timesteps (a sample's per-frame timesteps must fall to one expert).
"""

from __future__ import annotations

import contextvars
from abc import abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from distillery.common.errors import UserError
from distillery.config.typed import bounded, check_fields
from distillery.models.base import CausalModelBase, Conditioning, TrainingBatch
from distillery.models.wan.attention import (
    FA4WanAttnProcessor,
    across_sequence_shards,
    attention_output,
    fa4_attention,
    fa4_can_run,
    self_attention_qkv,
    stock_processor,
)
from distillery.models.wan.bidirectional import WanModel
from distillery.models.wan.common import WanModelConfig
from distillery.models.wan.experts import WanExperts, expert_index
from distillery.models.wan.sparse_attention import Causal, causal_problem, video_sparse_attention


@dataclass
class CausalWanModelConfig(WanModelConfig):
    chunk_size: int = bounded(3, 1, 1024)  # latent frames per causal chunk (a frame attends to its chunk and every earlier one)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, "model")  # chunk_size's declared range, for a config built in Python


class _AttentionPlan:
    """What the self-attention of one transformer call does (built by :class:`CausalWanModel`).

    Queries are the call's tokens: frames ``[start_frame, start_frame + frames)`` of the video,
    ``tokens_per_frame`` each. Keys are ``past[i]`` (block i's cached frames ``[0, start_frame)``,
    or none) followed by the call's own keys. ``store``: when not None, block i writes its own
    (detached) keys/values to ``store[i]``.

    Deliberately a plain object (not a dataclass or container): FSDP2's input casting
    (``torch.distributed.utils._apply_to_tensors``) passes it through untouched, so the ``store``
    dict the blocks write to stays the one the model reads.
    """

    __slots__ = ("chunk_size", "tokens_per_frame", "start_frame", "frames", "past", "store", "lead", "frame_grid",
                 "context")

    def __init__(self, chunk_size: int, tokens_per_frame: int, start_frame: int, frames: int,
                 past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 store: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None, lead: int = 0,
                 frame_grid: tuple[int, int] | None = None, context: int = 0) -> None:
        self.chunk_size = chunk_size
        self.frame_grid = frame_grid  # a frame's (rows, columns) of tokens: what sparse attention tiles
        self.tokens_per_frame = tokens_per_frame
        self.start_frame = start_frame
        self.frames = frames
        self.past = past
        self.store = store
        self.lead = lead  # 1: frame 0 is a block of its own (the given first frame), chunks start at frame 1
        # teacher forcing: the call is [clean context of `context` frames | the same frames noisy] (frames = 2·context);
        # a noisy chunk attends to the clean frames before it and to itself, the clean frames block-causally
        self.context = context

    def chunk_end(self, frame: int) -> int:
        """The first frame after the chunk that holds ``frame``."""
        if frame < self.lead:
            return self.lead
        return self.lead + ((frame - self.lead) // self.chunk_size + 1) * self.chunk_size

    def query_groups(self) -> list[tuple[int, int, int]]:
        """``(query token begin, query token end, key token end)`` per chunk the call's frames touch.

        Token indices count the call's queries from 0 and the keys from frame 0 of the video."""
        groups = []
        frame, end = self.start_frame, self.start_frame + self.frames
        while frame < end:
            chunk_end = min(self.chunk_end(frame), end)
            n = self.tokens_per_frame
            groups.append(((frame - self.start_frame) * n, (chunk_end - self.start_frame) * n, chunk_end * n))
            frame = chunk_end
        return groups

    def key_groups(self) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
        """``(query token begin, query token end, key token ranges)`` per group of queries that see the same keys:
        the :meth:`query_groups` (one range, the key prefix) — or, teacher forcing (``context`` T), the clean
        frames' groups over the clean keys, then per chunk ``[s, e)`` its noisy queries over the clean keys of
        frames ``[0, s)`` and its own noisy keys."""
        if not self.context:
            return [(q0, q1, ((0, k1),)) for q0, q1, k1 in self.query_groups()]
        t, n = self.context, self.tokens_per_frame
        clean = _AttentionPlan(self.chunk_size, n, 0, t, lead=self.lead)
        groups = [(q0, q1, ((0, k1),)) for q0, q1, k1 in clean.query_groups()]
        for q0, q1, _ in clean.query_groups():  # the noisy copy of each chunk: clean past ⊕ its own noisy frames
            past = ((0, q0),) if q0 else ()
            groups.append((t * n + q0, t * n + q1, (*past, (t * n + q0, t * n + q1))))
        return groups


_PLAN: contextvars.ContextVar[_AttentionPlan | None] = contextvars.ContextVar("distillery_causal_wan_plan", default=None)


class _PlannedRotary(NamedTuple):
    """diffusers' rotary ``(freqs_cos, freqs_sin)`` (each ``[1, tokens, 1, head_dim]``) carrying the plan.

    A named tuple: FSDP2 rebuilds named tuples field by field when it casts block inputs, so the
    plan survives (and cos/sin are cast as the stock rotary tuple would be)."""

    freqs_cos: torch.Tensor
    freqs_sin: torch.Tensor
    plan: _AttentionPlan


def planned_rotary(rope: torch.nn.Module, args: tuple, output: Any, device: Any = "meta", token_dim: int = 1) -> Any:
    """What a forward hook of a family's ``transformer.rope`` returns inside a planned call (None outside one): its
    ``(cos, sin)`` as a :class:`_PlannedRotary` carrying the plan, the rotary positions shifted so the call's first frame
    sits at ``start_frame`` (computed for the whole ``start_frame + frames`` and sliced: the exact values the rope gives
    those frames; under teacher forcing the ``context`` frames' positions twice: clean frame i and noisy frame i sit at
    position i). ``device``: where that whole-video shape is made (``meta`` for a rope that reads only the shape and
    computes on its own buffers, Wan's; None: the input's own device, for one that computes on it, Cosmos');
    ``token_dim``: the axis of ``cos``/``sin`` that runs over tokens (Wan's ``[1, tokens, 1, head_dim]``: 1)."""
    plan = _PLAN.get()
    if plan is None:
        return None
    cos, sin = output
    if plan.context:
        b, c, f, h, w = args[0].shape
        half = torch.empty((b, c, plan.context, h, w), device=args[0].device if device is None else device)
        cos, sin = rope.forward(half)
        cos, sin = torch.cat([cos, cos], dim=token_dim), torch.cat([sin, sin], dim=token_dim)
    elif plan.start_frame:
        b, c, f, h, w = args[0].shape
        whole = torch.empty((b, c, plan.start_frame + f, h, w), device=args[0].device if device is None else device)
        cos_all, sin_all = rope.forward(whole)
        skip = plan.start_frame * plan.tokens_per_frame
        keep = cos_all.shape[token_dim] - skip
        cos, sin = cos_all.narrow(token_dim, skip, keep).contiguous(), sin_all.narrow(token_dim, skip, keep).contiguous()
    return _PlannedRotary(cos, sin, plan)


def _plan_rotary_hook(rope: torch.nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook of Wan's ``transformer.rope`` (:func:`planned_rotary` on the meta device)."""
    return planned_rotary(rope, args, output)


class CausalWanAttnProcessor:
    """Self-attention of block ``block_index``: block-causal (+ KV cache) under a plan, diffusers'
    ``WanAttnProcessor`` otherwise. SDPA runs through diffusers' dispatcher, so the backend chosen with
    ``set_attention_backend`` (stored in ``_attention_backend``) applies; no mask is ever passed. With
    ``fa4_mode`` set (``prefix`` | ``sparse``, :mod:`.attention`) and CUDA bf16/fp16 activations the
    self-attention runs through the FA4 op instead."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, block_index: int, fa4_mode: str | None = None) -> None:
        self.block_index = block_index
        self.fa4_mode = fa4_mode
        self.sparse = None  # a SparseSpec: block-sparse video attention (models/wan/sparse.py)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        plan = getattr(rotary_emb, "plan", None)
        if plan is None or encoder_hidden_states is not None:
            sharded = getattr(rotary_emb, "sequence_parallel", None) is not None
            if (self.fa4_mode is not None or sharded) and encoder_hidden_states is None:  # an unplanned self-attention:
                proc = FA4WanAttnProcessor(self.fa4_mode)  # plain FA4 (or SDPA across sequence shards)
                proc._attention_backend, proc._parallel_config = self._attention_backend, self._parallel_config
                return proc(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
            return stock_processor(self)(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = self_attention_qkv(attn, hidden_states, rotary_emb.freqs_cos, rotary_emb.freqs_sin)
        hidden_states = across_sequence_shards(rotary_emb, lambda q, k, v: _block_causal_attention(self, q, k, v, plan),
                                               query, key, value)
        return attention_output(attn, hidden_states, query)


def _block_causal_attention(processor: CausalWanAttnProcessor, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, plan: _AttentionPlan) -> torch.Tensor:
    """Attention of the call's queries ``[B, L, heads, head_dim]`` (after norm + RoPE) over the cached
    keys/values ⊕ the call's own, block-causally; writes the call's keys/values to ``plan.store``. Under sequence
    parallelism it runs between the all-to-alls (:func:`~.attention.across_sequence_shards`): every token of the
    call, this rank's heads — so the KV cache a rank keeps holds its heads of every cached token.
    Returns ``[B, L, heads, head_dim]``. Kept out of torch.compile regions (it reads per-call Python
    state: the plan and the block index), so a compiled block is one graph for every block and call.

    SDPA: one call per chunk, its queries over the key prefix up to the chunk's end; FA4 (``fa4_mode`` set, CUDA
    bf16/fp16): :func:`fa4_block_causal`."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    index = processor.block_index
    if plan.store is not None:
        plan.store[index] = (key.detach(), value.detach())
    if plan.past is not None:
        past_k, past_v = plan.past[index]
        key = torch.cat([past_k.to(key.dtype), key], dim=1)
        value = torch.cat([past_v.to(value.dtype), value], dim=1)
    if getattr(processor, "sparse", None) is not None:
        if plan.context:  # its tiles know the block-causal chunks, not the [clean | noisy] halves
            raise UserError("teacher forcing (pretrain.method tfsft, causal_cd) does not take trained sparse attention "
                            "yet; train the student dense")
        rows, cols = plan.frame_grid
        return video_sparse_attention(query, key, value, processor.sparse, (key.shape[1] // (rows * cols), rows, cols),
                                      q_start=plan.start_frame, causal=Causal(plan.chunk_size, plan.lead),
                                      fa4=processor.fa4_mode is not None)
    if processor.fa4_mode is not None and fa4_can_run(query):
        return fa4_block_causal(query, key, value, plan, processor.fa4_mode)
    outs = []
    for q_begin, q_end, ranges in plan.key_groups():
        k, v = _key_ranges(key, ranges), _key_ranges(value, ranges)
        outs.append(dispatch_attention_fn(query[:, q_begin:q_end], k, v, attn_mask=None,
                                          dropout_p=0.0, is_causal=False, backend=processor._attention_backend))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _key_ranges(keys: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The token ranges ``ranges`` of ``keys`` ``[B, L, heads, head_dim]`` in order (one range: a view)."""
    if len(ranges) == 1:
        begin, end = ranges[0]
        return keys[:, begin:end]
    return torch.cat([keys[:, begin:end] for begin, end in ranges], dim=1)


def block_causal_attention(processor: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           plan: _AttentionPlan) -> torch.Tensor:
    """:func:`_block_causal_attention` for another family's processor (``block_index``, ``fa4_mode``,
    ``_attention_backend``): the one kept out of torch.compile once a model installed its processors."""
    return _block_causal_attention(processor, query, key, value, plan)


def keep_block_causal_attention_out_of_compile() -> None:
    """What a family's processor installer calls first (:func:`_keep_block_causal_attention_out_of_compile`)."""
    _keep_block_causal_attention_out_of_compile()


def fa4_block_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: _AttentionPlan, mode: str) -> torch.Tensor:
    """The FA4 op's block-causal attention of ``plan``'s queries over ``key``/``value`` (the cached frames ⊕ the
    call's own, from frame 0): ``prefix``: one plain call per chunk over its key prefix; ``sparse``: one
    block-sparse call with the chunk layout (``chunk_size · tokens_per_frame`` tokens per chunk, the queries
    starting at token ``start_frame · tokens_per_frame``), or one plain call when the call is one chunk. A
    teacher-forcing call (:attr:`_AttentionPlan.context`) runs one plain call per group of its key groups."""
    groups = plan.key_groups()
    # the block-sparse layout: equal chunks from frame 0 (a given frame 0 then chunks of 1 is one; of more, per-chunk calls)
    uniform = (not plan.lead or plan.chunk_size == 1) and not plan.context
    if mode == "sparse" and len(groups) > 1 and uniform:
        return fa4_attention(query, key, value, chunk_tokens=plan.chunk_size * plan.tokens_per_frame,
                             q_offset=plan.start_frame * plan.tokens_per_frame)
    outs = [fa4_attention(query[:, q_begin:q_end], _key_ranges(key, ranges), _key_ranges(value, ranges))
            for q_begin, q_end, ranges in groups]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _keep_block_causal_attention_out_of_compile() -> None:
    """Put :func:`_block_causal_attention` behind ``torch.compiler.disable`` (once, when a model first installs the
    processors, before any compile can trace them): done at import, it would import ``torch._dynamo`` (~0.8 s of CPU)
    in every process that reads only this module's config class, as a training stage checking its run config."""
    global _block_causal_attention
    if not getattr(_block_causal_attention, "_kept_out_of_compile", False):
        disabled = torch.compiler.disable(_block_causal_attention)
        disabled._kept_out_of_compile = True
        _block_causal_attention = disabled


def install_causal_attention(transformer: torch.nn.Module) -> None:
    """Give every block's ``attn1`` a :class:`CausalWanAttnProcessor` and ``rope`` the plan hook
    (idempotent; keeps the attention backend already chosen, FA4 included)."""
    _keep_block_causal_attention_out_of_compile()
    blocks = transformer.blocks
    if blocks and isinstance(blocks[0].attn1.processor, CausalWanAttnProcessor):
        return
    for i, block in enumerate(blocks):
        processor = CausalWanAttnProcessor(i, getattr(block.attn1.processor, "fa4_mode", None))
        processor._attention_backend = getattr(block.attn1.processor, "_attention_backend", None)
        block.attn1.set_processor(processor)
    transformer.rope.register_forward_hook(_plan_rotary_hook)


@dataclass
class _KVCache:
    """One tag's cache: ``frames`` latent frames, per block ``(k, v)`` ``[B, frames · tokens_per_frame, heads, head_dim]``."""

    frames: int = 0
    tokens_per_frame: int = 0
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _frames_of(batch: Conditioning | TrainingBatch, start: int, frames: int) -> Conditioning | TrainingBatch:
    """``batch`` with an image-to-video first-frame condition cut to latent frames ``[start, start + frames)`` (a
    streaming call's chunk: the condition is per frame, aligned with the latents); as it is without one."""
    first = getattr(batch, "first_frame", None)
    if first is None or first.shape[2] == frames:
        return batch
    return replace(batch, first_frame=first[:, :, start:start + frames])


class BlockCausalModel(CausalModelBase):
    """The block-causal half of a causal student of any family (Wan's :class:`CausalWanModel`, Cosmos'): the plan of
    each call (:class:`_AttentionPlan`), the per-tag KV cache and its bookkeeping, the full-sequence and streaming
    forwards. The family's plugin (``class Causal<Family>Model(BlockCausalModel, <Family>Model)``) calls
    :meth:`attach_block_causal` after building its transformer (it installs its own attention processors, which read
    the plan through its rope) and gives :meth:`_forward`: its transformer's velocity under a plan."""

    def attach_block_causal(self, chunk_size: int, given_first_frame: bool) -> None:
        """``chunk_size`` latent frames per chunk; ``given_first_frame``: frame 0 is a block of its own (an image-to-video
        student). Needs a temporal patch size of 1 (a chunk is a whole number of tokens per frame)."""
        if tuple(self.patch_size)[0] != 1:
            raise ValueError(f"a causal student needs a temporal patch size of 1, got patch_size {self.patch_size}")
        self.chunk_size = int(chunk_size)
        self.given_first_frame = bool(given_first_frame)
        self._lead = 1 if self.given_first_frame else 0
        self._caches: dict[str, _KVCache] = {}

    @abstractmethod
    def _forward(self, plan: _AttentionPlan, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                 batch: Conditioning | TrainingBatch, conditional: bool) -> torch.Tensor:
        """The family's velocity ``[B, C, f, H, W]`` (float32) of one call with ``plan`` in force (:data:`_PLAN`)."""

    # --- cache bookkeeping -------------------------------------------------------------------
    def clear_caches(self, cache_tag: str | None = None) -> None:
        if cache_tag is None:
            self._caches.clear()
        else:
            self._caches.pop(cache_tag, None)

    def cached_frames(self, cache_tag: str) -> int:
        cache = self._caches.get(cache_tag)
        return cache.frames if cache is not None else 0

    # --- forward -----------------------------------------------------------------------------
    def _tokens_per_frame(self, latents: torch.Tensor) -> int:
        rows, cols = self._frame_grid(latents)
        return rows * cols

    def _frame_grid(self, latents: torch.Tensor) -> tuple[int, int]:
        """A latent frame's tokens after patchify: ``(rows, columns)``."""
        _, p_h, p_w = self.patch_size
        return latents.shape[3] // p_h, latents.shape[4] // p_w

    def predict_noise(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        conditional: bool = True,
    ) -> torch.Tensor:
        """Velocity ``[B, C, T, H, W]`` (float32) of the whole video under the block-causal mask;
        ``timesteps`` ``[B]`` or per-frame ``[B, T]`` in [0, 1000]. No cache is read or written."""
        plan = _AttentionPlan(self.chunk_size, self._tokens_per_frame(noisy_latents), 0, noisy_latents.shape[2],
                              lead=self._lead, frame_grid=self._frame_grid(noisy_latents))
        return self._forward(plan, noisy_latents, timesteps, batch, conditional)

    def predict_noise_teacher_forcing(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        clean_latents: torch.Tensor,
        conditional: bool = True,
    ) -> torch.Tensor:
        """Velocity ``[B, C, T, H, W]`` (float32) of the noisy video under teacher forcing (the
        :class:`~distillery.models.base.CausalModelBase` contract): one call over ``[clean | noisy]`` (2T frames; the
        clean copy at t = 0, frame i of both at rotary position i), the plan's :meth:`_AttentionPlan.key_groups`
        masking it; the noisy half's output is returned. Gradients reach the weights through both halves."""
        if self.given_first_frame:
            raise UserError(f"models.{self.role}: teacher forcing of an image-to-video student is not supported")
        if clean_latents.shape != noisy_latents.shape:
            raise ValueError(f"clean context {tuple(clean_latents.shape)} does not match {tuple(noisy_latents.shape)}")
        frames = noisy_latents.shape[2]
        per_frame = timesteps if timesteps.ndim == 2 else timesteps[:, None].expand(-1, frames)
        both = torch.cat([torch.zeros_like(per_frame), per_frame], dim=1)
        hidden = torch.cat([clean_latents.to(noisy_latents.dtype), noisy_latents], dim=2)
        plan = _AttentionPlan(self.chunk_size, self._tokens_per_frame(noisy_latents), 0, 2 * frames, context=frames)
        return self._forward(plan, hidden, both, batch, conditional)[:, :, frames:]

    def predict_noise_streaming(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        *,
        cache_tag: str,
        store_kv: bool,
        cur_start_frame: int,
        conditional: bool = True,
    ) -> torch.Tensor:
        """Velocity ``[B, C, f, H, W]`` (float32) of frames ``[cur_start_frame, cur_start_frame + f)``
        attending to the cache ``cache_tag`` (frames ``[0, cur_start_frame)``) and, block-causally,
        to themselves. ``store_kv``: append these frames' keys/values (computed from these latents
        at these timesteps) to the cache. Runs under the caller's grad mode; the cache is detached.
        A call may cover several chunks (block-causal among them); it must start at a chunk boundary
        (a chunk stored in pieces would not have seen its own later frames). Raises ``ValueError``
        when ``cur_start_frame`` is not the number of cached frames or not a chunk boundary (a multiple of
        ``chunk_size``; with ``given_first_frame``: 0, or 1 + a multiple), or the batch size / frame size differs
        from the cached frames'.
        """
        cache = self._caches.get(cache_tag)
        held = cache.frames if cache is not None else 0
        if int(cur_start_frame) != held:
            raise ValueError(f"cache {cache_tag!r} holds {held} frames; a chunk starting at frame {cur_start_frame} "
                             "does not follow them")
        start = int(cur_start_frame)
        if (start - self._lead) % self.chunk_size if start >= self._lead else start:
            raise ValueError(f"a streaming call starts at frame {cur_start_frame}, inside a chunk of {self.chunk_size} "
                             "frames" + (" (after the given frame 0)" if self._lead else "")
                             + "; calls start at chunk boundaries (the cache holds whole chunks)")
        tokens = self._tokens_per_frame(noisy_latents)
        past = None
        if cache is not None and held:
            k0 = cache.layers[0][0]
            if cache.tokens_per_frame != tokens or k0.shape[0] != noisy_latents.shape[0]:
                raise ValueError(f"cache {cache_tag!r} holds batch {k0.shape[0]} × {cache.tokens_per_frame} tokens per "
                                 f"frame; got batch {noisy_latents.shape[0]} × {tokens}")
            past = cache.layers
        store: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if store_kv else None
        plan = _AttentionPlan(self.chunk_size, tokens, held, noisy_latents.shape[2], past=past, store=store, lead=self._lead,
                              frame_grid=self._frame_grid(noisy_latents))
        v = self._forward(plan, noisy_latents, timesteps, _frames_of(batch, held, noisy_latents.shape[2]), conditional)
        if store is not None:
            layers = [store[i] for i in range(len(store))]
            if past is not None:
                layers = [(torch.cat([pk, k], dim=1), torch.cat([pv, v_], dim=1)) for (pk, pv), (k, v_) in zip(past, layers)]
            self._caches[cache_tag] = _KVCache(held + noisy_latents.shape[2], tokens, layers)
        return v


def install_causal_attention_in(module: torch.nn.Module) -> None:
    """:func:`install_causal_attention` in ``module``, each of two experts' transformers (:class:`WanExperts`)."""
    for transformer in (module.experts if isinstance(module, WanExperts) else (module,)):
        install_causal_attention(transformer)


class CausalWanModel(BlockCausalModel, WanModel):
    """Wan 2.1 with block-causal attention over ``chunk_size``-frame chunks and a per-tag KV cache.

    ``predict_noise`` (full sequence, training with teacher forcing / DFSFT) applies the block-causal
    mask to the whole video; ``predict_noise_streaming`` runs one chunk against the cache. For the
    same latents and timesteps, streaming chunk by chunk (``store_kv=True``) gives each chunk the
    output the full-sequence call gives it. With ``chunk_size`` ≥ the number of frames the full call
    is the bidirectional :class:`WanModel`.

    An image-to-video folder makes it a ``given_first_frame`` student, always: frame 0 is a block of its own (it
    attends to itself only, every later frame attends to it) and streaming chunks start at frame 1. The model only
    lays the blocks out; the callers put the given frame's clean latent at t = 0 there
    (:func:`~distillery.models.base.given_first_latent`) and leave frame 0 out of their losses.
    """

    config_class = CausalWanModelConfig
    two_experts = True  # a Wan 2.2 A14B folder: one cache per expert (module doc)

    def __init__(self, config: CausalWanModelConfig, role: str, transformer: torch.nn.Module | None = None) -> None:
        WanModel.__init__(self, config, role, transformer)
        self.attach_block_causal(config.chunk_size, self.image_conditioning is not None)  # an I2V student: frame 0 given
        install_causal_attention_in(self.transformer)
        if self.sparse is not None:
            problem = causal_problem(self.sparse.tile, self.chunk_size, self._lead)
            if problem:
                raise UserError(f"config error: models.{role}: sparse_tile {list(self.sparse.tile)}: {problem}")
        self._set_sparse(self.transformer)

    def _set_sparse(self, module: torch.nn.Module) -> None:
        """Give ``module``'s causal processors (each expert's, of two) this plugin's sparse attention (None: dense),
        where they lack it."""
        for transformer in (module.experts if isinstance(module, WanExperts) else (module,)):
            if transformer.blocks and transformer.blocks[0].attn1.processor.sparse != self.sparse:
                for block in transformer.blocks:
                    block.attn1.processor.sparse = self.sparse

    def _forward(self, plan: _AttentionPlan, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                 batch: Conditioning | TrainingBatch, conditional: bool) -> torch.Tensor:
        module = self.forward_module
        install_causal_attention_in(module)  # a compute copy made before this plugin existed
        self._set_sparse(module)
        token = _PLAN.set(plan)
        try:
            return WanModel.predict_noise(self, noisy_latents, timesteps, batch, conditional)
        finally:
            _PLAN.reset(token)

    # --- two experts: a cache per expert (module doc) -------------------------------------------
    def _expert_tags(self, cache_tag: str) -> list[str]:
        return [f"{cache_tag}@{e}" for e in (0, 1)] if self.experts else [cache_tag]

    def clear_caches(self, cache_tag: str | None = None) -> None:
        if cache_tag is None:
            BlockCausalModel.clear_caches(self)
            return
        for tag in self._expert_tags(cache_tag):
            BlockCausalModel.clear_caches(self, tag)

    def cached_frames(self, cache_tag: str) -> int:
        return BlockCausalModel.cached_frames(self, self._expert_tags(cache_tag)[0])

    def predict_noise_streaming(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        *,
        cache_tag: str,
        store_kv: bool,
        cur_start_frame: int,
        conditional: bool = True,
    ) -> torch.Tensor:
        """:meth:`BlockCausalModel.predict_noise_streaming`; of two experts, through the expert of ``timesteps`` against
        its own cache, and — ``store_kv`` — the frames written to both experts' caches (module doc). A call whose
        samples fall to both experts is a ``ValueError``."""
        if not self.experts:
            return BlockCausalModel.predict_noise_streaming(
                self, noisy_latents, timesteps, batch, cache_tag=cache_tag, store_kv=store_kv,
                cur_start_frame=cur_start_frame, conditional=conditional)
        assert self.boundary_timestep is not None
        which = expert_index(timesteps, self.boundary_timestep)
        if bool((which != which[0]).any()):
            raise ValueError(f"a streaming call's samples fall to both experts (timesteps {timesteps.tolist()}, boundary "
                             f"{self.boundary_timestep:g}); each call is one expert's")
        expert = int(which[0])
        out: torch.Tensor | None = None
        for e, tag in enumerate(self._expert_tags(cache_tag)):
            if e != expert and not store_kv:
                continue
            self._routed_expert = e
            try:
                v = BlockCausalModel.predict_noise_streaming(self, noisy_latents, timesteps, batch, cache_tag=tag,
                                                             store_kv=store_kv, cur_start_frame=cur_start_frame,
                                                             conditional=conditional)
            finally:
                self._routed_expert = None
            if e == expert:
                out = v
        assert out is not None
        return out
