"""The denoisers an exported distilled Wan samples through: thin wrappers over the pipeline's own
``WanTransformer3DModel`` (stdlib + torch + safetensors only; no weights are copied).

- :class:`WanDenoiser` — the velocity ``v = ε − x0`` (float32 ``[B, C, T, H, W]``) of the transformer
  at timesteps ``[B]`` in ``[0, num_train_timesteps]``, conditioned on text embeddings ``[B, L, D]``
  (the unconditional pass: the negative embeddings, zeros when None);
- :class:`PDDWanDenoiser` — a PDD student: one velocity head per interval of a fine σ grid of
  ``pdd_steps`` intervals (``transformer/pdd_heads.safetensors``: ``weight [P, out, inner]``,
  ``bias [P, out]``); a block ``[a, b)`` of the grid is one forward through the heads fused into one
  projection (weights :func:`~distilled_schedule.block_weights`), put in place of ``proj_out``'s
  output for that forward only.

The causal (block-causal, KV-cached) denoiser is :mod:`distilled_causal`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .distilled_schedule import block_weights, inference_sigmas

HEADS_FILE = "pdd_heads.safetensors"  # a PDD student's head bank, beside the transformer's weights


@dataclass
class Conditioning:
    """Text embeddings ``[B, L, D]`` (zero-padded to the prompt length) and the CFG negative (None: zeros)."""

    text_embeds: torch.Tensor
    negative_text_embeds: torch.Tensor | None = None


class WanDenoiser:
    """Velocity of a (frozen) ``WanTransformer3DModel``; ``shift``: the flow shift of its schedule."""

    def __init__(self, transformer: torch.nn.Module, shift: float, num_train_timesteps: int = 1000) -> None:
        self.transformer = transformer
        self.shift = float(shift)
        self.num_train_timesteps = int(num_train_timesteps)
        # inputs go in as the input layer's dtype (loaded in bf16, diffusers keeps some modules in fp32: the first
        # parameter is not the one to ask)
        param = getattr(getattr(transformer, "patch_embedding", None), "weight", None)
        param = param if param is not None else next(transformer.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = transformer.config
        self.patch_size = tuple(cfg.patch_size)
        self.in_channels = int(cfg.in_channels)

    def text_for(self, cond: Conditioning, conditional: bool) -> torch.Tensor:
        text = cond.text_embeds if conditional else cond.negative_text_embeds
        return torch.zeros_like(cond.text_embeds) if text is None else text

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool) -> torch.Tensor:
        """The transformer's output for ``x`` at ``timesteps`` ``[B]`` (its dtype)."""
        return self.transformer(hidden_states=x.to(self.dtype), timestep=timesteps.float(),
                                encoder_hidden_states=self.text_for(cond, conditional).to(self.dtype), return_dict=False)[0]

    def velocity(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool = True) -> torch.Tensor:
        """``v = ε − x0`` (float32, shape of ``x``)."""
        return self.forward(x, timesteps, cond, conditional).float()


def read_head_bank(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [P, out, in], bias [P, out])`` of a head-bank file (tensors only, nothing unpickled)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("weight"), f.get_tensor("bias")


class PDDWanDenoiser(WanDenoiser):
    """A PDD student: the trunk of :class:`WanDenoiser` with a bank of ``pdd_steps`` output heads
    read from ``heads_file`` (module doc)."""

    def __init__(self, transformer: torch.nn.Module, shift: float, pdd_steps: int, heads_file: Path,
                 num_train_timesteps: int = 1000) -> None:
        super().__init__(transformer, shift, num_train_timesteps)
        if not Path(heads_file).is_file():
            raise FileNotFoundError(f"{heads_file}: no PDD head bank beside the transformer weights; a pdd_fused "
                                    "sampling contract needs the PDD stage's heads")
        weight, bias = read_head_bank(Path(heads_file))
        proj = transformer.proj_out
        if tuple(weight.shape) != (pdd_steps, *proj.weight.shape) or tuple(bias.shape) != (pdd_steps, *proj.bias.shape):
            raise ValueError(f"{heads_file}: holds {weight.shape[0]} heads of shape {tuple(weight.shape[1:])}; the "
                             f"contract asks for pdd_steps={pdd_steps} heads of {tuple(proj.weight.shape)}")
        self.pdd_steps = int(pdd_steps)
        self.head_weight = weight.float().to(self.device)  # [P, out, in], fp32 as trained
        self.head_bias = bias.float().to(self.device)  # [P, out]
        self.fine_sigmas = inference_sigmas(self.shift, self.pdd_steps, self.num_train_timesteps)  # [P + 1], CPU

    def fused_head(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight [out, in], bias [out])`` of block ``[start, end)``: ``Σ_k w_k head_k`` summed in float64."""
        if not 0 <= start < end <= self.pdd_steps:
            raise ValueError(f"block [{start}, {end}) outside the {self.pdd_steps}-interval grid")
        w, b = self.head_weight[start:end], self.head_bias[start:end]
        c = block_weights(self.fine_sigmas, start, end).to(w.device, torch.float64)
        return (c[:, None, None] * w.double()).sum(0).float(), (c[:, None] * b.double()).sum(0).float()

    def velocity_fused(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, start: int, end: int,
                       conditional: bool = True) -> torch.Tensor:
        """Block ``[start, end)``'s mean velocity (float32) from one forward: ``x_end = x_start + (σ_end − σ_start) ·`` this."""
        weight, bias = self.fused_head(start, end)

        def project(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            hidden = args[0]
            return F.linear(hidden, weight.to(hidden.dtype), bias.to(hidden.dtype))

        handle = self.transformer.proj_out.register_forward_hook(project)
        try:
            return self.forward(x, timesteps, cond, conditional).float()
        finally:
            handle.remove()
