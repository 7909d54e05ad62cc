"""Causal Cosmos: block-causal self-attention over chunks of latent frames with a KV cache for streaming — the
family-agnostic half (:class:`~distillery.models.wan.causal.BlockCausalModel`: the plan, the cache, the full-sequence
and streaming forwards, written once) over :class:`CosmosModel`'s inputs.

Only every block's self-attention (``attn1``) gets another processor (:class:`CausalCosmosAttnProcessor`): under a
plan it computes the query, key and value as diffusers' ``CosmosAttnProcessor2_0`` does (projections, ``norm_q`` /
``norm_k``, the rotary embedding) and attends block-causally over the cached keys ⊕ its own; without one it is the
stock processor. The plan reaches it through a forward hook on ``transformer.rope`` (the rotary ``(cos, sin)`` carrying
the plan, its positions shifted to the call's first frame). Cross-attention, the time embedding, the condition mask
are the stock model's. A config with a learnable position embedding (``extra_pos_embed_type: learnable``, Cosmos 1.0's,
indexed by frame position outside the rope) is refused in one line: a streaming chunk would get frame 0's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.config.typed import bounded, check_fields
from distillery.models.base import Conditioning, TrainingBatch
from distillery.models.cosmos.bidirectional import CosmosModel
from distillery.models.cosmos.common import CosmosModelConfig
from distillery.models.wan.causal import (
    _PLAN,
    BlockCausalModel,
    _AttentionPlan,
    block_causal_attention,
    keep_block_causal_attention_out_of_compile,
    planned_rotary,
)


@dataclass
class CausalCosmosModelConfig(CosmosModelConfig):
    chunk_size: int = bounded(3, 1, 1024)  # latent frames per causal chunk (a frame attends to its chunk and every earlier one)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, "model")  # chunk_size's declared range, for a config built in Python


def _cosmos_rotary_hook(rope: torch.nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook of Cosmos' ``transformer.rope`` (it computes on its input's device; ``cos``/``sin`` are
    ``[tokens, head_dim]``)."""
    return planned_rotary(rope, args, output, device=None, token_dim=0)


class CausalCosmosAttnProcessor:
    """Self-attention of block ``block_index``: block-causal (+ KV cache) under a plan, diffusers'
    ``CosmosAttnProcessor2_0`` otherwise (module doc). A plain picklable object (the bf16 compute copy carries it)."""

    _attention_backend = None
    _parallel_config = None
    fa4_mode = None  # FlashAttention-4 is installed into Wan's attention only

    def __init__(self, block_index: int) -> None:
        self.block_index = block_index

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0

        plan = getattr(image_rotary_emb, "plan", None)
        if plan is None or encoder_hidden_states is not None:
            return CosmosAttnProcessor2_0()(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2))
        key = attn.norm_k(attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        rotary = (image_rotary_emb.freqs_cos, image_rotary_emb.freqs_sin)
        query = apply_rotary_emb(query, rotary, use_real=True, use_real_unbind_dim=-2)
        key = apply_rotary_emb(key, rotary, use_real=True, use_real_unbind_dim=-2)
        out = block_causal_attention(self, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), plan)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def install_causal_cosmos_attention(transformer: torch.nn.Module) -> None:
    """Give every block's ``attn1`` a :class:`CausalCosmosAttnProcessor` and ``rope`` the plan hook (idempotent)."""
    keep_block_causal_attention_out_of_compile()
    blocks = transformer.transformer_blocks
    if blocks and isinstance(blocks[0].attn1.processor, CausalCosmosAttnProcessor):
        return
    for i, block in enumerate(blocks):
        block.attn1.set_processor(CausalCosmosAttnProcessor(i))
    transformer.rope.register_forward_hook(_cosmos_rotary_hook)


class CausalCosmosModel(BlockCausalModel, CosmosModel):
    """Cosmos Predict 2.5 with block-causal attention over ``chunk_size``-frame chunks and a per-tag KV cache (the
    contract of :class:`~distillery.models.base.CausalModelBase`; text-to-world: no given first frame)."""

    config_class = CausalCosmosModelConfig

    def __init__(self, config: CausalCosmosModelConfig, role: str, transformer: torch.nn.Module | None = None) -> None:
        CosmosModel.__init__(self, config, role, transformer)
        if self.transformer.config.get("extra_pos_embed_type"):
            raise UserError(f"models.{role}: {self.transformer_dir}: a learnable position embedding "
                            f"({self.transformer.config.get('extra_pos_embed_type')}) is indexed by frame outside the rope; "
                            "a causal Cosmos student streams Cosmos Predict 2.5's layout (none) only")
        self.attach_block_causal(config.chunk_size, False)
        install_causal_cosmos_attention(self.transformer)

    def _forward(self, plan: _AttentionPlan, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                 batch: Conditioning | TrainingBatch, conditional: bool) -> torch.Tensor:
        install_causal_cosmos_attention(self.forward_module)  # a compute copy made before this plugin existed
        token = _PLAN.set(plan)
        try:
            return CosmosModel.predict_noise(self, noisy_latents, timesteps, batch, conditional)
        finally:
            _PLAN.reset(token)
