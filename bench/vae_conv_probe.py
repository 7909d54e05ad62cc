"""Probe (GPU): where the Wan 2.1 VAE decode's time goes at 81×480×832, and what the causal 3×3×3 convolution costs
as cuDNN's conv3d against the same sum done by 2D convolutions (frames as the batch, the time taps stacked as
channels, or three summed taps). Random weights and inputs. The profile decodes one video per ``--profile`` spec
``dtype:chunk_frames:fused`` (default ``bf16:20:0``: chunks of 20 latent frames with diffusers' own blocks; ``fused``
1: ``set_fused_decode``), after one warm-up decode, and lists its kernels' GPU seconds. Prints one JSON line per
measurement; results and reading: BENCHMARKS.md "Validate's VAE decode". Usage (device): ``python3
bench/vae_conv_probe.py [--no-convs] [--profile bf16:13:1 ...]``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_kernels import cuda_median_seconds  # noqa: E402


def timed(fn) -> float:
    """Median of 5 CUDA-event timings after one warm-up call (seconds)."""
    return cuda_median_seconds(fn, iters=5, warmup=1)


def conv_variants(c_in, c_out, t_out, h, w):
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1, c_in, t_out + 2, h + 2, w + 2, device=dev, dtype=dt)  # padded as WanCausalConv3d pads
    wt = torch.randn(c_out, c_in, 3, 3, 3, device=dev, dtype=dt) * 0.05
    bias = torch.randn(c_out, device=dev, dtype=dt)
    flops = 2 * 27 * c_in * c_out * t_out * h * w
    ref = F.conv3d(x, wt, bias)
    out = {"shape": [c_in, c_out, t_out, h, w], "tflop": round(flops / 1e12, 2)}
    s = timed(lambda: F.conv3d(x, wt, bias))
    out["conv3d_ncdhw_s"] = round(s, 4)
    xcl, wcl = x.contiguous(memory_format=torch.channels_last_3d), wt.contiguous(memory_format=torch.channels_last_3d)
    out["conv3d_ndhwc_s"] = round(timed(lambda: F.conv3d(xcl, wcl, bias)), 4)
    # frames as the batch: [T+2, C, H+2, W+2] channels-last; taps stacked as channels: [T, 3C, H+2, W+2]
    w2 = wt.permute(0, 2, 1, 3, 4).reshape(c_out, 3 * c_in, 3, 3).contiguous(memory_format=torch.channels_last)

    def stacked():
        frames = x[0].permute(1, 0, 2, 3)  # [T+2, C, H+2, W+2] (a view)
        taps = torch.cat([frames[k:k + t_out] for k in range(3)], dim=1).contiguous(memory_format=torch.channels_last)
        return F.conv2d(taps, w2, bias)

    out["conv2d_stacked_s"] = round(timed(stacked), 4)
    got = stacked().permute(1, 0, 2, 3).unsqueeze(0)
    out["stacked_max_abs_vs_conv3d"] = float((got.float() - ref.float()).abs().max())
    fr = x[0].permute(1, 0, 2, 3).contiguous(memory_format=torch.channels_last)
    w_taps = [wt[:, :, k].contiguous(memory_format=torch.channels_last) for k in range(3)]

    def three_taps():
        acc = F.conv2d(fr[0:t_out], w_taps[0], bias).float()
        acc += F.conv2d(fr[1:t_out + 1], w_taps[1]).float()
        acc += F.conv2d(fr[2:t_out + 2], w_taps[2]).float()
        return acc.to(torch.bfloat16)

    out["conv2d_three_taps_s"] = round(timed(three_taps), 4)
    for k in [k for k in out if k.endswith("_s")]:
        out[k[:-2] + "_tflops"] = round(flops / out[k] / 1e12, 1)
    return out


def profile_decode(spec: str) -> dict:
    from diffusers import AutoencoderKLWan
    from torch.profiler import ProfilerActivity, profile

    from distillery.data.vae_decode import decode_video, set_fused_decode

    name, chunk, fused = spec.split(":")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
    vae = AutoencoderKLWan().to("cuda", dtype).eval()
    set_fused_decode(vae, fused == "1")
    z = torch.randn(1, 16, 21, 60, 104, device="cuda", dtype=dtype)
    with torch.no_grad():
        decode_video(vae, z, int(chunk))
        torch.cuda.synchronize()
        start = time.perf_counter()
        decode_video(vae, z, int(chunk))
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode_video(vae, z, int(chunk))
            torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.device_time_total > 0:
            per[e.name] = per.get(e.name, 0.0) + e.device_time_total / 1e6
    top = sorted(per.items(), key=lambda kv: -kv[1])[:25]
    return {"profile": spec, "wall_s": round(wall, 4), "kernels_s": round(sum(per.values()), 4),
            "top": [(n[:120], round(s, 4)) for n, s in top]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-convs", action="store_true", help="only the decode profiles")
    parser.add_argument("--profile", action="append", default=None, help="dtype:chunk_frames:fused (repeatable)")
    args = parser.parse_args()
    if not args.no_convs:
        torch.backends.cudnn.benchmark = True  # the convolutions' best cuDNN plans
        for shape in ((96, 96, 80, 480, 832), (192, 192, 80, 240, 416), (384, 384, 40, 120, 208)):
            print(json.dumps(conv_variants(*shape)), flush=True)
            torch.cuda.empty_cache()
    torch.backends.cudnn.benchmark = False  # the decode as validate runs it
    for spec in args.profile or ["bf16:20:0"]:
        print(json.dumps(profile_decode(spec)), flush=True)
        torch.cuda.empty_cache()
