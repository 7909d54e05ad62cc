"""ViCLIP (Wang et al., "InternVid", ICLR 2024), the video–text model VBench's *overall consistency* runs: the
published ``ViClip-InternVid-10M-FLT.pth`` (its ``model`` state dict) loads into :class:`ViCLIP` unchanged.

Written from the architecture the paper and its published code define: a CLIP ViT-L/14 vision tower (width
1024, 24 layers, 16 heads, output 768) over 8 frames — each frame's 16×16 patches (a 1×14×14 3-D convolution)
get the 2-D position embedding, every patch token a learnt per-frame temporal embedding, then all 8·256 patch
tokens and the first frame's class token attend jointly; the class token after ``ln_post`` times ``proj`` is the
video's embedding — and a CLIP text tower (width 768, 12 layers, 12 heads, causal, a context of 32 tokens,
:mod:`~distillery.evaluation.vbench.bpe`), read at the end token and projected to 768. Attention is torch's
:class:`~torch.nn.MultiheadAttention`, the MLPs QuickGELU, as the published modules.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn

CONTEXT = 32  # ViCLIP's text context length
FRAMES = 8
IMAGE = 224


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class LayerNorm32(nn.LayerNorm):
    """LayerNorm computed in float32 and cast back (the text tower's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int, attn_mask: torch.Tensor | None = None, norm=nn.LayerNorm,
                 dropouts: bool = False) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads)
        self.ln_1 = norm(width)
        layers = [("c_fc", nn.Linear(width, width * 4)), ("gelu", QuickGELU())]
        layers += [("drop1", nn.Dropout(0.0))] if dropouts else []
        layers += [("c_proj", nn.Linear(width * 4, width))]
        layers += [("drop2", nn.Dropout(0.0))] if dropouts else []
        self.mlp = nn.Sequential(OrderedDict(layers))
        self.ln_2 = norm(width)
        self.attn_mask = attn_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.attn_mask.to(dtype=x.dtype, device=x.device) if self.attn_mask is not None else None
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class Blocks(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, **block) -> None:
        super().__init__()
        self.resblocks = nn.Sequential(*[ResidualAttentionBlock(width, heads, **block) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resblocks(x)


class VisionTower(nn.Module):
    def __init__(self, width: int = 1024, layers: int = 24, heads: int = 16, output_dim: int = 768, patch: int = 14) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(3, width, (1, patch, patch), (1, patch, patch), (0, 0, 0), bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(width))
        self.positional_embedding = nn.Parameter(torch.zeros((IMAGE // patch) ** 2 + 1, width))
        self.ln_pre = nn.LayerNorm(width)
        self.temporal_positional_embedding = nn.Parameter(torch.zeros(1, FRAMES, width))
        self.transformer = Blocks(width, layers, heads, dropouts=True)
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(torch.zeros(width, output_dim))

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        """``[B, 3, T, H, W]`` normalised frames → ``[B, output_dim]``."""
        x = self.conv1(video)
        b, c, t, h, w = x.shape
        x = x.permute(0, 2, 3, 4, 1).reshape(b * t, h * w, c)
        cls = self.class_embedding.to(x.dtype) + torch.zeros(x.shape[0], 1, c, dtype=x.dtype, device=x.device)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        cls_tokens = x[:b, :1, :]  # the first b rows: frame 0's class token when b == 1 (the published indexing)
        patches = x[:, 1:].reshape(b, t, h * w, c).permute(0, 2, 1, 3)  # (b t) n m -> b n t m
        temporal = self.temporal_positional_embedding
        temporal = temporal.mean(1) if t == 1 else temporal.reshape(1, 1, t, c)  # one frame: the mean (the published workaround)
        patches = (patches + temporal).reshape(b, h * w * t, c)
        x = self.ln_pre(torch.cat((cls_tokens, patches), dim=1))
        x = self.transformer(x.permute(1, 0, 2))
        return self.ln_post(x)[0] @ self.proj


class TextTower(nn.Module):
    def __init__(self, width: int = 768, layers: int = 12, heads: int = 12, embed_dim: int = 768, vocab: int = 49408) -> None:
        super().__init__()
        mask = torch.full((CONTEXT, CONTEXT), float("-inf")).triu_(1)
        self.transformer = Blocks(width, layers, heads, attn_mask=mask, norm=LayerNorm32)
        self.token_embedding = nn.Embedding(vocab, width)
        self.positional_embedding = nn.Parameter(torch.zeros(CONTEXT, width))
        self.ln_final = LayerNorm32(width)
        self.text_projection = nn.Parameter(torch.zeros(width, embed_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``[B, 32]`` token ids → ``[B, embed_dim]`` (read at each row's highest id: the end token)."""
        x = self.token_embedding(ids) + self.positional_embedding
        x = self.ln_final(self.transformer(x.permute(1, 0, 2)).permute(1, 0, 2))
        return x[torch.arange(x.shape[0]), ids.argmax(dim=-1)] @ self.text_projection


# size -> (vision tower widths, text tower widths): "l14" is the published model, "tiny" the CPU tests' (same classes)
SIZES = {"l14": (dict(width=1024, layers=24, heads=16, output_dim=768), dict(width=768, layers=12, heads=12, embed_dim=768)),
         "tiny": (dict(width=64, layers=2, heads=4, output_dim=32), dict(width=64, layers=2, heads=4, embed_dim=32))}


class ViCLIP(nn.Module):
    """The two towers and the (unused here) temperature, named as the published checkpoint."""

    def __init__(self, size: str = "l14") -> None:
        super().__init__()
        vision, text = SIZES[size]
        self.vision_encoder = VisionTower(**vision)
        self.text_encoder = TextTower(**text)
        self.temp = nn.Parameter(torch.tensor(0.01))
