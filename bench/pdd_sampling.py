"""Benchmark: per-video sampling latency of a PDD student's fused blocks vs the teacher's many-step Euler.

One process, one GPU, the Wan2.1-T2V-1.3B shape with random weights in bf16 (eager; the modules diffusers keeps in
fp32 stay fp32, as ``load_inference_model(dtype=bf16)`` leaves them), one video of latent ``T×H×W`` (default
21×60×104: 81 frames at 480×832), 512 text tokens of 4096:

  - ``pdd_<N>``: ``pdd_fused`` at N NFE (N fused-block forwards of a ``PDDWanModel`` with ``pdd_steps`` 8, no CFG);
  - ``teacher_<S>``: ``euler`` at S steps with CFG 4 (2·S forwards), the same trunk as a plain ``WanModel``.

Per configuration: one untimed warm-up call (the teacher: a 1-step call, the same kernels), then the median (and all) of ``--repeats``
timed calls (CUDA-synchronised
wall time, and the GPU span from CUDA events); peak memory. Sampling only: no VAE decode, no text encoder.

Usage (device machine): ``python bench/pdd_sampling.py [--latent 21x60x104] [--nfe 1,2,4] [--teacher-steps 40]``;
prints a table and writes ``$OUT/pdd_sampling.json``. CPU check: ``BENCH_SMOKE=1 python bench/pdd_sampling.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_step import TEXT_DIM, TEXT_LEN, make_assets  # noqa: E402

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
PDD_STEPS = 8


def timed(fn, repeats: int, cuda: bool, warm=None) -> dict:
    """``warm`` (default ``fn``): the untimed warm-up call."""
    import torch

    (warm or fn)()
    walls, gpus = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        fn()
        if cuda:
            b.record()
            torch.cuda.synchronize()
            gpus.append(a.elapsed_time(b) / 1e3)
        walls.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(walls), "times_s": walls, "gpu_median_s": statistics.median(gpus) if gpus else None}


def main() -> int:
    import torch

    from distillery.models.base import Conditioning, cast_keeping_fp32_modules
    from distillery.models.wan import WanModel, WanModelConfig
    from distillery.models.wan.pdd import PDDWanModel, PDDWanModelConfig
    from distillery.sampling import build_sampler

    parser = argparse.ArgumentParser()
    parser.add_argument("--latent", default="3x8x8" if SMOKE else "21x60x104")
    parser.add_argument("--nfe", default="1,2,4")
    parser.add_argument("--teacher-steps", default="40")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--teacher-repeats", type=int, default=1)
    args = parser.parse_args()
    size = tuple(int(v) for v in args.latent.split("x"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, _ = make_assets(Path(tmp), size)
        if SMOKE:  # the tiny base instead of the 1.3B shape
            from distillery.tinybase.shipped import shipped_tiny_base

            model_dir = shipped_tiny_base()
        with torch.device(device):
            student = PDDWanModel(PDDWanModelConfig(init_from=str(model_dir), trainable=False, random_init=not SMOKE,
                                                    pdd_steps=PDD_STEPS), "student")
        student.transformer.to(device).eval().requires_grad_(False)
        cast_keeping_fp32_modules(student.transformer, dtype)
        student.bind_device(device, dtype)
        teacher = WanModel(WanModelConfig(init_from=str(model_dir), trainable=False), "teacher", transformer=student.transformer)
        teacher.bind_device(device, dtype)
        conf = student.transformer_config()
        g = torch.Generator().manual_seed(0)
        text_len, text_dim = (8, int(conf["text_dim"])) if SMOKE else (TEXT_LEN, TEXT_DIM)
        cond = Conditioning(torch.randn(1, text_len, text_dim, generator=g).to(device), torch.zeros(1, text_len, text_dim, device=device))
        shape = (int(conf["in_channels"]), *size)
        pdd = build_sampler({"sampler": "pdd_fused", "shift": 3.0, "pdd_steps": PDD_STEPS})
        euler = build_sampler({"sampler": "euler", "shift": 3.0})
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            for n in (int(v) for v in args.nfe.split(",")):
                res = timed(lambda: pdd.sample(student, cond, shape, torch.Generator(device).manual_seed(0), num_steps=n),
                            args.repeats, cuda)
                rows.append({"candidate": f"pdd_{n}", "nfe": pdd.nfe(n), **res})
                print(json.dumps(rows[-1]), flush=True)
            for steps in (int(v) for v in args.teacher_steps.split(",")):
                res = timed(lambda: euler.sample(teacher, cond, shape, torch.Generator(device).manual_seed(0), num_steps=steps,
                                                 guidance_scale=4.0), args.teacher_repeats, cuda,
                            warm=lambda: euler.sample(teacher, cond, shape, torch.Generator(device).manual_seed(0), num_steps=1,
                                                      guidance_scale=4.0))  # warm-up: one step (the same kernels)
                rows.append({"candidate": f"teacher_{steps}", "nfe": euler.nfe(steps, 4.0), **res})
                print(json.dumps(rows[-1]), flush=True)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    out = {"latent": list(size), "dtype": str(dtype), "device": torch.cuda.get_device_name() if cuda else "cpu",
           "peak_mem_gib": peak, "rows": rows}
    Path(os.environ.get("OUT", "/tmp"), "pdd_sampling.json").write_text(json.dumps(out, indent=1))
    print(f"{'candidate':>12} {'NFE':>4} {'median s':>9} {'GPU s':>8}")
    for r in rows:
        gpu = r["gpu_median_s"] if r["gpu_median_s"] is not None else float("nan")
        print(f"{r['candidate']:>12} {r['nfe']:>4} {r['median_s']:9.3f} {gpu:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
