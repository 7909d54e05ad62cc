"""Benchmark: where one real-shape validation video's latency goes, and what the validate options buy.

One process, one GPU, the real Wan2.1-T2V-1.3B shape (81×480×832: 21×60×104 latents, 32,760 tokens), through
validate's own parts (``SamplingContext``: the candidate's load, ``sample``, the base's VAE decode). The candidate is the
goal's: the teacher at 4 Euler steps with CFG (8 transformer forwards a video). Timed in this order, each the
median of ``--repeats`` after a warm-up:

- ``sample_eager_s``: the 8 forwards + sampler, eager (FlashAttention-4 where it imports: ``attention_backend: auto``);
- ``sample_compiled_s``: the same after each transformer block is compiled (``validate.compile``); the first
  compiled video's extra seconds are ``compile_s``; ``compiled_vs_eager_max_abs`` the latents' largest difference;
- ``decode[<dtype>:<chunk_frames>:<fused>[:cudnn_benchmark]]``: the VAE decode of those latents to ``uint8`` frames on the
  host (``BaseEncoders.decode_latents``) with the VAE in float32 / bfloat16 (``validate.vae_precision``),
  ``chunk_frames`` latent frames per decoder call after the first (``validate.vae_chunk_frames``; 1 is diffusers'
  frame-by-frame loop; ``auto``: sized to the GPU) and its residual blocks fused or not
  (``distillery.data.vae_decode``), optionally with ``torch.backends.cudnn.benchmark`` on (validate leaves it
  off: its picks vary between runs); per variant the peak memory it adds and its
  frames' mean / max absolute grey-level difference and PSNR against the first variant's (random VAE weights
  here: the size of the difference on a trained VAE is not measured by this);
- ``sample_compiled[<mode>]_s`` per ``--extra-compile-modes`` mode: the blocks recompiled in that ``torch.compile``
  mode (e.g. ``max-autotune-no-cudagraphs``), timed after the decodes, with its compile seconds.

``latency_<sampling>_<variant>_s`` sums one sampling and one decode: what validate's ``latency_s`` reports per video.
Writes ``$OUT/validate_latency.json``. Usage (device machine, under ``bash bench/gpu_job.sh run``):
``python bench/validate_latency.py [--base /tmp/real_shape_dag/wan-1.3b-shape]`` (a base is built there when
absent); ``BENCH_SMOKE=1`` on CPU checks the script at tiny shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shape_pipeline as rsp  # noqa: E402  (build_base, the shape constants)

OUT = Path(os.environ.get("OUT", "/tmp"))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> tuple[float, list[float], object]:
    """Median wall seconds of ``repeats`` calls of ``fn`` (synchronised), all the times, the last result."""
    times, result = [], None
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        result = fn()
        _sync()
        times.append(round(time.perf_counter() - t0, 4))
    return statistics.median(times), times, result


DECODE_VARIANTS = "fp32:1:0,bf16:1:0,bf16:20:0,bf16:20:1,bf16:auto:1,fp32:auto:1"


def decode_variants(ctx, latents: torch.Tensor, result: dict, args, save) -> None:
    """The VAE decode of ``latents`` to ``uint8`` host frames per ``dtype:chunk_frames:fused`` variant of
    ``--decode-variants`` (``distillery.data.vae_decode``; chunk ``auto``: ``auto_chunk_frames``), each with its
    peak GPU memory above what was allocated before it and its frames' grey-level difference from the first
    variant's (diffusers' fp32 decode by default)."""
    import math

    vae = ctx.encoders.vae
    result["decode"] = {}
    reference = None
    for spec in args.decode_variants.split(","):
        name, chunk, fused, *flags = spec.split(":")
        torch.backends.cudnn.benchmark = "cudnn_benchmark" in flags  # cuDNN times its algorithms per shape
        vae.to({"fp32": torch.float32, "bf16": torch.bfloat16}[name])
        ctx.encoders.configure_decode(None if chunk == "auto" else int(chunk), fused == "1")
        row: dict = {"chunk_frames": ctx.encoders.chunk_frames_for(tuple(latents.shape)), "fused": ctx.encoders.fused_decode}
        try:
            ctx.encoders.decode_latents(latents)  # warm-up: cuDNN's plans for this shape and layout
            before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            row["decode_s"], row["times"], out = timed(lambda: ctx.encoders.decode_latents(latents), args.repeats)
            if torch.cuda.is_available():
                row["peak_gib_above_before"] = round((torch.cuda.max_memory_allocated() - before) / 2 ** 30, 2)
            frames = torch.from_numpy(out)
            reference = frames if reference is None else reference
            diff = (frames.int() - reference.int()).abs().float()
            mse = float((diff ** 2).mean())
            row["vs_first"] = {"mean_abs": round(float(diff.mean()), 4), "max_abs": int(diff.max()),
                               "psnr_db": round(10 * math.log10(255 ** 2 / mse), 2) if mse > 0 else None}
        except torch.OutOfMemoryError as exc:
            row["error"] = "out of memory: " + str(exc).splitlines()[0]
        result["decode"][spec] = row
        torch.backends.cudnn.benchmark = False
        print(spec, json.dumps(row), flush=True)
        save()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> int:
    from distillery.evaluation.candidates import Candidate
    from distillery.evaluation.sampling_context import SamplingContext
    from distillery.evaluation.validation_config import ValidationConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="/tmp/real_shape_dag/wan-1.3b-shape")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--decode-only", action="store_true",
                        help="no transformer: decode random latents (the VAE's time does not depend on their values)")
    parser.add_argument("--decode-variants", default=DECODE_VARIANTS,
                        help="dtype:chunk_frames:fused,... (chunk 1, unfused: diffusers' frame-by-frame decode)")
    parser.add_argument("--extra-compile-modes", default="",
                        help="comma-separated torch.compile modes timed after the decodes (blocks recompiled)")
    args = parser.parse_args()
    base = Path(args.base)
    if not (base / "model_index.json").exists():
        base = rsp.build_base(base.parent, "small")
    device = rsp.DEVICE
    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "shape": [rsp.FRAMES, rsp.HEIGHT, rsp.WIDTH], "steps": args.steps,
                    "guidance_scale": args.guidance, "repeats": args.repeats}

    def save() -> None:
        (OUT / "validate_latency.json").write_text(json.dumps(result, indent=1))  # a run cut short keeps what it measured

    cfg = ValidationConfig(num_frames=rsp.FRAMES, height=rsp.HEIGHT, width=rsp.WIDTH, device=device, compile=False,
                           progress_bar=False, teacher_steps=[args.steps], guidance_scale=args.guidance)
    t0 = time.perf_counter()
    ctx = SamplingContext(base, ["a red circle moving left slowly on a black background"], cfg)
    if args.decode_only:
        latents = torch.randn(1, *ctx.latent_shape, generator=torch.Generator().manual_seed(0)).to(device)
        decode_variants(ctx, latents, result, args, save)
        print(json.dumps(result), flush=True)
        return 0
    cand = Candidate(f"teacher_{args.steps}", base, args.steps, args.guidance, "euler")
    loaded = ctx.load(cand, ctx.resolve(cand))
    ctx.warm_up(loaded)
    result["load_and_warm_up_s"] = round(time.perf_counter() - t0, 2)
    result["attention_backend"] = getattr(loaded.model, "attention_backend", None)

    def sample() -> torch.Tensor:
        return ctx.sample(cand, loaded, [0], [1234])

    result["sample_eager_s"], result["sample_eager_times"], eager = timed(sample, args.repeats)
    save()
    for block in loaded.model.shardable_blocks():
        block.compile()
    first, _, _ = timed(sample, 1)
    result["sample_compiled_s"], result["sample_compiled_times"], compiled = timed(sample, args.repeats)
    result["compile_s"] = round(first - result["sample_compiled_s"], 2)
    result["compiled_vs_eager_max_abs"] = float((compiled - eager).abs().max())
    save()

    decode_variants(ctx, eager, result, args, save)
    for mode in [m for m in args.extra_compile_modes.split(",") if m]:
        # another Inductor mode for the blocks (e.g. max-autotune-no-cudagraphs: Triton GEMMs with fused epilogues)
        torch._dynamo.reset()
        for block in loaded.model.shardable_blocks():
            block.compile(mode=mode)
        first, _, _ = timed(sample, 1)
        key = f"sample_compiled[{mode}]"
        result[key + "_s"], result[key + "_times"], other = timed(sample, args.repeats)
        result[key + "_compile_s"] = round(first - result[key + "_s"], 2)
        result[key + "_vs_eager_max_abs"] = float((other - eager).abs().max())
        print(key, result[key + "_s"], flush=True)
        save()
    samplings = ["eager", "compiled"] + [f"compiled[{m}]" for m in args.extra_compile_modes.split(",") if m]
    for sampling in samplings:
        for spec, row in result["decode"].items():
            if "decode_s" in row:
                result[f"latency_{sampling}_{spec}_s"] = round(result[f"sample_{sampling}_s"] + row["decode_s"], 3)
    result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if device == "cuda" else None
    save()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
