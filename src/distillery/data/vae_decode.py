"""The Wan 2.1 VAE's decode in time chunks larger than diffusers' one latent frame per decoder call.

``AutoencoderKLWan.decode`` runs its causal decoder once per latent frame, carrying each causal
convolution's last two input frames to the next call (its feature cache). Every convolution in the
decoder is causal in time (left padding only), the temporal upsamplers double each frame
independently of the frames' count, and the middle attention is per frame: so decoding latent frame 0
alone (the first chunk, where the upsamplers keep one frame) and then the remaining frames ``n`` at a
time through the same cache computes the same function — the same sums in another order (fp32:
differences of a few 1e-6; ``chunk_spans(T, 1)`` is diffusers' own loop, bit for bit). Larger calls
give cuDNN's 3D convolutions more work per launch; each call's activations grow with ``n``: the decoder's peak
holds about :data:`ACTIVATIONS_PER_FRAME` full-resolution ``base_dim``-channel activations per output frame
(measured at 81×480×832: +2.56 GiB per latent frame in bf16), which :func:`auto_chunk_frames` sizes against the
GPU's memory.

Contract: ``decode_video(vae, z, n)`` takes **raw** latents ``z [B, z_dim, T', H', W']`` in the VAE's
dtype (``denormalize_latents`` first) and returns ``vae.decode(z).sample``: ``[B, 3, 4(T'−1)+1, 8H', 8W']``
clamped to ``[-1, 1]``, in the VAE's dtype. VAEs this reasoning is not checked for (Wan 2.2's residual
up blocks and patchified output, a tiling VAE) go through ``vae.decode`` unchanged.

:func:`set_fused_decode` swaps two of the decoder's module types' forwards for leaner ones that compute the same
function: each residual block's RMS norm + SiLU is one pass in fp32 (one rounding to the VAE's dtype at the end,
where diffusers rounds after the norm and again after the scale), compiled into one kernel on CUDA; each causal
convolution pads in time only (the cache frames or zeros) and lets the convolution pad in space (diffusers copies
the whole input through ``F.pad`` first); the nearest-exact upsamplers stay in the VAE's dtype (diffusers goes
through fp32 and back: the same values). At 81×480×832 on an H200, 20 frames a call: fp32 2.49 → 2.12 s with the
fused blocks; bf16 1.62 → 1.54 s, measured before a recompile-limit fix (part of it ran eager) and not since
(BENCHMARKS.md "Validate's VAE decode"; the elementwise passes and copies are ~0.9 s of the bf16 decode's 1.56 s of
kernels, ``bench/vae_conv_probe.py``).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

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


def auto_chunk_frames(vae: AutoencoderKLWan, latent_shape: tuple[int, ...], device: torch.device,
                      total_memory: int | None = None) -> int:
    """Latent frames per decoder call for latents ``[C, T', H', W']`` (or their last three sizes) on ``device``:
    1 (diffusers' loop) off CUDA; on CUDA as many as keep one call's activations under a quarter of the GPU's
    total memory (``total_memory`` bytes, default the device's; not its free memory: the same GPU model and
    shape always decode alike), at most ``T' − 1``. 81×480×832: 13 frames in bf16 and 6 in fp32 on a 141 GB
    H200, 7 and 3 on an 80 GB H100."""
    frames, height, width = (int(v) for v in latent_shape[-3:])
    if device.type != "cuda" or frames <= 2:
        return 1
    cfg = vae.config
    scale_t, scale_s = int(cfg.scale_factor_temporal), int(cfg.scale_factor_spatial)
    itemsize = torch.empty((), dtype=vae.dtype).element_size()
    per_frame = ACTIVATIONS_PER_FRAME * scale_t * int(cfg.base_dim) * height * scale_s * width * scale_s * itemsize
    total = total_memory if total_memory is not None else torch.cuda.get_device_properties(device).total_memory
    budget = int(total) // DECODE_MEMORY_SHARE
    return max(1, min(frames - 1, budget // per_frame))


def chunked_decode_applies(vae: AutoencoderKLWan) -> bool:
    """Whether :func:`decode_video` may chunk this VAE: the Wan 2.1 layout (no residual up blocks, no
    patchified output) and no spatial tiling."""
    cfg = vae.config
    return (not getattr(cfg, "is_residual", False) and getattr(cfg, "patch_size", None) is None
            and not getattr(vae, "use_tiling", False))


@torch.no_grad()
def decode_video(vae: AutoencoderKLWan, z: torch.Tensor, chunk_frames: int) -> torch.Tensor:
    """Raw latents ``z [B, z_dim, T', H', W']`` → video ``[B, 3, T, H, W]`` in ``[-1, 1]`` (module doc);
    ``chunk_frames`` latent frames per decoder call after the first (1: diffusers' loop)."""
    if chunk_frames == 1 or not chunked_decode_applies(vae):
        return vae.decode(z, return_dict=False)[0]
    vae.clear_cache()
    try:
        x = vae.post_quant_conv(z)
        parts = []
        for i, (start, end) in enumerate(chunk_spans(int(x.shape[2]), chunk_frames)):
            vae._conv_idx = [0]  # the decoder walks its feature cache from the first convolution
            parts.append(vae.decoder(x[:, :, start:end], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                     first_chunk=i == 0))
    finally:
        vae.clear_cache()  # the cache holds activations of this video: never leak them into the next
    return torch.cat(parts, dim=2).clamp_(-1.0, 1.0)


CACHE_FRAMES = 2  # what diffusers' Wan decoder carries per causal convolution (its CACHE_T)


def norm_silu_reference(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``silu(x / max(‖x‖₂ over channels, 1e-12) · √C · γ)`` for ``x [B, C, T, H, W]``, ``γ [C, 1, 1, 1]``: Wan's
    ``WanRMS_norm`` (no bias) then SiLU, in fp32, rounded once to ``x``'s dtype."""
    xf = x.float()
    inv = torch.rsqrt(torch.clamp((xf * xf).sum(dim=1, keepdim=True), min=1e-24))
    return F.silu(xf * inv * (gamma.float() * float(x.shape[1]) ** 0.5)).to(x.dtype)


_compiled_norm_silu = None  # built on first use (torch.compile is lazy anyway; this keeps one wrapper)
NORM_SILU_GRAPHS = 32  # recompile limit of the compiled norm + SiLU (a decode in two dtypes compiled 7 on CPU)


def norm_silu(x: torch.Tensor, gamma: torch.Tensor, compiled: bool | None = None) -> torch.Tensor:
    """:func:`norm_silu_reference`; ``compiled`` (default: on CUDA) as one Inductor kernel with dynamic sizes.

    The compiled function sees a contiguous ``x`` and a plain tensor ``γ`` so that a graph covers every level
    and chunk of a decode (a strided ``x``, e.g. after an upsampler's permute, or a Parameter ``γ``, whose shape
    dynamo keeps static, would each compile graphs of their own); what remains (the first chunk's one frame,
    each dtype) stays far below the raised recompile limit, past which dynamo would silently run eager."""
    global _compiled_norm_silu
    if not (x.is_cuda if compiled is None else compiled):
        return norm_silu_reference(x, gamma)
    if _compiled_norm_silu is None:
        _compiled_norm_silu = torch.compile(norm_silu_reference, dynamic=True)
    with torch._dynamo.config.patch(recompile_limit=NORM_SILU_GRAPHS):
        return _compiled_norm_silu(x.contiguous(), gamma.detach())



def _causal_conv_forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """``WanCausalConv3d.forward``: left time padding from the cache (then zeros), spatial padding in the conv."""
    w_pad, h_pad, t_pad = self._padding[0], self._padding[2], self._padding[4]
    if t_pad > 0:
        parts = [x]
        if cache_x is not None:
            parts.insert(0, cache_x.to(x.device, x.dtype))
        missing = t_pad - (cache_x.shape[2] if cache_x is not None else 0)
        if missing > 0:
            b, c, _, h, w = x.shape
            parts.insert(0, x.new_zeros(b, c, missing, h, w))
        x = torch.cat(parts, dim=2)
    return F.conv3d(x, self.weight, self.bias, self.stride, (0, h_pad, w_pad), self.dilation, self.groups)


def _cached_conv(conv, x: torch.Tensor, feat_cache: list | None, feat_idx: list[int]) -> torch.Tensor:
    """One causal convolution of a residual block with diffusers' cache bookkeeping (the last two input frames)."""
    if feat_cache is None:
        return conv(x)
    idx = feat_idx[0]
    cache_x = x[:, :, -CACHE_FRAMES:].clone()
    if cache_x.shape[2] < CACHE_FRAMES and feat_cache[idx] is not None:
        cache_x = torch.cat([feat_cache[idx][:, :, -1:].to(cache_x.device), cache_x], dim=2)
    out = conv(x, feat_cache[idx])
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return out


def _residual_block_forward(self, x: torch.Tensor, feat_cache: list | None = None, feat_idx: list[int] = [0]):  # noqa: B006 - diffusers' signature
    """``WanResidualBlock.forward`` (dropout is the identity at eval) with the fused norm + SiLU."""
    h = self.conv_shortcut(x)
    x = _cached_conv(self.conv1, norm_silu(x, self.norm1.gamma), feat_cache, feat_idx)
    x = _cached_conv(self.conv2, norm_silu(x, self.norm2.gamma), feat_cache, feat_idx)
    return x.add_(h)


def _upsample_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``WanUpsample.forward`` without the round trip through fp32: nearest(-exact) upsampling copies values,
    so it is bit for bit the same in the tensor's own dtype."""
    return torch.nn.Upsample.forward(self, x)


def fused_decode_applies(vae: AutoencoderKLWan) -> bool:
    """Whether :func:`set_fused_decode` knows this VAE's blocks: Wan 2.1's (bias-free channel-first norms, SiLU,
    no dropout at eval) under :func:`chunked_decode_applies`."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock

    if not chunked_decode_applies(vae) or vae.training:
        return False
    for block in vae.decoder.modules():
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
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResidualBlock, WanUpsample

    fused = fused and fused_decode_applies(vae)
    for module in vae.decoder.modules():
        if isinstance(module, WanResidualBlock):
            kind = _residual_block_forward
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
