"""MUSIQ (Ke et al., ICCV 2021, "Multi-scale Image Quality Transformer"), the image-quality model VBench's
*imaging quality* runs, with the SPAQ-trained weights ``musiq_spaq_ckpt-358bb6af.pth`` (IQA-PyTorch's release; its
``params`` load into :class:`MUSIQ` unchanged).

Written from the architecture the paper defines and IQA-PyTorch's (``pyiqa``) port of it, which VBench calls: an
image becomes patches of 32×32 at three scales — resized (bicubic, aspect kept) to a longer side of 224 and 384,
each cut or zero-padded to ⌈L/32⌉² patches, plus every patch of the original resolution — each patch with a
hashed spatial position on a 10×10 grid, a scale index and a mask; a weight-standardised ResNet stem (7×7 conv,
group norm, 3×3 max pool, one bottleneck block) embeds each patch into 384 dimensions; a 14-layer pre-norm
transformer (6 heads, MLP 1152, padding masked with −1000) reads the class token into one score (SPAQ: 0..100).

Input: ``float32 [B, 3, H, W]`` in [0, 1]; :meth:`MUSIQ.forward` returns ``[B]`` scores.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

PATCH = 32
GRID = 10  # the hashed spatial position grid
SCALES = (224, 384)  # longer sides of the resized copies; the original resolution is the third scale
HIDDEN = 384


def same_padding(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Zero padding as TensorFlow's ``SAME``: the output is ⌈size / stride⌉, the odd pixel at the bottom/right."""
    h, w = x.shape[-2:]
    pad_h = (math.ceil(h / stride) - 1) * stride + kernel - h
    pad_w = (math.ceil(w / stride) - 1) * stride + kernel - w
    return F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))


class StdConv(nn.Conv2d):
    """A convolution of standardised weights (per output channel: mean 0, divided by std + 1e-5) with SAME padding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s = self.kernel_size[0], self.stride[0]
        w = self.weight - self.weight.mean((1, 2, 3), keepdim=True)
        w = w / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(same_padding(x, k, s), w, self.bias, self.stride)


class Bottleneck(nn.Module):
    def __init__(self, inplanes: int, outplanes: int) -> None:
        super().__init__()
        self.conv1 = StdConv(inplanes, inplanes, 1, 1, bias=False)
        self.gn1 = nn.GroupNorm(32, inplanes, eps=1e-4)
        self.conv2 = StdConv(inplanes, inplanes, 3, 1, bias=False)
        self.gn2 = nn.GroupNorm(32, inplanes, eps=1e-4)
        self.conv3 = StdConv(inplanes, outplanes, 1, 1, bias=False)
        self.gn3 = nn.GroupNorm(32, outplanes, eps=1e-4)
        self.relu = nn.ReLU()
        self.conv_proj = StdConv(inplanes, outplanes, 1, 1, bias=False)
        self.gn_proj = nn.GroupNorm(32, outplanes, eps=1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.gn_proj(self.conv_proj(x))
        x = self.relu(self.gn1(self.conv1(x)))
        x = self.relu(self.gn2(self.conv2(x)))
        return self.relu(self.gn3(self.conv3(x)) + identity)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MultiHeadAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, n, self.num_heads, c // self.num_heads).permute(0, 2, 1, 3)

        attn = (heads(self.query(x)) @ heads(self.key(x)).transpose(-2, -1)) * self.scale
        pair = mask.reshape(b, 1, n, 1) * mask.reshape(b, 1, 1, n)
        attn = attn.masked_fill(pair == 0, -1e3).softmax(dim=-1)
        return self.out((attn @ heads(self.value(x))).transpose(1, 2).reshape(b, n, c))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, mlp_dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attention = MultiHeadAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, mlp_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class _PositionEmbs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.position_emb = nn.Parameter(torch.zeros(1, GRID * GRID, HIDDEN))


class _ScaleEmbs(nn.Module):
    def __init__(self, num_scales: int) -> None:
        super().__init__()
        self.scale_emb = nn.Parameter(torch.zeros(num_scales, HIDDEN))


class TransformerEncoder(nn.Module):
    def __init__(self, layers: int = 14, mlp_dim: int = 1152, num_heads: int = 6, num_scales: int = 3) -> None:
        super().__init__()
        self.posembed_input = _PositionEmbs()
        self.scaleembed_input = _ScaleEmbs(num_scales)
        self.cls = nn.Parameter(torch.zeros(1, 1, HIDDEN))
        self.encoder_norm = nn.LayerNorm(HIDDEN, eps=1e-6)
        self.transformer = nn.ModuleDict({f"encoderblock_{i}": TransformerBlock(HIDDEN, mlp_dim, num_heads) for i in range(layers)})

    def forward(self, x: torch.Tensor, spatial: torch.Tensor, scale: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.posembed_input.position_emb.squeeze(0)[spatial.long()]
        x = x + self.scaleembed_input.scale_emb[scale.long()]
        x = torch.cat([self.cls.repeat(x.shape[0], 1, 1), x], dim=1)
        mask = torch.cat([torch.ones((x.shape[0], 1), dtype=mask.dtype, device=mask.device), mask], dim=1)
        for block in self.transformer.values():
            x = block(x, mask)
        return self.encoder_norm(x)


def hashed_positions(count_h: int, count_w: int) -> torch.Tensor:
    """Each patch's index on the ``GRID × GRID`` hashed position grid (nearest-neighbour scaling of the row and
    column counts onto the grid), row-major: ``[count_h · count_w]`` float."""
    grid = torch.arange(GRID).float().reshape(1, 1, GRID)
    cols = F.interpolate(grid, count_w, mode="nearest").repeat(1, count_h, 1)
    rows = F.interpolate(grid, count_h, mode="nearest").transpose(1, 2).repeat(1, 1, count_w)
    return (rows * GRID + cols).reshape(-1)


def scale_patches(image: torch.Tensor, scale_id: int, max_len: int | None) -> torch.Tensor:
    """``[B, 3, h, w]`` → ``[B, 3·32·32 + 3, L]``: its SAME-padded 32×32 patches (channel-major, as ``unfold``), then
    the hashed position, the scale id and the mask (1) of each; cut or zero-padded to ``max_len`` (None: all)."""
    b, _, h, w = image.shape
    patches = F.unfold(same_padding(image, PATCH, PATCH), PATCH, stride=PATCH)
    spatial = hashed_positions(math.ceil(h / PATCH), math.ceil(w / PATCH)).to(patches)
    spatial = spatial.reshape(1, 1, -1).repeat(b, 1, 1)
    out = torch.cat([patches, spatial, torch.ones_like(spatial) * scale_id, torch.ones_like(spatial)], dim=1)
    if max_len is not None:
        out = torch.cat([out, torch.zeros((b, out.shape[1], max_len), dtype=out.dtype, device=out.device)], dim=-1)[:, :, :max_len]
    return out


def multiscale_patches(image: torch.Tensor) -> torch.Tensor:
    """The patch sequence ``[B, L, 3·32·32 + 3]`` of images in [−1, 1] at the :data:`SCALES` and the original size."""
    h, w = image.shape[-2:]
    parts = []
    for scale_id, longer in enumerate(sorted(SCALES)):
        ratio = longer / max(h, w)
        resized = F.interpolate(image, (round(h * ratio), round(w * ratio)), mode="bicubic", align_corners=False)
        parts.append(scale_patches(resized, scale_id, int(math.ceil(longer / PATCH) ** 2)))
    parts.append(scale_patches(image, len(SCALES), None))
    return torch.cat(parts, dim=-1).transpose(1, 2)


class MUSIQ(nn.Module):
    """MUSIQ with one output (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_root = StdConv(3, 64, 7, 2, bias=False)
        self.gn_root = nn.GroupNorm(32, 64, eps=1e-6)
        self.block1 = Bottleneck(64, 256)
        self.embedding = nn.Linear(256 * (PATCH // 4) ** 2, HIDDEN)
        self.transformer_encoder = TransformerEncoder(num_scales=len(SCALES) + 1)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = multiscale_patches((x - 0.5) * 2)
        b, length, _ = seq.shape
        spatial, scale, mask = seq[:, :, -3], seq[:, :, -2], seq[:, :, -1].bool()
        patches = seq[:, :, :-3].reshape(-1, 3, PATCH, PATCH)
        y = torch.relu(self.gn_root(self.conv_root(patches)))
        y = F.max_pool2d(same_padding(y, 3, 2), 3, 2)
        y = self.block1(y).permute(0, 2, 3, 1).reshape(b, length, -1)  # channels last, as the TensorFlow original
        y = self.transformer_encoder(self.embedding(y), spatial, scale, mask)
        return self.head(y[:, 0]).reshape(b)
