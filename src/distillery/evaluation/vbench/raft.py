"""RAFT (Teed & Deng, ECCV 2020), the optical-flow network VBench's *dynamic degree* runs: the published
``raft-things.pth`` weights load into :class:`RAFT` unchanged (their ``module.`` prefix dropped).

Written from the architecture the paper and its published code define (the large model: a feature encoder of
residual blocks with instance norm, a context encoder with batch norm, an all-pairs correlation pyramid of 4
levels looked up at radius 4, a separable ConvGRU update of hidden width 128 and the convex 8× upsampling);
module names follow the published state dict so its keys load strictly. The residual/bottleneck encoder blocks are
also AMT's feature encoder (:mod:`~distillery.evaluation.vbench.amt`).

Input frames are ``float32 [B, 3, H, W]`` RGB in 0..255 with ``H``, ``W`` multiples of 8 (:class:`Padder8`);
:meth:`RAFT.forward` returns the upsampled flow ``[B, 2, H, W]`` in pixels after ``iters`` updates (the
``test_mode`` output VBench reads).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _norm(kind: str, channels: int, groups: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(num_groups=groups, num_channels=channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "instance":
        return nn.InstanceNorm2d(channels)
    return nn.Sequential()


class ResidualBlock(nn.Module):
    """Two 3×3 convolutions with a norm and ReLU each, plus the (strided 1×1 conv + norm) shortcut."""

    def __init__(self, in_planes: int, planes: int, norm_fn: str, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, padding=1)
        self.relu = nn.ReLU()
        self.norm1 = _norm(norm_fn, planes, planes // 8)
        self.norm2 = _norm(norm_fn, planes, planes // 8)
        self.downsample = None
        if stride != 1:
            self.norm3 = _norm(norm_fn, planes, planes // 8)
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride), self.norm3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.norm1(self.conv1(x)))
        y = self.relu(self.norm2(self.conv2(y)))
        return self.relu((x if self.downsample is None else self.downsample(x)) + y)


class BottleneckBlock(nn.Module):
    """1×1 → 3×3 → 1×1 convolutions at a quarter of the width, each with a norm and ReLU, plus the shortcut."""

    def __init__(self, in_planes: int, planes: int, norm_fn: str, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes // 4, kernel_size=1, padding=0)
        self.conv2 = nn.Conv2d(planes // 4, planes // 4, kernel_size=3, padding=1, stride=stride)
        self.conv3 = nn.Conv2d(planes // 4, planes, kernel_size=1, padding=0)
        self.relu = nn.ReLU()
        self.norm1 = _norm(norm_fn, planes // 4, planes // 8)
        self.norm2 = _norm(norm_fn, planes // 4, planes // 8)
        self.norm3 = _norm(norm_fn, planes, planes // 8)
        self.downsample = None
        if stride != 1:
            self.norm4 = _norm(norm_fn, planes, planes // 8)
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride), self.norm4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.norm1(self.conv1(x)))
        y = self.relu(self.norm2(self.conv2(y)))
        y = self.relu(self.norm3(self.conv3(y)))
        return self.relu((x if self.downsample is None else self.downsample(x)) + y)


class ConvEncoder(nn.Module):
    """A stride-8 encoder: 7×7 stride-2 conv + norm + ReLU, three stages of two blocks (widths ``widths``, the
    last two strided), a 1×1 output conv. RAFT's ``BasicEncoder`` is residual blocks of (64, 96, 128) from 64;
    the ``SmallEncoder`` of RAFT-small and AMT is bottleneck blocks of (32, 64, 96) from 32."""

    def __init__(self, output_dim: int, norm_fn: str, bottleneck: bool = False) -> None:
        super().__init__()
        stem, widths = (32, (32, 64, 96)) if bottleneck else (64, (64, 96, 128))
        block = BottleneckBlock if bottleneck else ResidualBlock
        self.norm1 = _norm(norm_fn, stem, 8)
        self.conv1 = nn.Conv2d(3, stem, kernel_size=7, stride=2, padding=3)
        self.relu1 = nn.ReLU()
        layers, planes = [], stem
        for width, stride in zip(widths, (1, 2, 2)):
            layers.append(nn.Sequential(block(planes, width, norm_fn, stride), block(width, width, norm_fn, 1)))
            planes = width
        self.layer1, self.layer2, self.layer3 = layers
        self.conv2 = nn.Conv2d(planes, output_dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.norm1(self.conv1(x)))
        return self.conv2(self.layer3(self.layer2(self.layer1(x))))


def coords_grid(batch: int, height: int, width: int, device: torch.device) -> torch.Tensor:
    """Pixel coordinates ``[B, 2, H, W]`` (x first, then y), float32."""
    ys, xs = torch.meshgrid(torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij")
    return torch.stack((xs, ys), dim=0).float()[None].repeat(batch, 1, 1, 1)


def sample_pixels(img: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """``grid_sample`` of ``img`` at pixel coordinates ``coords [..., 2]`` (x, y), bilinear, corners aligned, zeros outside."""
    h, w = img.shape[-2:]
    x, y = coords.split([1, 1], dim=-1)
    grid = torch.cat([2 * x / (w - 1) - 1, 2 * y / (h - 1) - 1], dim=-1)
    return F.grid_sample(img, grid, align_corners=True)


def correlation(fmap1: torch.Tensor, fmap2: torch.Tensor) -> torch.Tensor:
    """All-pairs correlation ``[B, H, W, 1, H, W]`` of two ``[B, D, H, W]`` feature maps, divided by √D."""
    b, d, h, w = fmap1.shape
    corr = torch.matmul(fmap1.view(b, d, h * w).transpose(1, 2), fmap2.view(b, d, h * w))
    return corr.view(b, h, w, 1, h, w) / torch.sqrt(torch.tensor(d).float())


def corr_pyramid(corr: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """``[N, 1, H, W]`` correlation volumes average-pooled by 2 per level."""
    out = [corr]
    for _ in range(levels - 1):
        out.append(F.avg_pool2d(out[-1], 2, stride=2))
    return out


def lookup(pyramid: list[torch.Tensor], coords: torch.Tensor, radius: int) -> torch.Tensor:
    """The ``(2r+1)²`` correlation values per level around ``coords [B, 2, H, W]`` (scaled by 2⁻ˡ): ``[B, L·(2r+1)², H, W]``."""
    coords = coords.permute(0, 2, 3, 1)
    b, h, w, _ = coords.shape
    steps = torch.linspace(-radius, radius, 2 * radius + 1, device=coords.device)
    delta = torch.stack(torch.meshgrid(steps, steps, indexing="ij"), dim=-1).view(1, 2 * radius + 1, 2 * radius + 1, 2)
    out = []
    for level, corr in enumerate(pyramid):
        centre = coords.reshape(b * h * w, 1, 1, 2) / 2 ** level
        out.append(sample_pixels(corr, centre + delta).view(b, h, w, -1))
    return torch.cat(out, dim=-1).permute(0, 3, 1, 2).contiguous().float()


class FlowHead(nn.Module):
    def __init__(self, input_dim: int = 128, hidden_dim: int = 256) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(input_dim, hidden_dim, 3, padding=1)
        self.conv2 = nn.Conv2d(hidden_dim, 2, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.relu(self.conv1(x)))


class SepConvGRU(nn.Module):
    """A ConvGRU run twice: with 1×5 kernels, then with 5×1 kernels."""

    def __init__(self, hidden_dim: int = 128, input_dim: int = 256) -> None:
        super().__init__()
        for axis, (k, p) in (("1", ((1, 5), (0, 2))), ("2", ((5, 1), (2, 0)))):
            for gate in ("z", "r", "q"):
                setattr(self, f"conv{gate}{axis}", nn.Conv2d(hidden_dim + input_dim, hidden_dim, k, padding=p))

    def _step(self, h: torch.Tensor, x: torch.Tensor, axis: str) -> torch.Tensor:
        hx = torch.cat([h, x], dim=1)
        z = torch.sigmoid(getattr(self, f"convz{axis}")(hx))
        r = torch.sigmoid(getattr(self, f"convr{axis}")(hx))
        q = torch.tanh(getattr(self, f"convq{axis}")(torch.cat([r * h, x], dim=1)))
        return (1 - z) * h + z * q

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._step(self._step(h, x, "1"), x, "2")


class MotionEncoder(nn.Module):
    def __init__(self, corr_planes: int) -> None:
        super().__init__()
        self.convc1 = nn.Conv2d(corr_planes, 256, 1, padding=0)
        self.convc2 = nn.Conv2d(256, 192, 3, padding=1)
        self.convf1 = nn.Conv2d(2, 128, 7, padding=3)
        self.convf2 = nn.Conv2d(128, 64, 3, padding=1)
        self.conv = nn.Conv2d(64 + 192, 128 - 2, 3, padding=1)

    def forward(self, flow: torch.Tensor, corr: torch.Tensor) -> torch.Tensor:
        cor = F.relu(self.convc2(F.relu(self.convc1(corr))))
        flo = F.relu(self.convf2(F.relu(self.convf1(flow))))
        return torch.cat([F.relu(self.conv(torch.cat([cor, flo], dim=1))), flow], dim=1)


class UpdateBlock(nn.Module):
    def __init__(self, corr_planes: int, hidden_dim: int = 128) -> None:
        super().__init__()
        self.encoder = MotionEncoder(corr_planes)
        self.gru = SepConvGRU(hidden_dim=hidden_dim, input_dim=128 + hidden_dim)
        self.flow_head = FlowHead(hidden_dim, hidden_dim=256)
        self.mask = nn.Sequential(nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.Conv2d(256, 64 * 9, 1, padding=0))

    def forward(self, net: torch.Tensor, inp: torch.Tensor, corr: torch.Tensor, flow: torch.Tensor):
        net = self.gru(net, torch.cat([inp, self.encoder(flow, corr)], dim=1))
        return net, 0.25 * self.mask(net), self.flow_head(net)


class RAFT(nn.Module):
    """RAFT-large (module doc): ``forward(image1, image2, iters)`` → flow ``[B, 2, H, W]``."""

    hidden_dim = 128
    context_dim = 128
    corr_levels = 4
    corr_radius = 4

    def __init__(self) -> None:
        super().__init__()
        self.fnet = ConvEncoder(output_dim=256, norm_fn="instance")
        self.cnet = ConvEncoder(output_dim=self.hidden_dim + self.context_dim, norm_fn="batch")
        self.update_block = UpdateBlock(self.corr_levels * (2 * self.corr_radius + 1) ** 2, self.hidden_dim)

    @staticmethod
    def upsample_flow(flow: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, 2, H/8, W/8]`` → ``[B, 2, H, W]``: each fine pixel a softmax-weighted (convex) mix of its 3×3 coarse neighbours (×8)."""
        n, _, h, w = flow.shape
        mask = torch.softmax(mask.view(n, 1, 9, 8, 8, h, w), dim=2)
        up = F.unfold(8 * flow, [3, 3], padding=1).view(n, 2, 9, 1, 1, h, w)
        up = torch.sum(mask * up, dim=2).permute(0, 1, 4, 2, 5, 3)
        return up.reshape(n, 2, 8 * h, 8 * w)

    def forward(self, image1: torch.Tensor, image2: torch.Tensor, iters: int = 20) -> torch.Tensor:
        image1 = (2 * (image1 / 255.0) - 1.0).contiguous()
        image2 = (2 * (image2 / 255.0) - 1.0).contiguous()
        fmaps = self.fnet(torch.cat([image1, image2], dim=0)).float()
        fmap1, fmap2 = torch.split(fmaps, [image1.shape[0], image1.shape[0]], dim=0)
        corr = correlation(fmap1, fmap2)
        b, h1, w1, d, h2, w2 = corr.shape
        pyramid = corr_pyramid(corr.reshape(b * h1 * w1, d, h2, w2), self.corr_levels)
        net, inp = torch.split(self.cnet(image1), [self.hidden_dim, self.context_dim], dim=1)
        net, inp = torch.tanh(net), torch.relu(inp)
        n, _, h, w = image1.shape
        coords0 = coords_grid(n, h // 8, w // 8, image1.device)
        coords1 = coords_grid(n, h // 8, w // 8, image1.device)
        flow_up = coords1 - coords0
        for _ in range(iters):
            corr_feats = lookup(pyramid, coords1, self.corr_radius)
            net, up_mask, delta = self.update_block(net, inp, corr_feats, coords1 - coords0)
            coords1 = coords1 + delta
            flow_up = self.upsample_flow(coords1 - coords0, up_mask)
        return flow_up


class Padder:
    """Replicate-pads ``[..., H, W]`` images so that H and W are multiples of ``divisor``, half on each side (the
    extra pixel at the bottom/right): RAFT's ``sintel`` padding (8) and AMT's (16)."""

    def __init__(self, height: int, width: int, divisor: int = 8) -> None:
        pad_h = (((height // divisor) + 1) * divisor - height) % divisor
        pad_w = (((width // divisor) + 1) * divisor - width) % divisor
        self.pad_lrtb = [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, self.pad_lrtb, mode="replicate")

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        left, right, top, bottom = self.pad_lrtb
        return x[..., top:h - bottom, left:w - right]
