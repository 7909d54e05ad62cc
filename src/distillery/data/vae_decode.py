"""The Wan VAEs' decode (2.1 and 2.2) in time chunks larger than diffusers' one latent frame per decoder call.

``AutoencoderKLWan.decode`` runs its causal decoder once per latent frame, carrying each causal
convolution's last two input frames to the next call (its feature cache). Every convolution in the
decoder is causal in time (left padding only), the temporal upsamplers double each frame
independently of the frames' count, and the middle attention is per frame: so decoding latent frame 0
alone (the first chunk, where the upsamplers keep one frame) and then the remaining frames ``n`` at a
time through the same cache computes the same function — the same sums in another order (fp32:
differences of a few 1e-6; ``chunk_spans(T, 1)`` is diffusers' own loop, bit for bit). The Wan 2.2 VAE
(``is_residual``, ``patch_size`` 2) adds to each up block a ``DupUp3D`` shortcut — channels repeated and
rearranged into 2×2 pixels (and, where the block upsamples in time, 2 frames) of each input frame alone — which
drops its duplicated first frame when ``first_chunk`` is set, as the temporal upsampler keeps one frame then: both
happen on the first call only (frame 0 alone; any other first call, or ``first_chunk`` on a later one, gives the
two paths different frame counts), and its 2×2 patches are unpatchified after the last chunk, per frame, as
diffusers does. Larger calls give cuDNN's 3D convolutions more work per launch; each call's activations grow
with ``n``: the decoder's peak holds about :data:`ACTIVATIONS_PER_FRAME` full-resolution activations per output
frame (:func:`full_resolution_layout`: Wan 2.1's ``base_dim`` channels at the video's size, measured at
81×480×832: +2.56 GiB per latent frame in bf16; Wan 2.2 counted at its widest, 512 channels at half the video's
size: an overestimate, not measured), which :func:`auto_chunk_frames` sizes against the GPU's memory.

Contract: ``decode_video(vae, z, n)`` takes **raw** latents ``z [B, z_dim, T', H', W']`` in the VAE's
dtype (``denormalize_latents`` first) and returns ``vae.decode(z).sample``: ``[B, 3, 4(T'−1)+1, s·H', s·W']``
(``s`` the VAE's ``scale_factor_spatial``: 8 for Wan 2.1, 16 for Wan 2.2 TI2V-5B's) clamped to ``[-1, 1]``, in
the VAE's dtype. A VAE whose decoder has other up blocks than these two, or that tiles, goes through
``vae.decode`` unchanged.

:func:`set_fused_decode` swaps the forwards of the decoder, its residual blocks, causal convolutions and
nearest upsamplers for leaner ones that compute the same function with fewer roundings and memory passes: before
each of a residual block's convolutions (and the head's), the RMS norm + SiLU in fp32, rounded once, with the
previous convolution's bias folded in, written straight into the convolution's time-padded input after the cached
frames (diffusers rounds after the norm and after the scale, adds the bias in its own pass and copies the whole
input through ``F.pad``); the block's second bias and its shortcut added in one pass; the convolution pads in space
itself; the nearest-exact upsamplers stay in the VAE's dtype (diffusers goes through fp32 and back: the same
values); Wan 2.2's residual up blocks skip the copy of their input and add their ``DupUp3D`` shortcut into the
upsampler's output through a strided view (:func:`dup_up_add_`: bit for bit diffusers' add, without its rearranged
copy and new sum). On a GPU with Triton the two passes are the kernels of
:mod:`distillery.data.vae_kernels`; elsewhere :func:`norm_silu_reference` and an fp32 add. Times at 81×480×832
on an H200: BENCHMARKS.md "Validate's VAE decode".
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import vae_kernels  # relative: an export folder ships this module and vae_kernels.py side by side

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan


def chunk_spans(latent_frames: int, chunk_frames: int) -> list[tuple[int, int]]:
    """``[start, end)`` latent-frame spans of one decode: frame 0 alone, then ``chunk_frames`` at a time
    (the last span may be shorter). ``chunk_frames >= 1``."""
    if chunk_frames < 1:
        raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
    if latent_frames < 1:
        return []
    return [(0, 1)] + [(s, min(s + chunk_frames, latent_frames)) for s in range(1, latent_frames, chunk_frames)]


ACTIVATIONS_PER_FRAME = 9  # full-resolution activations alive per output frame at the decoder's peak (module doc)
DECODE_MEMORY_SHARE = 4  # auto_chunk_frames sizes a call to 1/4 of the GPU's memory


def full_resolution_layout(vae: AutoencoderKLWan) -> tuple[int, int]:
    """``(channels, spatial factor)`` that :func:`auto_chunk_frames` counts an output frame's activations in: the
    decoder's last resolution (latent × ``scale_factor_spatial``, ÷ ``patch_size`` where the output is patchified)
    and the widest activation there. Wan 2.1: ``base_dim`` channels × 8 (the last up block and the head). Wan 2.2:
    its last upsampler and ``DupUp3D`` shortcut write ``decoder_base_dim · dim_mult[1]`` channels (512) at × 8
    (half the video's size: 2×2 patches) before the last up block narrows them to ``decoder_base_dim``: counting all
    :data:`ACTIVATIONS_PER_FRAME` at the wider count overestimates (conservative: smaller chunks, never more memory
    than sized)."""
    cfg = vae.config
    dim = int(cfg.decoder_base_dim or cfg.base_dim)
    mult = list(cfg.dim_mult)
    wide = mult[1] if getattr(cfg, "is_residual", False) and len(mult) > 1 else mult[0]
    return dim * int(wide), int(cfg.scale_factor_spatial) // int(cfg.patch_size or 1)


def auto_chunk_frames(vae: AutoencoderKLWan, latent_shape: tuple[int, ...], device: torch.device,
                      total_memory: int | None = None) -> int:
    """Latent frames per decoder call for latents ``[C, T', H', W']`` (or their last three sizes) on ``device``:
    1 (diffusers' loop) off CUDA; on CUDA the fewest calls whose activations each stay under a quarter of the
    GPU's total memory (``total_memory`` bytes, default the device's; not its free memory: the same GPU model and
    shape always decode alike), the ``T' − 1`` frames after the first shared evenly among them (two calls of 10
    beat 13 + 7 on an H200). 81×480×832: 10 frames in bf16 and 5 in fp32 on a 141 GB H200 (at most 13 and 6 fit),
    7 and 3 on an 80 GB H100."""
    frames, height, width = (int(v) for v in latent_shape[-3:])
    if device.type != "cuda" or frames <= 2:
        return 1
    channels, scale_s = full_resolution_layout(vae)
    itemsize = torch.empty((), dtype=vae.dtype).element_size()
    per_frame = (ACTIVATIONS_PER_FRAME * int(vae.config.scale_factor_temporal) * channels
                 * height * scale_s * width * scale_s * itemsize)
    total = total_memory if total_memory is not None else torch.cuda.get_device_properties(device).total_memory
    budget = int(total) // DECODE_MEMORY_SHARE
    most = max(1, min(frames - 1, budget // per_frame))
    calls = -(-(frames - 1) // most)
    return -(-(frames - 1) // calls)


def chunked_decode_applies(vae: AutoencoderKLWan) -> bool:
    """Whether :func:`decode_video` may chunk this VAE: a Wan decoder whose up blocks are Wan 2.1's
    (``WanUpBlock``) or Wan 2.2's (``WanResidualUpBlock``: the same residual blocks and upsamplers plus a
    ``DupUp3D`` shortcut), patchified output or not, and no spatial tiling (module doc)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanDecoder3d, WanResidualUpBlock, WanUpBlock

    decoder = getattr(vae, "decoder", None)
    return (isinstance(decoder, WanDecoder3d) and not getattr(vae, "use_tiling", False)
            and all(isinstance(block, (WanUpBlock, WanResidualUpBlock)) for block in decoder.up_blocks))


@torch.no_grad()
def decode_video(vae: AutoencoderKLWan, z: torch.Tensor, chunk_frames: int) -> torch.Tensor:
    """Raw latents ``z [B, z_dim, T', H', W']`` → video ``[B, 3, T, H, W]`` in ``[-1, 1]`` (module doc);
    ``chunk_frames`` latent frames per decoder call after the first (1: diffusers' loop)."""
    if chunk_frames == 1 or not chunked_decode_applies(vae):
        return vae.decode(z, return_dict=False)[0]
    return StreamingDecoder(vae, chunk_frames).push(z)


class StreamingDecoder:
    """A video's decode in consecutive pieces of its latent frames, each as soon as it is there (a causal student's
    finished chunk): the decoder's causal feature cache (its own, not the VAE's) carries from one :meth:`push` to the
    next, so the pieces' frames, concatenated in time, are :func:`decode_video` of the whole latents — the same
    decoder calls where the spans agree (``chunk_frames`` 1: diffusers' own loop), the same function in other sums
    where they do not. Frame 0 is decoded alone (the first push starts there), then ``chunk_frames`` latent frames
    per decoder call. A ``ValueError`` for a VAE :func:`chunked_decode_applies` refuses (another decoder, or tiling)."""

    def __init__(self, vae: AutoencoderKLWan, chunk_frames: int) -> None:
        if not chunked_decode_applies(vae):
            raise ValueError("a decode piece by piece needs a Wan 2.1 or 2.2 VAE decoder that does not tile "
                             "(vae.disable_tiling())")
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
        self.vae, self.chunk_frames = vae, int(chunk_frames)
        self.cache: list = [None] * int(vae._cached_conv_counts["decoder"])
        self.frames = 0  # latent frames decoded so far

    @torch.no_grad()
    def push(self, z: torch.Tensor) -> torch.Tensor:
        """The next latent frames ``z [B, z_dim, f, H', W']`` (raw, the VAE's dtype) → their video frames ``[B, 3, F,
        H, W]`` in ``[-1, 1]`` (``F`` = 1 + 4(f − 1) for the first push, 4f after)."""
        x = self.vae.post_quant_conv(z)
        spans = chunk_spans(int(x.shape[2]), self.chunk_frames) if self.frames == 0 else \
            [(s, min(s + self.chunk_frames, int(x.shape[2]))) for s in range(0, int(x.shape[2]), self.chunk_frames)]
        parts = []
        for start, end in spans:
            parts.append(self.vae.decoder(x[:, :, start:end], feat_cache=self.cache, feat_idx=[0],
                                          first_chunk=self.frames == 0 and start == 0))
        self.frames += int(x.shape[2])
        out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        if self.vae.config.patch_size is not None:  # Wan 2.2: the decoder's output channels are 2×2 pixel patches
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=self.vae.config.patch_size)
        return out.clamp_(-1.0, 1.0)


CACHE_FRAMES = 2  # what diffusers' Wan decoder carries per causal convolution (its CACHE_T)


def norm_silu_reference(x: torch.Tensor, gamma: torch.Tensor, prefix: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x' / max(‖x'‖₂ over channels, 1e-12) · √C · γ)`` with ``x' = x + bias`` for ``x [B, C, T, H, W]``,
    ``γ`` and ``bias`` ``C`` values: Wan's ``WanRMS_norm`` (no bias of its own) then SiLU, in fp32, rounded once
    to ``x``'s dtype; ``bias`` is the previous convolution's, folded in. With ``prefix [B, C, p, H, W]`` (``x``'s
    dtype) the result follows it in time: ``[B, C, p + T, H, W]``, a causal convolution's padded input."""
    xf = x.float()
    if bias is not None:
        xf = xf + bias.float().reshape(1, -1, 1, 1, 1)
    inv = torch.rsqrt(torch.clamp((xf * xf).sum(dim=1, keepdim=True), min=1e-24))
    y = F.silu(xf * inv * (gamma.float().reshape(1, -1, 1, 1, 1) * float(x.shape[1]) ** 0.5)).to(x.dtype)
    return y if prefix is None else torch.cat([prefix, y], dim=2)


def norm_silu(x: torch.Tensor, gamma: torch.Tensor, prefix: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`norm_silu_reference`; on a GPU with Triton one kernel (:func:`vae_kernels.norm_silu_into`) that
    writes the normalised frames straight after ``prefix`` (no separate copy for the causal padding)."""
    if vae_kernels.available(x):
        b, c, t, h, w = x.shape
        p = 0 if prefix is None else int(prefix.shape[2])
        out = x.new_empty(b, c, p + t, h, w)
        if prefix is not None:
            out[:, :, :p].copy_(prefix)
        try:
            return vae_kernels.norm_silu_into(x.contiguous(), gamma, out, p, bias)
        except Exception as error:  # noqa: BLE001 - Triton's compile/launch errors have no common type
            vae_kernels.disable(error)
    return norm_silu_reference(x, gamma, prefix, bias)


def bias_residual_(x: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x += bias + h`` in place (``x``, ``h`` ``[B, C, T, H, W]``, ``bias`` ``C`` values or None), summed in fp32
    and rounded once: a residual block's second convolution's bias and its shortcut."""
    if vae_kernels.available(x) and x.is_contiguous() and h.is_contiguous():
        try:
            return vae_kernels.bias_residual_(x, h, bias)
        except Exception as error:  # noqa: BLE001 - as in norm_silu (a failed launch writes nothing)
            vae_kernels.disable(error)
    total = x.float() + h.float()
    if bias is not None:
        total += bias.float().reshape(1, -1, 1, 1, 1)
    return x.copy_(total)


def _time_prefix(x: torch.Tensor, cached: torch.Tensor | None, frames: int) -> torch.Tensor | None:
    """The ``frames`` frames a causal convolution pads ``x [B, C, T, H, W]`` with in time: the cached frames of the
    previous chunk (their last ``frames``), zeros before them where there are fewer; None for no padding."""
    if frames <= 0:
        return None
    parts = [] if cached is None else [cached[:, :, -frames:].to(x.device, x.dtype)]
    missing = frames - sum(int(part.shape[2]) for part in parts)
    if missing > 0:
        b, c, _, h, w = x.shape
        parts.insert(0, x.new_zeros(b, c, missing, h, w))
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def _next_cache(x: torch.Tensor, cached: torch.Tensor | None) -> torch.Tensor:
    """diffusers' feature-cache rule for a causal convolution's input ``x``: its last :data:`CACHE_FRAMES` frames,
    with the previous cache's last frame in front when ``x`` has fewer."""
    cache_x = x[:, :, -CACHE_FRAMES:].clone()
    if cache_x.shape[2] < CACHE_FRAMES and cached is not None:
        cache_x = torch.cat([cached[:, :, -1:].to(cache_x.device), cache_x], dim=2)
    return cache_x


def _causal_conv_forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """``WanCausalConv3d.forward``: left time padding from the cache (then zeros), spatial padding in the conv."""
    prefix = _time_prefix(x, cache_x, self._padding[4])
    if prefix is not None:
        x = torch.cat([prefix, x], dim=2)
    return F.conv3d(x, self.weight, self.bias, self.stride, (0, self._padding[2], self._padding[0]), self.dilation,
                    self.groups)


def _cached_conv(conv, x: torch.Tensor, feat_cache: list | None, feat_idx: list[int]) -> torch.Tensor:
    """One causal convolution with diffusers' cache bookkeeping (the decoder's first convolution)."""
    if feat_cache is None:
        return conv(x)
    old = feat_cache[feat_idx[0]]
    out = conv(x, old)
    feat_cache[feat_idx[0]] = _next_cache(x, old)
    feat_idx[0] += 1
    return out


def _norm_silu_conv(conv, x: torch.Tensor, gamma: torch.Tensor, feat_cache: list | None, feat_idx: list[int],
                    bias: torch.Tensor | None = None, with_bias: bool = True) -> torch.Tensor:
    """``conv(silu(norm(x + bias)))`` for a causal convolution with diffusers' cache bookkeeping: the normalised
    frames are written once, after the cached frames of the previous chunk (zeros where there are none), and that
    buffer is the convolution's input with its time padding in place. ``with_bias=False`` leaves the convolution's
    own bias for the caller to fold into the next pass."""
    t_pad = conv._padding[4]
    old = feat_cache[feat_idx[0]] if feat_cache is not None else None
    padded = norm_silu(x, gamma, _time_prefix(x, old, t_pad), bias)
    if feat_cache is not None:
        feat_cache[feat_idx[0]] = _next_cache(padded[:, :, t_pad:], old)
        feat_idx[0] += 1
    return F.conv3d(padded, conv.weight, conv.bias if with_bias else None, conv.stride,
                    (0, conv._padding[2], conv._padding[0]), conv.dilation, conv.groups)


def _residual_block_forward(self, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list[int] = [0]):  # noqa: B006 - diffusers' signature
    """``WanResidualBlock.forward`` (dropout is the identity at eval) in three memory passes besides the
    convolutions: norm + SiLU + padding before each convolution (the first one's bias folded into the second
    norm), then the second one's bias and the shortcut added in one. A strided input (an upsampler's permuted
    output) is made contiguous once, for the norm and the shortcut alike."""
    x = x.contiguous()
    h = self.conv_shortcut(x)
    x = _norm_silu_conv(self.conv1, x, self.norm1.gamma, feat_cache, feat_idx, with_bias=False)
    x = _norm_silu_conv(self.conv2, x, self.norm2.gamma, feat_cache, feat_idx, bias=self.conv1.bias, with_bias=False)
    return bias_residual_(x, h, self.conv2.bias)  # h: x itself or a 1×1×1 convolution of it, contiguous


def _decoder_forward(self, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list[int] = [0],  # noqa: B006
                     first_chunk: bool = False) -> torch.Tensor:
    """``WanDecoder3d.forward`` with the head's norm + SiLU + padding fused like the residual blocks'."""
    x = _cached_conv(self.conv_in, x, feat_cache, feat_idx)
    x = self.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
    for up_block in self.up_blocks:
        x = up_block(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)
    return _norm_silu_conv(self.conv_out, x, self.norm_out.gamma, feat_cache, feat_idx)


def _upsample_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``WanUpsample.forward`` without the round trip through fp32: nearest(-exact) upsampling copies values,
    so it is bit for bit the same in the tensor's own dtype."""
    return torch.nn.Upsample.forward(self, x)


def dup_up_add_(x: torch.Tensor, shortcut, source: torch.Tensor, first_chunk: bool = False) -> torch.Tensor:
    """``x += shortcut(source, first_chunk)`` in place for diffusers' ``DupUp3D`` ``shortcut`` (Wan 2.2's residual up
    blocks): ``source``'s channels repeated, then each group of ``factor_t · factor_s²`` laid out as that many frames
    and pixels of ``x`` (which has ``factor_t`` frames per ``source`` frame, ``factor_s`` pixels a side per pixel; on
    the first chunk of one frame the last of its ``factor_t`` frames only). The same values added to the same values
    in ``x``'s dtype, one rounding, as ``x + shortcut(...)``; but added through a strided view of the repeated
    channels instead of a copy rearranged into frames and pixels, and into ``x`` instead of a new tensor."""
    b, _, t, h, w = source.shape
    ft, fs, c = int(shortcut.factor_t), int(shortcut.factor_s), int(shortcut.out_channels)
    if first_chunk and ft > 1 and t != 1:  # never in a decode (the first chunk is one frame): diffusers' own way
        return x.add_(shortcut(source, first_chunk=True))
    repeated = source.repeat_interleave(shortcut.repeats, dim=1).view(b, c, ft, fs, fs, t, h, w)
    laid_out = repeated.permute(0, 1, 5, 2, 6, 3, 7, 4)  # [b, c, t, ft, h, fs, w, fs]: x's frames and pixels
    if first_chunk:
        laid_out = laid_out[:, :, :, ft - 1:]
    x.unflatten(4, (w, fs)).unflatten(3, (h, fs)).unflatten(2, (t, laid_out.shape[3])).add_(laid_out)
    return x


def _residual_up_block_forward(self, x: torch.Tensor, feat_cache: list | None = None,
                               feat_idx: list[int] = [0], first_chunk: bool = False) -> torch.Tensor:  # noqa: B006
    """``WanResidualUpBlock.forward`` (Wan 2.2) without the copy of its input (the lean residual blocks never write
    their input) and with its ``DupUp3D`` shortcut added in place (:func:`dup_up_add_`)."""
    source = x
    for resnet in self.resnets:
        x = resnet(x, feat_cache=feat_cache, feat_idx=feat_idx)
    if self.upsampler is not None:
        x = self.upsampler(x, feat_cache=feat_cache, feat_idx=feat_idx)
    if self.avg_shortcut is not None:
        x = dup_up_add_(x.clone() if x is source else x, self.avg_shortcut, source, first_chunk)
    return x


def fused_decode_applies(vae: AutoencoderKLWan) -> bool:
    """Whether :func:`set_fused_decode` knows this VAE's blocks: Wan 2.1's and Wan 2.2's residual blocks (bias-free
    channel-first norms, SiLU, no dropout at eval) under :func:`chunked_decode_applies`."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock

    if not chunked_decode_applies(vae) or vae.training:
        return False
    decoder = vae.decoder
    if not decoder.norm_out.channel_first or isinstance(decoder.norm_out.bias, torch.Tensor) \
            or not isinstance(decoder.nonlinearity, torch.nn.SiLU):
        return False
    for block in decoder.modules():
        if isinstance(block, WanResidualBlock):
            for norm in (block.norm1, block.norm2):
                if not norm.channel_first or isinstance(norm.bias, torch.Tensor):
                    return False
            if not isinstance(block.nonlinearity, torch.nn.SiLU):
                return False
    return True


def set_fused_decode(vae: AutoencoderKLWan, fused: bool) -> bool:
    """Give the decoder's residual blocks and causal convolutions the lean forwards (module doc), or back
    diffusers' own; returns whether the lean ones are on (never for a VAE :func:`fused_decode_applies` refuses)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanCausalConv3d,
        WanDecoder3d,
        WanResidualBlock,
        WanResidualUpBlock,
        WanUpsample,
    )

    fused = fused and fused_decode_applies(vae)
    for module in vae.decoder.modules():
        if isinstance(module, WanDecoder3d):
            kind = _decoder_forward
        elif isinstance(module, WanResidualBlock):
            kind = _residual_block_forward
        elif isinstance(module, WanResidualUpBlock):
            kind = _residual_up_block_forward
        elif isinstance(module, WanCausalConv3d):
            kind = _causal_conv_forward
        elif isinstance(module, WanUpsample) and module.mode in ("nearest", "nearest-exact"):
            kind = _upsample_forward
        else:
            continue
        if fused:
            module.forward = types.MethodType(kind, module)
        elif "forward" in module.__dict__:
            del module.forward  # the class's forward again
    return fused
