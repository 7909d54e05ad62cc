"""Benchmark: ODE-init's trajectory generation (``pretrain.method: ode_init``) per prompt at the real shape.

What ``distillery.sampling.trajectories.teacher_trajectory`` costs for one prompt: the teacher's Euler ODE with CFG
(two forwards a step) over the paper's grid — 48 steps at shift 5 with t_list 999, 937, 833, 624, 0 added: 52
intervals, 104 forwards — at 81×480×832 (latents 16×21×60×104, 32 760 tokens; 512×4096 text), in bf16 on one GPU,
through the model plugin the stage uses (:func:`distillery.models.wan.inference.load_inference_model` over a
random-weight transformer in Wan's real layout: ``1.3b`` 30 layers × 1536, ``14b`` 40 layers × 5120).

``--intervals N``: time the first N grid intervals only (after one warm-up interval) and give the whole
trajectory as N-interval time × 52 / N — said so in the output (``extrapolated``); 0: the whole trajectory.

Usage (device machine):  python bench/trajectories.py --model 1.3b --intervals 0
                          python bench/trajectories.py --model 14b --intervals 6
Prints one JSON line per run and writes ``$OUT/trajectories_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

WAN = {
    "1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
    "14b": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40),
}
COMMON = dict(_class_name="WanTransformer3DModel", patch_size=[1, 2, 2], in_channels=16, out_channels=16, text_dim=4096,
              freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
T_LIST = (999.0, 937.0, 833.0, 624.0, 0.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(WAN), default="1.3b")
    ap.add_argument("--latent", type=int, nargs=3, default=[21, 60, 104])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--shift", type=float, default=5.0)
    ap.add_argument("--guidance", type=float, default=4.0)
    ap.add_argument("--intervals", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    if os.environ.get("BENCH_SMOKE") == "1":  # a CPU check of this script: tiny shapes
        WAN[args.model] = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=32, num_layers=2)
        COMMON["text_dim"] = 64
        args.latent = [3, 8, 8]
    from diffusers import WanTransformer3DModel

    from distillery.models.wan.inference import load_inference_model
    from distillery.sampling.trajectories import ode_grid, teacher_trajectory

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = {**COMMON, **WAN[args.model]}
    folder = Path(tempfile.mkdtemp())
    (folder / "transformer").mkdir()
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": args.shift, "num_train_timesteps": 1000}))
    with torch.device(device):
        transformer = WanTransformer3DModel.from_config(config)  # fp32; the loader casts to bf16, norms kept fp32
    teacher = load_inference_model(folder, device, dtype, shift=args.shift, role="teacher", transformer=transformer)
    params = sum(p.numel() for p in transformer.parameters())
    grid, record = ode_grid(teacher.schedule.inference_sigmas(args.steps), T_LIST, 1000)
    intervals = len(grid) - 1
    g = torch.Generator().manual_seed(0)
    text_len = 16 if os.environ.get("BENCH_SMOKE") == "1" else 512
    text = torch.randn(args.batch, text_len, config["text_dim"], generator=g).to(device)
    negative = torch.randn(args.batch, text_len, config["text_dim"], generator=g).to(device)
    noise = torch.randn(args.batch, 16, *args.latent, generator=g)

    def run(upto: int) -> float:
        """Seconds of the trajectory over the first ``upto`` intervals (its points at the grid indices below)."""
        sub = grid[:upto + 1]
        keep = [i for i in record if i <= upto] or [0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        teacher_trajectory(teacher, text, negative, noise, sub, keep, args.guidance)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(1)  # warm-up: kernels, allocator
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed = args.intervals or intervals
    seconds = run(timed)
    whole = seconds * intervals / timed
    row = {"model": args.model, "params": params, "latent": [16, *args.latent], "batch": args.batch, "steps": args.steps,
           "grid_intervals": intervals, "forwards": 2 * intervals, "timed_intervals": timed,
           "seconds_timed": round(seconds, 3), "seconds_per_forward": round(seconds / (2 * timed), 4),
           "seconds_per_trajectory": round(whole, 2), "seconds_per_prompt": round(whole / args.batch, 2),
           "extrapolated": timed != intervals, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
           "attention": getattr(teacher, "attention_backend", None)}
    print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "/tmp")) / f"trajectories_{args.model}.json"
    out.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
