"""Block-sparse video attention on the GPU (issue 64): FlashAttention-4's path against the dense masked reference, and
its kernel time against dense FA4 at the real shape.

1. **Agreement** (``agreement``): ``video_sparse_attention(..., fa4=True)`` — the tiles laid out 128 slots each, the
   coarse selection, FA4's block-sparse forward and backward over the lists, the pads masked by the CuTe
   ``mask_mod`` — against :func:`~distillery.models.wan.sparse_attention.masked_reference` (raster order, fp32) on the
   same bf16 inputs: forward outputs and the gradients of q, k, v, as relative L2 errors beside the bf16 floor (the
   reference's output rounded to bf16). Bidirectional, block-causal (chunks of 3 frames) and streaming (the last
   chunk's queries over the cache), at a 6×30×52 token grid (6 latent frames of an 81×480×832 video: the reference
   holds every score in fp32), 4 heads of 128.
2. **Kernels** (``kernels``): one self-attention call of 32,760 tokens, 12 heads × 128, bf16: dense FA4 against the
   sparse path at each ``--sparsities`` (forward, and forward + backward; median ms of ``--repeats`` after warm-up),
   with the share of key tiles each query tile reads.

Writes ``$OUT/sparse_attention_check.json``. ``BENCH_SMOKE=1`` runs it on the CPU at a tiny grid (the reference path
both sides: a check of this script). Usage (device machine, the FA4 wheels installed: ``source device-env.sh`` after a
``../shared/tools/device-wheels.sh`` batch, as ``bash bench/gpu_job.sh fa4`` sources it; with
``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` a later call on the same machine reuses the compiled kernels):
``python3 bench/sparse_attention_check.py [--grid 21,30,52] [--sparsities 0.8,0.9]``. A failure of the FA4 kernel is a
result, not a crash: ``fa4_kernel_failure`` (the torch path ran instead) or ``error`` in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

OUT = Path(os.environ.get("OUT", "/tmp"))
SMOKE = os.environ.get("BENCH_SMOKE") == "1"


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def agreement(grid, tile, sparsity, heads, dim, device, use_fa4) -> dict:
    import torch

    from distillery.models.wan import sparse_attention as sa

    spec = sa.SparseSpec(sparsity, tile)
    t, h, w = grid
    rows = {}
    cases = {"bidirectional": (0, None), "block_causal": (0, sa.Causal(3)), "streaming_last_chunk": (t - 3, sa.Causal(3))}
    for name, (q_start, causal) in cases.items():
        g = torch.Generator(device).manual_seed(0)
        dtype = torch.bfloat16 if use_fa4 else torch.float32
        q = torch.randn(1, (t - q_start) * h * w, heads, dim, generator=g, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, t * h * w, heads, dim, generator=g, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        dout = torch.randn(q.shape, generator=g, device=device, dtype=dtype)
        out = sa.video_sparse_attention(q, k, v, spec, grid, q_start=q_start, causal=causal, fa4=use_fa4)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        qf, kf, vf = (x.detach().float().requires_grad_(True) for x in (q, k, v))
        ref = sa.masked_reference(qf, kf, vf, spec, grid, q_start=q_start, causal=causal)
        ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
        floor = rel(ref.detach().to(dtype), ref)  # what rounding the exact result to the kernel's dtype costs
        rows[name] = {"forward_rel_l2": rel(out, ref), "bf16_floor": floor,
                      "grad_rel_l2": {n: rel(a, b) for n, a, b in zip("qkv", grads, ref_grads)}}
    return rows


def kernels(grid, tile, sparsities, heads, dim, device, repeats) -> dict:
    import torch

    from distillery.models.wan import sparse_attention as sa

    t, h, w = grid
    g = torch.Generator(device).manual_seed(1)
    q, k, v = (torch.randn(1, t * h * w, heads, dim, generator=g, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def timed(fn) -> float:
        times = []
        for i in range(repeats + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(1000 * (time.perf_counter() - t0))
        return round(statistics.median(times), 3)

    def dense():
        from flash_attn.cute.interface import _flash_attn_fwd

        return _flash_attn_fwd(q, k, v)[0]

    from distillery.models.wan.attention import fa4_attention

    rows = {"dense_fa4": {"fwd_ms": timed(lambda: dense()),
                          "fwd_bwd_ms": timed(lambda: torch.autograd.grad(fa4_attention(q, k, v), (q, k, v), dout))}}
    for s in sparsities:
        spec = sa.SparseSpec(s, tile)
        lay = sa.layout(grid, tile, sa.capacity_for(tile, True), q.device)

        def fwd():
            with torch.no_grad():
                return sa.video_sparse_attention(q, k, v, spec, grid, fa4=True)

        rows[f"sparse_{s}"] = {"fwd_ms": timed(fwd),
                               "fwd_bwd_ms": timed(lambda: torch.autograd.grad(
                                   sa.video_sparse_attention(q, k, v, spec, grid, fa4=True), (q, k, v), dout)),
                               "tiles": lay.blocks, "kept_per_query_tile": sa.keep_count(s, lay.blocks)}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="3,4,6" if SMOKE else "21,30,52", help="the kernels' token grid")
    parser.add_argument("--agreement-grid", default="6,4,6" if SMOKE else "6,30,52")
    parser.add_argument("--tile", default="1,16,8")
    parser.add_argument("--sparsities", default="0.8,0.9")
    parser.add_argument("--heads", type=int, default=2 if SMOKE else 12)
    parser.add_argument("--agreement-heads", type=int, default=2 if SMOKE else 4)
    parser.add_argument("--dim", type=int, default=8 if SMOKE else 128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=str(OUT / "sparse_attention_check.json"))
    args = parser.parse_args()
    import torch

    from distillery.models.wan.attention import fa4_problem

    device = "cuda" if torch.cuda.is_available() else "cpu"
    problem = fa4_problem(device, torch.bfloat16)
    grid = tuple(int(x) for x in args.grid.split(","))
    tile = tuple(int(x) for x in args.tile.split(","))
    sparsities = [float(x) for x in args.sparsities.split(",")]
    result: dict = {"grid": grid, "tile": tile, "heads": args.heads, "dim": args.dim, "fa4": problem or "runs",
                    "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        agree_grid = tuple(int(x) for x in args.agreement_grid.split(","))
        result["agreement"] = agreement(agree_grid, tile, sparsities[-1], args.agreement_heads, args.dim, device, problem is None)
        if problem is None:
            result["kernels"] = kernels(grid, tile, sparsities, args.heads, args.dim, device, args.repeats)
        from distillery.models.wan import sparse_attention as sa

        result["fa4_kernel_failure"] = sa._fa4_failure  # not None: the kernel failed and the torch path ran instead
    except Exception as exc:  # a failure is a result: the lead reads it in the JSON
        import traceback

        result["error"] = f"{type(exc).__name__}: {str(exc)[:800]}"
        result["traceback"] = traceback.format_exc()[-4000:]
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
