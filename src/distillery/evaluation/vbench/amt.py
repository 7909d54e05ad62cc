"""AMT-S (Li et al., CVPR 2023, "All-Pairs Multi-Field Transforms for Efficient Frame Interpolation"), the
frame interpolator VBench's *motion smoothness* runs: the published ``amt-s.pth`` (its ``state_dict``) loads
into :class:`AMTS` unchanged.

Written from the architecture the paper and its published code define for the small model: a RAFT small
feature encoder (84 channels, instance norm) and a bidirectional all-pairs correlation of 4 levels at radius 3;
an IFRNet-style pyramid encoder of widths (20, 32, 44, 56); an initial decoder at 1/16, two intermediate decoders
and a multi-field decoder of 3 flow pairs, each level's flows and features refined by a correlation-guided update
block (hidden width 76); the 3 warped candidates merged by their masks and a small conv block. Module names
follow the published state dict.

:meth:`AMTS.forward` takes two frames ``float32 [B, 3, H, W]`` in [0, 1] (H, W multiples of 16) and the time
``embt [B, 1, 1, 1]`` (0.5: the middle frame) and returns the interpolated frame, clamped to [0, 1].
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distillery.evaluation.vbench.raft import ConvEncoder, coords_grid, corr_pyramid, correlation, lookup

CHANNELS = (20, 32, 44, 56)
SKIP_CHANNELS = 20
NUM_FLOWS = 3
CORR_RADIUS = 3
CORR_LEVELS = 4


def resize(x: torch.Tensor, scale_factor: float) -> torch.Tensor:
    return F.interpolate(x, scale_factor=scale_factor, mode="bilinear", align_corners=False)


def warp(img: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Backward-warp ``img [B, C, H, W]`` by ``flow [B, 2, H, W]`` (pixels): bilinear, border padding, corners aligned."""
    b, _, h, w = flow.shape
    xx = torch.linspace(-1.0, 1.0, w).view(1, 1, 1, w).expand(b, -1, h, -1)
    yy = torch.linspace(-1.0, 1.0, h).view(1, 1, h, 1).expand(b, -1, -1, w)
    grid = torch.cat([xx, yy], 1).to(img)
    scaled = torch.cat([flow[:, 0:1] / ((w - 1.0) / 2.0), flow[:, 1:2] / ((h - 1.0) / 2.0)], 1)
    return F.grid_sample(img, (grid + scaled).permute(0, 2, 3, 1), mode="bilinear", padding_mode="border", align_corners=True)


def convrelu(cin: int, cout: int, kernel: int = 3, stride: int = 1, padding: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, padding, bias=True), nn.PReLU(cout))


class ResBlock(nn.Module):
    """IFRNet's residual block: the last ``side`` channels get their own 3×3 conv between the full-width ones."""

    def __init__(self, channels: int, side: int) -> None:
        super().__init__()
        self.side_channels = side
        self.conv1 = convrelu(channels, channels)
        self.conv2 = convrelu(side, side)
        self.conv3 = convrelu(channels, channels)
        self.conv4 = convrelu(side, side)
        self.conv5 = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1, bias=True)
        self.prelu = nn.PReLU(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.side_channels
        out = self.conv1(x)
        out = self.conv3(torch.cat([out[:, :-s], self.conv2(out[:, -s:])], 1))
        out = self.conv5(torch.cat([out[:, :-s], self.conv4(out[:, -s:])], 1))
        return self.prelu(x + out)


class PyramidEncoder(nn.Module):
    """Four levels of (stride-2 conv + PReLU, conv + PReLU): features at 1/2, 1/4, 1/8, 1/16."""

    def __init__(self, channels: tuple[int, ...]) -> None:
        super().__init__()
        prev = 3
        for idx, ch in enumerate(channels, 1):
            self.register_module(f"pyramid{idx}", nn.Sequential(convrelu(prev, ch, 3, 2, 1), convrelu(ch, ch, 3, 1, 1)))
            prev = ch
        self.levels = len(channels)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for idx in range(1, self.levels + 1):
            x = getattr(self, f"pyramid{idx}")(x)
            out.append(x)
        return out


def _decoder_block(cin: int, cmid: int, cout: int) -> nn.Sequential:
    return nn.Sequential(convrelu(cin, cmid), ResBlock(cmid, SKIP_CHANNELS), nn.ConvTranspose2d(cmid, cout, 4, 2, 1, bias=True))


class InitDecoder(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.convblock = _decoder_block(cin * 2 + 1, cin * 2, cout + 4)

    def forward(self, f0: torch.Tensor, f1: torch.Tensor, embt: torch.Tensor):
        h, w = f0.shape[2:]
        out = self.convblock(torch.cat([f0, f1, embt.repeat(1, 1, h, w)], 1))
        flow0, flow1 = torch.chunk(out[:, :4], 2, 1)
        return flow0, flow1, out[:, 4:]


class IntermediateDecoder(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.convblock = _decoder_block(cin * 3 + 4, cin * 3, cout + 4)

    def forward(self, ft: torch.Tensor, f0: torch.Tensor, f1: torch.Tensor, flow0: torch.Tensor, flow1: torch.Tensor):
        out = self.convblock(torch.cat([ft, warp(f0, flow0), warp(f1, flow1), flow0, flow1], 1))
        d0, d1 = torch.chunk(out[:, :4], 2, 1)
        return d0 + 2.0 * resize(flow0, 2.0), d1 + 2.0 * resize(flow1, 2.0), out[:, 4:]


class MultiFlowDecoder(nn.Module):
    def __init__(self, cin: int, num_flows: int) -> None:
        super().__init__()
        self.num_flows = num_flows
        self.convblock = _decoder_block(cin * 3 + 4, cin * 3, 8 * num_flows)

    def forward(self, ft: torch.Tensor, f0: torch.Tensor, f1: torch.Tensor, flow0: torch.Tensor, flow1: torch.Tensor):
        n = self.num_flows
        out = self.convblock(torch.cat([ft, warp(f0, flow0), warp(f1, flow1), flow0, flow1], 1))
        d0, d1, mask, img_res = torch.split(out, [2 * n, 2 * n, n, 3 * n], 1)
        flow0 = d0 + 2.0 * resize(flow0, 2.0).repeat(1, n, 1, 1)
        flow1 = d1 + 2.0 * resize(flow1, 2.0).repeat(1, n, 1, 1)
        return flow0, flow1, torch.sigmoid(mask), img_res


class UpdateBlock(nn.Module):
    """AMT's small update block: correlation + flow → (feature residual, flow residual), at 1/8 resized by ``scale``."""

    def __init__(self, cdim: int, scale_factor: int | None, hidden_dim: int = 76, flow_dim: int = 20, corr_dim: int = 64,
                 fc_dim: int = 68) -> None:
        super().__init__()
        corr_planes = CORR_LEVELS * (2 * CORR_RADIUS + 1) ** 2
        self.scale_factor = scale_factor
        self.convc1 = nn.Conv2d(2 * corr_planes, corr_dim, 1, padding=0)
        self.convf1 = nn.Conv2d(4, flow_dim * 2, 7, padding=3)
        self.convf2 = nn.Conv2d(flow_dim * 2, flow_dim, 3, padding=1)
        self.conv = nn.Conv2d(corr_dim + flow_dim, fc_dim, 3, padding=1)

        def two_convs(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, hidden_dim, 3, padding=1), nn.LeakyReLU(0.1), nn.Conv2d(hidden_dim, cout, 3, padding=1))

        self.gru = two_convs(fc_dim + 4 + cdim, hidden_dim)
        self.feat_head = two_convs(hidden_dim, cdim)
        self.flow_head = two_convs(hidden_dim, 4)
        self.lrelu = nn.LeakyReLU(0.1)

    def forward(self, net: torch.Tensor, flow: torch.Tensor, corr: torch.Tensor):
        if self.scale_factor is not None:
            net = resize(net, 1 / self.scale_factor)
        cor = self.lrelu(self.convc1(corr))
        flo = self.lrelu(self.convf2(self.lrelu(self.convf1(flow))))
        inp = torch.cat([self.lrelu(self.conv(torch.cat([cor, flo], dim=1))), flow, net], dim=1)
        out = self.gru(inp)
        delta_net, delta_flow = self.feat_head(out), self.flow_head(out)
        if self.scale_factor is not None:
            delta_net = resize(delta_net, self.scale_factor)
            delta_flow = self.scale_factor * resize(delta_flow, self.scale_factor)
        return delta_net, delta_flow


class AMTS(nn.Module):
    """AMT-S (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        c = CHANNELS
        self.feat_encoder = ConvEncoder(output_dim=84, norm_fn="instance", bottleneck=True)
        self.encoder = PyramidEncoder(c)
        self.decoder4 = InitDecoder(c[3], c[2])
        self.decoder3 = IntermediateDecoder(c[2], c[1])
        self.decoder2 = IntermediateDecoder(c[1], c[0])
        self.decoder1 = MultiFlowDecoder(c[0], NUM_FLOWS)
        self.update4 = UpdateBlock(44, None)
        self.update3 = UpdateBlock(32, 2)
        self.update2 = UpdateBlock(20, 4)
        self.comb_block = nn.Sequential(nn.Conv2d(3 * NUM_FLOWS, 6 * NUM_FLOWS, 3, 1, 1), nn.PReLU(6 * NUM_FLOWS),
                                        nn.Conv2d(6 * NUM_FLOWS, 3, 3, 1, 1))

    @staticmethod
    def _lookup(pyramids, coord, flow0, flow1, embt, downsample: int):
        """Bidirectional correlation at the positions the (linearly rescaled) flows point to, at 1/8."""
        if downsample != 1:
            inv = 1 / downsample
            flow0, flow1 = inv * resize(flow0, inv), inv * resize(flow1, inv)
        forward, backward = pyramids
        corr0 = lookup(forward, coord + flow1 * (1.0 / embt), CORR_RADIUS)
        corr1 = lookup(backward, coord + flow0 * (1.0 / (1.0 - embt)), CORR_RADIUS)
        return torch.cat([corr0, corr1], dim=1), torch.cat([flow0, flow1], dim=1)

    @staticmethod
    def _refine(update: UpdateBlock, ft, flow0, flow1, corr, flows):
        delta_ft, delta_flow = update(ft, flows, corr)
        d0, d1 = torch.chunk(delta_flow, 2, 1)
        return ft + delta_ft, flow0 + d0, flow1 + d1

    def forward(self, img0: torch.Tensor, img1: torch.Tensor, embt: torch.Tensor) -> torch.Tensor:
        mean = torch.cat([img0, img1], 2).mean(1, keepdim=True).mean(2, keepdim=True).mean(3, keepdim=True)
        img0, img1 = img0 - mean, img1 - mean
        b, _, h, w = img0.shape
        coord = coords_grid(b, h // 8, w // 8, img0.device)
        fmap0, fmap1 = torch.split(self.feat_encoder(torch.cat([img0, img1], 0)), [b, b], dim=0)
        corr = correlation(fmap0, fmap1)
        _, h1, w1, d, h2, w2 = corr.shape
        corr_t = corr.clone().permute(0, 4, 5, 3, 1, 2)
        pyramids = (corr_pyramid(corr.reshape(b * h1 * w1, d, h2, w2), CORR_LEVELS),
                    corr_pyramid(corr_t.reshape(b * h2 * w2, d, h1, w1), CORR_LEVELS))
        f0 = self.encoder(img0)
        f1 = self.encoder(img1)

        flow0, flow1, ft = self.decoder4(f0[3], f1[3], embt)
        corr4, flows = self._lookup(pyramids, coord, flow0, flow1, embt, 1)
        ft, flow0, flow1 = self._refine(self.update4, ft, flow0, flow1, corr4, flows)

        flow0, flow1, ft = self.decoder3(ft, f0[2], f1[2], flow0, flow1)
        corr3, flows = self._lookup(pyramids, coord, flow0, flow1, embt, 2)
        ft, flow0, flow1 = self._refine(self.update3, ft, flow0, flow1, corr3, flows)

        flow0, flow1, ft = self.decoder2(ft, f0[1], f1[1], flow0, flow1)
        corr2, flows = self._lookup(pyramids, coord, flow0, flow1, embt, 4)
        ft, flow0, flow1 = self._refine(self.update2, ft, flow0, flow1, corr2, flows)

        flow0, flow1, mask, img_res = self.decoder1(ft, f0[0], f1[0], flow0, flow1)
        return torch.clamp(self._combine(img0, img1, flow0, flow1, mask, img_res, mean), 0, 1)

    def _combine(self, img0, img1, flow0, flow1, mask, img_res, mean) -> torch.Tensor:
        """The mean of the ``n`` mask-blended warps (+ the mean colour and residual) plus the comb block's correction."""
        b, c, h, w = flow0.shape
        n = c // 2
        flow0 = flow0.reshape(b * n, 2, h, w)
        flow1 = flow1.reshape(b * n, 2, h, w)
        mask = mask.reshape(b * n, 1, h, w)
        img_res = img_res.reshape(b * n, 3, h, w)
        img0 = torch.stack([img0] * n, 1).reshape(-1, 3, h, w)
        img1 = torch.stack([img1] * n, 1).reshape(-1, 3, h, w)
        mean = torch.stack([mean] * n, 1).reshape(-1, 1, 1, 1)
        warps = (mask * warp(img0, flow0) + (1 - mask) * warp(img1, flow1) + mean + img_res).reshape(b, n, 3, h, w)
        return warps.mean(1) + self.comb_block(warps.view(b, -1, h, w))
