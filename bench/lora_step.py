"""Benchmark: SFT and DMD2 training steps with a LoRA adapter (``models.<role>.lora``) vs full weights, Wan2.1-1.3B shape.

Each configuration runs in its own process (peak memory per configuration) through the real ``Trainer``, built as
``bench/sft_step.py`` (SFT: one trainable student) and ``bench/distill_step.py`` (DMD2 ``data_latent``: student and
critic train, the teacher is frozen; guidance 4, every iteration a generator + critic update) build them — random
Wan-1.3B weights drawn on the GPU, batch 1, 512×4096 text, grad clipping, bf16 compute — and differs only in
``models.student.lora`` (and, for DMD2, ``models.critic.lora``): rank ``--rank`` (alpha = rank) on
``--targets`` (default q, k, v, out of both attentions and the two FFN projections of every block).

Per configuration: the median post-warm-up step time (the trainer's ``step_time_s``), the peak and static (after the
build, before the first step) CUDA memory, and the trainable parameters (what the optimizer holds state for).

Default shape: latents 21×60×104 = 81 frames at 480×832 (``--size``); activation checkpointing on (``--ac``; DMD2 at
this shape needs it on one H200, BENCHMARKS.md).

Usage (device machine):  python bench/lora_step.py [--methods sft,dmd2] [--forms full,lora] [--rank 64] [--steps 8 --warmup 3]
One configuration:         python bench/lora_step.py --one sft lora
Prints a table and writes ``$OUT/lora_step<tag>.json`` after every configuration.
CPU check of this script:  ``BENCH_SMOKE=1 python bench/lora_step.py`` (tiny model and latents; times mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_step import distill_run_config  # noqa: E402
from sft_step import TEXT_DIM, TEXT_LEN, bench_run_config, init_weights_on, make_assets  # noqa: E402

SIZE = (3, 8, 8) if os.environ.get("BENCH_SMOKE") == "1" else (21, 60, 104)  # latent T×H×W (81×480×832 pixels)
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def run_config(method: str, form: str, model: Path, data: Path, out: Path, steps: int, compile_blocks: bool | None,
               ac: bool, rank: int, targets: list[str]) -> dict:
    """The raw run config: sft_step's / distill_step's, with a LoRA on every trainable role when ``form`` is ``lora``."""
    if method == "sft":
        raw = bench_run_config(model, data, out, steps, compile_blocks, False, ac=ac)
    else:
        raw = distill_run_config(model, data, out, "dmd2_data", steps, compile_blocks, ac)
    if form == "lora":
        for role, entry in raw["models"].items():
            if entry.get("trainable", True):
                entry["lora"] = {"rank": rank, "alpha": float(rank), "target_modules": targets}
    return raw


def run_one(method: str, form: str, size: tuple[int, int, int], steps: int, warmup: int, compile_blocks: bool | None,
            ac: bool, rank: int, targets: list[str]) -> dict:
    import torch

    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.data.dataset import write_empty_prompt_embedding
    from distillery.engine.assemble import build_trainer

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        model, data = make_assets(Path(tmp), size)
        # DMD2's guided real score needs the empty prompt's embedding (sft_step's set has none); a random one here
        write_empty_prompt_embedding(data, torch.randn(TEXT_LEN, TEXT_DIM, generator=torch.Generator().manual_seed(1)).bfloat16())
        raw = run_config(method, form, model, data, Path(tmp) / "run", steps, compile_blocks, ac, rank, targets)
        config = load_run_config(raw=raw, prefixes=allowed_prefixes())
        env = init_distributed(config.training.distributed)
        try:
            init_weights_on(env.device)
            t0 = time.perf_counter()
            trainer = build_trainer(config, env)
            build_s = time.perf_counter() - t0
            trainable = {role: sum(p.numel() for m in model.trainable_modules().values() for p in m.parameters() if p.requires_grad)
                         for role, model in trainer.run.models.items() if model.trainable}
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            static = torch.cuda.memory_allocated() / 2**30 if cuda else None
            result = trainer.fit()
            if cuda:
                torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        finally:
            shutdown()
    times = [row["step_time_s"] for row in result.history]
    losses = {k: v for k, v in result.history[-1].items() if k.endswith("loss")}
    return {"method": method, "form": form, "size": list(size), "rank": rank if form == "lora" else None,
            "targets": targets if form == "lora" else None, "compile": compile_blocks, "activation_checkpointing": ac,
            "step_s": statistics.median(times[warmup:]), "first_step_s": times[0], "step_times": times,
            "peak_mem_gib": peak, "static_mem_gib": static, "build_s": build_s, "trainable_params": trainable,
            "final_losses": losses, "device": torch.cuda.get_device_name() if cuda else "cpu"}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "FORM"))
    parser.add_argument("--methods", default="sft,dmd2", help="comma list of sft, dmd2")
    parser.add_argument("--forms", default="full,lora", help="comma list of full (every weight trains), lora")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma list of target module names")
    parser.add_argument("--size", default="x".join(map(str, SIZE)), help="latent TxHxW")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", default="default", choices=["default", "eager", "compile"],
                        help="training.model.compile: null (compiled on CUDA), false, true")
    parser.add_argument("--no-ac", action="store_true", help="activation checkpointing off (on by default)")
    parser.add_argument("--timeout", type=float, default=540, help="seconds per configuration")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    compile_blocks = {"default": None, "eager": False, "compile": True}[args.compile]
    targets = args.targets.split(",")
    if args.one:
        method, form = args.one
        out = run_one(method, form, size, args.steps, args.warmup, compile_blocks, not args.no_ac, args.rank, targets)
        print("RESULT " + json.dumps(out), flush=True)
        return 0
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    rows = []
    for method in args.methods.split(","):
        for form in args.forms.split(","):
            cmd = [sys.executable, __file__, "--one", method, form, "--size", args.size, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--compile", args.compile, "--rank", str(args.rank), "--targets", args.targets]
            if args.no_ac:
                cmd.append("--no-ac")
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                failure = None if proc.returncode == 0 and line else (proc.stderr or proc.stdout)[-1500:]
            except subprocess.TimeoutExpired:
                line, failure = [], f"timed out after {args.timeout} s"
            if failure:
                print(f"FAILED {method} {form}:\n{failure}", flush=True)
                rows.append({"method": method, "form": form, "error": failure[-300:]})
                continue
            row = json.loads(line[0][len("RESULT "):])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "step_times"}), flush=True)
            (out_dir / f"lora_step{args.tag}.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'method':>6} {'form':>5} {'latent':>10} {'step s':>8} {'peak GiB':>9} {'static GiB':>10} {'trainable M':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:>6} {r['form']:>5}  FAILED")
            continue
        peak = "—" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        static = "—" if r["static_mem_gib"] is None else f"{r['static_mem_gib']:.1f}"
        print(f"{r['method']:>6} {r['form']:>5} {'x'.join(map(str, r['size'])):>10} {r['step_s']:8.3f} {peak:>9} {static:>10} "
              f"{sum(r['trainable_params'].values()) / 1e6:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
