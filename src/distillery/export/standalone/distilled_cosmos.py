"""The denoiser an exported distilled Cosmos Predict 2.5 samples through: a thin wrapper over the pipeline's own
``CosmosTransformer3DModel`` (stdlib + torch only; no weights are copied), fed as ``Cosmos2_5_PredictBasePipeline``
feeds it for text-to-world and as distillery's ``CosmosModel`` does (its module doc has the mapping):

- the timestep is σ = ``t / num_train_timesteps`` per latent frame, ``[B, 1, T, 1, 1]`` float32;
- the condition mask is zeros ``[B, 1, T, H, W]`` (no given frame); the padding mask, where the config concatenates
  one (``concat_padding_mask``), zeros ``[1, 1, H, W]``;
- the output is the velocity ``v = ε − x0`` as it is (float32 ``[B, C, T, H, W]``).

:class:`PDDCosmosDenoiser` is a PDD student's: the same trunk, its heads (:class:`distilled_wan.HeadBankDenoiser`).
"""

from __future__ import annotations

from pathlib import Path

import torch

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
