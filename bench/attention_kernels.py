"""Benchmark: self-attention kernels at the Wan2.1-1.3B training shape (forward and backward).

Wan's self-attention at latent T×H×W has n = T·(H/2)·(W/2) tokens, 12 heads of 128; diffusers' native
processor calls SDPA on ``[B, heads, n, 128]`` views of ``[B, n, heads, 128]`` tensors. For each
available kernel (SDPA with cuDNN, flash (FA2), memory-efficient; the same cuDNN call on contiguous
``[B, heads, n, 128]``; compiled flex_attention) this times forward and backward separately with
CUDA events (median of 10 after 3 warm-ups) and reports TFLOP/s (4·n²·d per forward, 2× that for
backward, d = 1536). Usage (device machine): ``python bench/attention_kernels.py [--tokens 32760,8190]``.
Prints one JSON line per case and writes ``$OUT/attention_kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM = 12, 128


def cuda_median_seconds(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median of ``iters`` CUDA-event timings of ``fn`` in seconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def bench_case(name: str, attend, n: int, strided: bool) -> dict:
    """``attend(q, k, v) -> out`` on ``[1, heads, n, 128]`` bf16 tensors (strided views when ``strided``)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def make() -> torch.Tensor:
        if strided:
            t = torch.randn(1, n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        else:
            t = torch.randn(1, HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        return t.requires_grad_(True)

    q, k, v = make(), make(), make()
    out = attend(q, k, v)
    grad = torch.randn_like(out)
    fwd = cuda_median_seconds(lambda: attend(q, k, v))

    def fwd_bwd() -> None:
        o = attend(q, k, v)
        torch.autograd.grad(o, (q, k, v), grad)

    total = cuda_median_seconds(fwd_bwd)
    flops = 4 * n * n * HEADS * HEAD_DIM
    bwd = total - fwd
    return {"case": name, "tokens": n, "fwd_s": fwd, "bwd_s": bwd, "fwd_tflops": flops / fwd / 1e12,
            "bwd_tflops": 2 * flops / bwd / 1e12, "fwd_bwd_s": total}


def sdpa_with(backend: SDPBackend):
    def attend(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)
    return attend


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="32760,8190")
    args = parser.parse_args()
    from torch.nn.attention import list_flash_attention_impls

    info = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "device": torch.cuda.get_device_name(),
            "flash_impls": list_flash_attention_impls()}
    for module in ("flash_attn_interface", "flash_attn", "flash_attn.cute"):
        try:
            __import__(module)
            info[module] = "importable"
        except Exception as exc:  # noqa: BLE001 - report what is there
            info[module] = f"no ({type(exc).__name__})"
    print(json.dumps(info), flush=True)
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    cases = [("sdpa cudnn (diffusers strides)", sdpa_with(SDPBackend.CUDNN_ATTENTION), True),
             ("sdpa cudnn (contiguous BHSD)", sdpa_with(SDPBackend.CUDNN_ATTENTION), False),
             ("sdpa flash FA2 (diffusers strides)", sdpa_with(SDPBackend.FLASH_ATTENTION), True),
             ("sdpa mem-efficient (diffusers strides)", sdpa_with(SDPBackend.EFFICIENT_ATTENTION), True),
             ("flex_attention compiled (contiguous)", lambda q, k, v: flex(q, k, v), False)]
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        for name, fn, strided in cases:
            try:
                row = bench_case(name, fn, n, strided)
            except Exception as exc:  # noqa: BLE001 - a kernel that does not run here is a result too
                row = {"case": name, "tokens": n, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", "/tmp")) / "attention_kernels.json"
    out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
