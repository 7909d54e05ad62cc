"""Check (GPU): the fused VAE decode's Triton kernels (``distillery.data.vae_kernels``) against the eager reference
at the Wan 2.1 decoder's real shapes, and their time.

For each decoder level of an 81×480×832 video (chunks of 10 latent frames: channels × frames × height × width) and
each dtype: the norm + SiLU kernel (bias folded in, written after 2 cached frames) and the bias + shortcut add,
each against ``norm_silu_reference`` / an fp32 sum (max abs difference, and the count of elements beyond
:data:`NORM_TOLERANCE`), then CUDA-event medians of the kernel and of the eager reference
with the GB/s they move. One JSON line per (level, dtype). Usage (device): ``python3 bench/vae_kernels_check.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_kernels import cuda_median_seconds  # noqa: E402

from distillery.data import vae_kernels  # noqa: E402
from distillery.data.vae_decode import norm_silu_reference  # noqa: E402

# |kernel − reference| ≤ tolerance · max(|reference|, 1): bf16 one rounding step (2⁻⁷ relative: the fp32 values
# before rounding differ in their last bits, so a few elements round the other way); fp32 the sums' other order and
# the GPU's exp in the sigmoid (outputs near silu's small negative tail lose relative precision, not absolute)
NORM_TOLERANCE = {torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}
LEVELS = {"level0": (384, 10, 60, 104), "level1": (384, 20, 120, 208), "level2": (192, 40, 240, 416),
          "level3": (96, 40, 480, 832)}


def check(level: str, shape: tuple[int, int, int, int], dtype: torch.dtype) -> dict:
    c, t, h, w = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, c, t, h, w, device="cuda", dtype=dtype, generator=gen)
    gamma = torch.rand(c, device="cuda", generator=gen) + 0.5
    bias = torch.randn(c, device="cuda", generator=gen) * 0.1
    prefix = torch.randn(1, c, 2, h, w, device="cuda", dtype=dtype, generator=gen)
    out = torch.empty(1, c, t + 2, h, w, device="cuda", dtype=dtype)
    out[:, :, :2].copy_(prefix)
    vae_kernels.norm_silu_into(x, gamma, out, 2, bias)
    expected = norm_silu_reference(x, gamma, prefix, bias)
    diff = (out.float() - expected.float()).abs()
    row: dict = {"level": level, "shape": [c, t, h, w], "dtype": str(dtype).removeprefix("torch."),
                 "norm_max_abs": float(diff.max()), "norm_tolerance": NORM_TOLERANCE[dtype],
                 "norm_beyond_tolerance": int((diff > NORM_TOLERANCE[dtype] * expected.float().abs().clamp(min=1.0)).sum()),
                 "prefix_intact": bool(torch.equal(out[:, :, :2], prefix))}
    y, skip = torch.randn_like(x), torch.randn_like(x)
    want = (y.float() + skip.float() + bias.float().reshape(1, -1, 1, 1, 1)).to(dtype)
    got = vae_kernels.bias_residual_(y.clone(), skip, bias)
    row["residual_max_abs"] = float((got.float() - want.float()).abs().max())
    row["residual_tolerance"] = float(torch.finfo(dtype).eps * want.float().abs().max())
    gb = x.numel() * x.element_size() / 1e9
    row["norm_kernel_ms"] = round(1e3 * cuda_median_seconds(lambda: vae_kernels.norm_silu_into(x, gamma, out, 2, bias)), 3)
    row["norm_reference_ms"] = round(1e3 * cuda_median_seconds(lambda: norm_silu_reference(x, gamma, prefix, bias)), 3)
    row["norm_kernel_gb_s"] = round(2 * gb / (row["norm_kernel_ms"] / 1e3), 1)  # x read once, out written once
    row["residual_kernel_ms"] = round(1e3 * cuda_median_seconds(lambda: vae_kernels.bias_residual_(y, skip, bias)), 3)
    row["residual_kernel_gb_s"] = round(3 * gb / (row["residual_kernel_ms"] / 1e3), 1)
    return row


def main() -> int:
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        for level, shape in LEVELS.items():
            row = check(level, shape, dtype)
            row["ok"] = (row["prefix_intact"] and row["norm_beyond_tolerance"] == 0
                         and row["residual_max_abs"] <= row["residual_tolerance"])
            ok &= row["ok"]
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
