"""Where a ``WanTransformer3DModel``'s token sequence is split over an SP group and put back together.

Ulysses sequence parallelism (:mod:`distillery.components.sequence_parallel`) on diffusers' Wan forward, through
hooks (the forward itself is diffusers' own; :func:`install_sequence_parallel` adds them once per transformer):

- the transformer's forward (pre-hook): the call's sequence length ``tokens`` (latent frames × height × width over
  the patch) is recorded for the call, and per-token timesteps ``[B, tokens]`` (Wan 2.2 TI2V-5B; per-frame ones of a
  causal student) are cut to this rank's shard, so the time embedding and the output modulation are per shard;
- ``patch_embedding`` (forward hook): its ``[B, C, F, H, W]`` output becomes this rank's shard of the flattened
  tokens, ``[B, C, n]`` — diffusers' ``flatten(2).transpose(1, 2)`` then gives the blocks ``[B, n, C]``;
- ``rope`` (forward hook, after a causal plan's own): the rotary tables are cut to the shard, and travel as a
  :class:`ShardedRotary` that also carries the group and ``tokens`` (and a causal plan, a sparse attention's token
  grid), so every block's
  self-attention — recomputed under activation checkpointing too — knows the call is sharded
  (:func:`~distillery.models.wan.attention.across_sequence_shards`: all-to-all, attention, all-to-all);
- ``proj_out`` (forward hook, after a PDD head bank's): the per-token output is gathered from every rank, the
  pads dropped, before diffusers unpatchifies it.

Every self-attention processor must take a :class:`ShardedRotary`: diffusers' stock ``WanAttnProcessor`` is replaced
by :class:`~distillery.models.wan.attention.FA4WanAttnProcessor` (SDPA, or FA4 with its mode); the causal processor
takes it as is. Cross-attention (text keys, no rotary) and everything per token are untouched.
"""

from __future__ import annotations

import contextvars
import math
from typing import Any, NamedTuple

import torch

from distillery.components.sequence_parallel import SequenceParallel
from distillery.models.wan.attention import FA4WanAttnProcessor


class ShardedRotary(NamedTuple):
    """The rotary tables of this rank's tokens (each ``[1, n, 1, head_dim]``), the SP group, the call's sequence
    length ``tokens`` (before padding), the causal plan the rotary carried (None: bidirectional) and the token grid
    (:mod:`.sparse`; None: dense attention)."""

    freqs_cos: torch.Tensor
    freqs_sin: torch.Tensor
    sequence_parallel: SequenceParallel
    tokens: int
    plan: Any = None
    grid: Any = None  # the call's token grid (frames, rows, columns) a sparse attention's rope hook attached


class _Call(NamedTuple):
    sp: SequenceParallel
    tokens: int


# While a sharded transformer call runs: its group and sequence length (read by the hooks below; outside the blocks,
# so nothing reads it under activation-checkpoint recomputation).
_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("distillery_wan_sequence_parallel", default=None)


def _tokens(module: torch.nn.Module, latents: torch.Tensor) -> int:
    return math.prod(size // patch for size, patch in zip(latents.shape[2:], module.config.patch_size))


def _start_call(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    sp: SequenceParallel = module._distillery_sequence_parallel
    latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    tokens = _tokens(module, latents)
    module._distillery_sequence_calls.append(_CALL.set(_Call(sp, tokens)))
    timestep = kwargs.get("timestep")
    if timestep is not None and timestep.ndim == 2:  # per token: this rank's
        if timestep.shape[1] != tokens:
            raise ValueError(f"per-token timesteps {tuple(timestep.shape)} do not match the call's {tokens} tokens")
        kwargs = {**kwargs, "timestep": sp.shard(timestep, dim=1)}
    return args, kwargs


def _end_call(module: torch.nn.Module, args: tuple, output: Any) -> None:
    del args, output
    if module._distillery_sequence_calls:
        _CALL.reset(module._distillery_sequence_calls.pop())


def _shard_patches(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    call = _CALL.get()
    if call is None:
        return None
    return call.sp.shard(output.flatten(2), dim=2)  # [B, C, n]: flatten(2) leaves it, transpose(1, 2) makes [B, n, C]


def _shard_rotary(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    call = _CALL.get()
    if call is None:
        return None
    cos, sin = output[0], output[1]
    return ShardedRotary(call.sp.shard(cos, dim=1), call.sp.shard(sin, dim=1), call.sp, call.tokens,
                         getattr(output, "plan", None), getattr(output, "grid", None))


def _gather_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    call = _CALL.get()
    if call is None:
        return None
    return call.sp.gather(output, call.tokens, dim=1)


def install_sequence_parallel(transformer: torch.nn.Module, sp: SequenceParallel) -> None:
    """Shard every forward of ``transformer`` (a ``WanTransformer3DModel``) over ``sp`` (module doc); idempotent.
    Install after the model's own hooks (a causal plan's rotary, a PDD head bank's projection): these run last."""
    if getattr(transformer, "_distillery_sequence_parallel", None) is not None:
        transformer._distillery_sequence_parallel = sp
        return
    for block in transformer.blocks:
        processor = block.attn1.processor
        if not hasattr(processor, "fa4_mode"):  # diffusers' own: ours takes a sharded rotary (SDPA, as diffusers')
            ours = FA4WanAttnProcessor(None)
            ours._attention_backend, ours._parallel_config = processor._attention_backend, processor._parallel_config
            block.attn1.set_processor(ours)
    transformer._distillery_sequence_parallel = sp
    transformer._distillery_sequence_calls = []  # the context tokens of the calls running (one, or none)
    # outside torch.compile (a whole-model compile steps around them: they read the call's context variable)
    transformer.register_forward_pre_hook(torch.compiler.disable(_start_call), with_kwargs=True)
    transformer.register_forward_hook(torch.compiler.disable(_end_call), always_call=True)
    transformer.patch_embedding.register_forward_hook(torch.compiler.disable(_shard_patches))
    transformer.rope.register_forward_hook(torch.compiler.disable(_shard_rotary))
    transformer.proj_out.register_forward_hook(torch.compiler.disable(_gather_output))
