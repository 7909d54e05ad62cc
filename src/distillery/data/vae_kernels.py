"""Triton kernels for the fused Wan 2.1 VAE decode on a GPU (:mod:`distillery.data.vae_decode`).

Two memory-bound passes of each decoder residual block, written so that every element is read and written once
and no address is divided per element (each program owns whole channel columns or one channel's row). The same
norm compiled by Inductor with dynamic shapes took 0.27 s of the 81×480×832 bf16 decode at about a fifth of the
H200's bandwidth — index arithmetic on runtime sizes being the likely cause, not inspected; these kernels move
2.2–2.6 TB/s (norm) and ~4 TB/s (add) at the decoder's large levels (BENCHMARKS.md "Validate's VAE decode"):

- :func:`norm_silu_into`: ``out[b, :, p:] = silu((x + bias)[b] / max(‖·‖₂ over channels, 1e-12) · √C · γ)`` — Wan's
  channel RMS norm and SiLU in fp32 with the previous convolution's bias folded in, written after the ``p``
  cached frames of a causal convolution's padded input (one rounding to the output's dtype);
- :func:`bias_residual_`: ``x += bias + h`` in place, in fp32 (one rounding) — a block's second convolution's
  bias and its shortcut.

Contract: ``x``/``h`` contiguous ``[B, C, T, H, W]``, ``out`` contiguous ``[B, C, p + T, H, W]``, ``γ`` and
``bias`` ``C`` values (any shape that flattens to ``C``), all on one CUDA device; ``C ≤`` :data:`MAX_CHANNELS`.
:func:`available` says whether they can run (Triton imports, the tensor is on CUDA, no kernel failed in this
process: :func:`disable`); otherwise callers use the eager reference (``vae_decode.norm_silu_reference``).
Checked against it on the GPU by ``bench/vae_kernels_check.py``; on a CPU with Triton installed,
``TRITON_INTERPRET=1`` runs them too.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

MAX_CHANNELS = 1024  # one program holds every channel of its positions (decoders: Wan 2.1 ≤ 384, Wan 2.2 ≤ 1024)
TILE_ELEMENTS = 8192  # channels × positions per program of the norm kernel
MAX_GRID_ROWS = 65535  # a CUDA grid's second axis: the norm's samples, the add's (sample, channel) rows per launch


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


_failure: str | None = None  # why the kernels failed in this process (then the eager reference runs instead)


def available(x: torch.Tensor) -> bool:
    """Whether the kernels run for ``x``: Triton imports, ``x`` is on CUDA (or Triton's interpreter is on) and no
    kernel has failed in this process (:func:`disable`)."""
    return _failure is None and _triton_importable() and (x.is_cuda or _interpreting()) and x.shape[1] <= MAX_CHANNELS


def disable(error: BaseException) -> None:
    """Stop using the kernels in this process after ``error`` (Triton could not compile or launch them here: an
    older GPU, a broken toolchain); says so once. The decode stays right: the eager reference computes the same."""
    global _failure
    if _failure is None:
        _failure = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        logger.warning("the VAE decode's Triton kernels failed (%s); decoding with the eager passes instead", _failure)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def norm_silu_kernel(x_ptr, bias_ptr, gamma_ptr, out_ptr, C, S, OUT_ROW, OUT_OFFSET, scale,
                         HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
        b = tl.program_id(1).to(tl.int64)
        s = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
        c = tl.arange(0, BLOCK_C)
        c_ok = c < C
        mask = c_ok[:, None] & (s[None, :] < S)
        rows = b * C + c.to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * S + s[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x = tl.where(mask, x + tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[:, None], 0.0)
        inv = 1.0 / tl.sqrt(tl.maximum(tl.sum(x * x, axis=0), 1e-24))
        g = tl.load(gamma_ptr + c, mask=c_ok, other=0.0).to(tl.float32) * scale
        y = x * inv[None, :] * g[:, None]
        y = y * tl.sigmoid(y)
        tl.store(out_ptr + rows[:, None] * OUT_ROW + OUT_OFFSET + s[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mask)  # a downcast rounds to nearest even on the GPU

    @triton.jit
    def bias_residual_kernel(x_ptr, h_ptr, bias_ptr, C, S, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(1)
        s = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = s < S
        offsets = row.to(tl.int64) * S + s
        v = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v += tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += tl.load(bias_ptr + row % C).to(tl.float32)
        tl.store(x_ptr + offsets, v.to(x_ptr.dtype.element_ty), mask=mask)

    return triton, norm_silu_kernel, bias_residual_kernel


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def norm_silu_into(x: torch.Tensor, gamma: torch.Tensor, out: torch.Tensor, prefix_frames: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Write the normalised, SiLU'd ``x`` (plus ``bias``) into ``out[:, :, prefix_frames:]`` (module doc); the
    first ``prefix_frames`` frames of ``out`` are left as they are. Returns ``out``."""
    triton, kernel, _ = _kernels()
    b, c, t, h, w = x.shape
    if not x.is_contiguous() or not out.is_contiguous() or out.shape != (b, c, prefix_frames + t, h, w):
        raise ValueError(f"norm_silu_into: x {tuple(x.shape)} and out {tuple(out.shape)} must be contiguous, "
                         f"out = x with {prefix_frames} more frames")
    if c > MAX_CHANNELS:
        raise ValueError(f"norm_silu_into: {c} channels > {MAX_CHANNELS}")
    block_c = _next_power_of_two(c)
    block_s = max(16, TILE_ELEMENTS // block_c)
    s = t * h * w
    if b > MAX_GRID_ROWS:
        raise ValueError(f"norm_silu_into: batch {b} > {MAX_GRID_ROWS}")
    grid = (triton.cdiv(s, block_s), b)
    gamma = gamma.detach().reshape(-1).contiguous()
    bias_arg = bias.detach().reshape(-1).contiguous() if bias is not None else gamma
    kernel[grid](x, bias_arg, gamma, out, c, s, (prefix_frames + t) * h * w, prefix_frames * h * w,
                 float(c) ** 0.5, HAS_BIAS=bias is not None, BLOCK_C=block_c, BLOCK_S=block_s, num_warps=8)
    return out


def bias_residual_(x: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x += bias (per channel) + h`` in place, summed in fp32 (module doc). Returns ``x``."""
    triton, _, kernel = _kernels()
    if not x.is_contiguous() or not h.is_contiguous() or h.shape != x.shape:
        raise ValueError(f"bias_residual_: x {tuple(x.shape)} and h {tuple(h.shape)} must be contiguous and alike")
    b, c = int(x.shape[0]), int(x.shape[1])
    s = x[0, 0].numel()
    block = 2048
    bias_arg = bias.detach().reshape(-1).contiguous() if bias is not None else x
    per_launch = max(1, MAX_GRID_ROWS // c)  # samples per launch: (sample, channel) rows are the grid's second axis
    for start in range(0, b, per_launch):
        rows = x[start:start + per_launch]
        kernel[(triton.cdiv(s, block), rows.shape[0] * c)](rows, h[start:start + per_launch], bias_arg, c, s,
                                                           HAS_BIAS=bias is not None, BLOCK=block, num_warps=8)
    return x
