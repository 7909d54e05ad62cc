"""The denoiser an exported distilled Cosmos Predict 2.5 samples through: a thin wrapper over the pipeline's own
``CosmosTransformer3DModel`` (stdlib + torch only; no weights are copied), fed as ``Cosmos2_5_PredictBasePipeline``
feeds it for text-to-world and as distillery's ``CosmosModel`` does (its module doc has the mapping):

- the timestep is σ = ``t / num_train_timesteps`` per latent frame, ``[B, 1, T, 1, 1]`` float32;
- the condition mask is zeros ``[B, 1, T, H, W]`` (no given frame); the padding mask, where the config concatenates
  one (``concat_padding_mask``), zeros ``[1, 1, H, W]``;
- the output is the velocity ``v = ε − x0`` as it is (float32 ``[B, C, T, H, W]``).

:class:`PDDCosmosDenoiser` is a PDD student's: the same trunk, its heads (:class:`distilled_wan.HeadBankDenoiser`);
:class:`CausalCosmosDenoiser` a causal student's: block-causal self-attention and its KV cache
(:class:`distilled_causal.BlockCausalDenoiser`), each block's ``attn1`` computing query, key and value as diffusers'
``CosmosAttnProcessor2_0`` does, the plan reaching it through a hook on ``transformer.rope``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .distilled_causal import BlockCausalDenoiser, _planned_attention, planned_rotary
from .distilled_wan import Conditioning, HeadBankDenoiser


class CosmosDenoiser:
    """Velocity of a (frozen) ``CosmosTransformer3DModel``; ``shift``: the flow shift of its schedule. The samplers of
    :mod:`distilled_samplers` call :meth:`velocity` (no causal Cosmos student is trained)."""

    def __init__(self, transformer: torch.nn.Module, shift: float, num_train_timesteps: int = 1000) -> None:
        self.transformer = transformer
        self.shift = float(shift)
        self.num_train_timesteps = int(num_train_timesteps)
        param = transformer.patch_embed.proj.weight  # the input layer's dtype (diffusers keeps some modules in fp32)
        self.device, self.dtype = param.device, param.dtype
        cfg = transformer.config
        self.concat_padding_mask = bool(cfg.get("concat_padding_mask") if hasattr(cfg, "get") else cfg.concat_padding_mask)
        self.patch_size = tuple(cfg.get("patch_size") if hasattr(cfg, "get") else cfg.patch_size)

    def velocity(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool = True) -> torch.Tensor:
        """``v = ε − x0`` (float32, shape of ``x`` ``[B, C, T, H, W]``) at ``timesteps`` ``[B]`` or per frame ``[B, T]``."""
        return self.forward(x, timesteps, cond, conditional).float()

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool) -> torch.Tensor:
        """The transformer's output for ``x`` at ``timesteps`` (its dtype), fed as the module doc says."""
        text = cond.text_embeds if conditional else cond.negative_text_embeds
        text = torch.zeros_like(cond.text_embeds) if text is None else text
        b, _, t, h, w = x.shape
        sigma = timesteps.float() / self.num_train_timesteps
        if sigma.ndim == 1:
            sigma = sigma[:, None].expand(-1, t)
        hidden = x.to(self.dtype)
        extra = {"padding_mask": hidden.new_zeros(1, 1, h, w)} if self.concat_padding_mask else {}
        out = self.transformer(hidden_states=hidden, timestep=sigma[:, None, :, None, None].float(),
                               encoder_hidden_states=text.to(self.dtype), condition_mask=hidden.new_zeros(b, 1, t, h, w),
                               return_dict=False, **extra)[0]
        return out


class PDDCosmosDenoiser(HeadBankDenoiser, CosmosDenoiser):
    """A PDD Cosmos student: the trunk of :class:`CosmosDenoiser` with ``pdd_steps`` bias-less heads from ``heads_file``."""

    def __init__(self, transformer: torch.nn.Module, shift: float, pdd_steps: int, heads_file: Path,
                 num_train_timesteps: int = 1000) -> None:
        CosmosDenoiser.__init__(self, transformer, shift, num_train_timesteps)
        self.load_head_bank(pdd_steps, heads_file)


def _cosmos_rotary_hook(rope: torch.nn.Module, args: tuple, output: object) -> object:
    """Forward hook of Cosmos' ``transformer.rope`` (it computes on its input's device; ``cos``/``sin`` ``[tokens, d]``)."""
    return planned_rotary(rope, args, output, device=None, token_dim=0)


class CausalCosmosAttnProcessor:
    """``attn1`` of block ``block_index``: block-causal + KV cache under a plan, else diffusers' ``CosmosAttnProcessor2_0``."""

    _attention_backend = None
    _parallel_config = None
    fa4 = False  # FlashAttention-4 is installed into Wan's attention only

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
        out = _planned_attention(self, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), plan)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))


def install_causal_cosmos_attention(transformer: torch.nn.Module) -> None:
    """Every block's ``attn1`` gets a :class:`CausalCosmosAttnProcessor`, ``rope`` the plan hook (idempotent)."""
    blocks = transformer.transformer_blocks
    if blocks and isinstance(blocks[0].attn1.processor, CausalCosmosAttnProcessor):
        return
    for i, block in enumerate(blocks):
        block.attn1.set_processor(CausalCosmosAttnProcessor(i))
    transformer.rope.register_forward_hook(_cosmos_rotary_hook)


class CausalCosmosDenoiser(BlockCausalDenoiser, CosmosDenoiser):
    """:class:`CosmosDenoiser` attending block-causally over ``chunk_size``-frame chunks, with a KV cache per tag."""

    def __init__(self, transformer: torch.nn.Module, shift: float, chunk_size: int, num_train_timesteps: int = 1000) -> None:
        CosmosDenoiser.__init__(self, transformer, shift, num_train_timesteps)
        self.attach_block_causal(chunk_size, False)
        install_causal_cosmos_attention(transformer)

    def plain_velocity(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool) -> torch.Tensor:
        return CosmosDenoiser.velocity(self, x, timesteps, cond, conditional)
