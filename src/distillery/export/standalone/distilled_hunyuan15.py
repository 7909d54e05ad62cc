"""The denoiser an exported distilled HunyuanVideo 1.5 samples through: a thin wrapper over the pipeline's own
``HunyuanVideo15Transformer3DModel`` (stdlib + torch only; no weights are copied), fed as ``HunyuanVideo15Pipeline``
feeds it for text-to-video and as distillery's ``HunyuanVideo15Model`` does (its module doc has the mapping):

- the prompt is the two streams side by side in one tensor ``[B, L, D_qwen + D_byt5]``, each stream's tokens from
  row 0 and zeros after (:func:`pack_streams`); each is cut or zero-padded to the pipeline's budget (Qwen2.5-VL's
  1000 tokens, ByT5's 256: ``tokenizer_max_length`` / ``tokenizer_2_max_length``) and masked by its non-zero rows;
- the input is 65 channels (the released 32-channel latent): the noisy latent, then zeros for the condition latent
  and its 1-channel mask; the image tokens are zeros ``[B, 729, image_embed_dim]``;
- the timestep is one per sample ``[B]`` in the transformer's dtype (per frame ``[B, T]`` only where the frames
  agree); the output is the velocity ``v = ε − x0`` as it is (float32 ``[B, C, T, H, W]``).

:class:`PDDHunyuanVideo15Denoiser` is a PDD student's: the same trunk, its heads (:class:`distilled_wan.HeadBankDenoiser`).
No causal HunyuanVideo 1.5 student is trained (its dual-stream blocks), so none is sampled here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .distilled_wan import Conditioning, HeadBankDenoiser


def pack_streams(streams: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The pipeline's streams ``[(embeds [B, N_s, D_s], mask [B, N_s]), …]`` (each padded to its budget ``N_s``, a
    prefix mask) → ``[B, max N_s, Σ D_s]`` float32: each stream's masked rows zeroed, the streams side by side."""
    rows = max(int(e.shape[1]) for e, _ in streams)
    parts = []
    for embeds, mask in streams:
        part = embeds.float() * mask.to(embeds.device, torch.float32)[..., None]
        parts.append(torch.nn.functional.pad(part, (0, 0, 0, rows - int(part.shape[1]))))
    return torch.cat(parts, dim=-1)


def split_streams(text: torch.Tensor, widths: tuple[int, ...], tokens: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Packed prompts ``[B, L, Σ D_s]`` → per stream ``(embeds [B, tokens_s, D_s], mask [B, tokens_s] int64)`` (module
    doc); ``ValueError`` where the widths do not add up or a stream has a token beyond its budget."""
    if sum(widths) != text.shape[-1]:
        raise ValueError(f"prompt embeddings {tuple(text.shape)} are not streams of widths {list(widths)} side by side")
    out, col = [], 0
    for width, budget in zip(widths, tokens):
        part = text[..., col:col + width]
        col += width
        if part.shape[1] > budget:
            if bool(part[:, budget:].ne(0).any()):
                raise ValueError(f"a prompt stream holds tokens beyond its {budget}-token budget")
            part = part[:, :budget]
        elif part.shape[1] < budget:
            part = torch.nn.functional.pad(part, (0, 0, 0, budget - part.shape[1]))
        out.append((part, part.ne(0).any(dim=-1).to(torch.int64)))
    return out


class HunyuanVideo15Denoiser:
    """Velocity of a (frozen) ``HunyuanVideo15Transformer3DModel``; ``shift``: the flow shift of its schedule;
    ``stream_tokens``: the pipeline's prompt budgets; ``image_tokens``: its image tokens (module doc)."""

    def __init__(self, transformer: torch.nn.Module, shift: float, num_train_timesteps: int = 1000,
                 stream_tokens: tuple[int, int] = (1000, 256), image_tokens: int = 729) -> None:
        self.transformer = transformer
        self.shift = float(shift)
        self.num_train_timesteps = int(num_train_timesteps)
        param = transformer.x_embedder.proj.weight  # the input layer's dtype
        self.device, self.dtype = param.device, param.dtype
        cfg = transformer.config
        self.widths = (int(cfg.text_embed_dim), int(cfg.text_embed_2_dim))
        self.stream_tokens = tuple(int(n) for n in stream_tokens)
        self.image_tokens, self.image_dim = int(image_tokens), int(cfg.image_embed_dim)

    def velocity(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool = True) -> torch.Tensor:
        """``v = ε − x0`` (float32, shape of ``x`` ``[B, C, T, H, W]``) at ``timesteps`` ``[B]`` (or agreeing ``[B, T]``)."""
        return self.forward(x, timesteps, cond, conditional).float()

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, conditional: bool) -> torch.Tensor:
        """The transformer's output for ``x`` at ``timesteps`` (its dtype), fed as the module doc says."""
        text = cond.text_embeds if conditional else cond.negative_text_embeds
        if text is None:
            raise ValueError("HunyuanVideo 1.5 guides against the negative prompt's streams; none was given")
        if timesteps.ndim == 2:
            if not bool((timesteps == timesteps[:, :1]).all()):
                raise ValueError("HunyuanVideo 1.5 modulates every token of a sample with one timestep; got per-frame "
                                 "timesteps that differ across frames")
            timesteps = timesteps[:, 0]
        b, c, t, h, w = x.shape
        hidden = x.to(self.dtype)
        (qwen, qwen_mask), (glyph, glyph_mask) = split_streams(text, self.widths, self.stream_tokens)
        return self.transformer(
            hidden_states=torch.cat([hidden, hidden.new_zeros(b, c + 1, t, h, w)], dim=1),
            timestep=timesteps.to(self.dtype), encoder_hidden_states=qwen.to(self.dtype),
            encoder_attention_mask=qwen_mask.to(self.dtype), encoder_hidden_states_2=glyph.to(self.dtype),
            encoder_attention_mask_2=glyph_mask.to(self.dtype),
            image_embeds=hidden.new_zeros(b, self.image_tokens, self.image_dim), return_dict=False)[0]


class PDDHunyuanVideo15Denoiser(HeadBankDenoiser, HunyuanVideo15Denoiser):
    """A PDD HunyuanVideo 1.5 student: the trunk of :class:`HunyuanVideo15Denoiser` with ``pdd_steps`` heads (with a
    bias, as its ``proj_out``) from ``heads_file``."""

    def __init__(self, transformer: torch.nn.Module, shift: float, pdd_steps: int, heads_file: Path,
                 num_train_timesteps: int = 1000, stream_tokens: tuple[int, int] = (1000, 256),
                 image_tokens: int = 729) -> None:
        HunyuanVideo15Denoiser.__init__(self, transformer, shift, num_train_timesteps, stream_tokens, image_tokens)
        self.load_head_bank(pdd_steps, heads_file)
