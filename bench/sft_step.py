"""Benchmark: distillery's SFT training step on the Wan2.1-T2V-1.3B shape vs the plain-diffusers anchor.

Runs, in one GPU job, each configuration in its own process (so peak memory is per config):
  - our SFT step through the real Trainer (bf16 compute, fp32 master weights, fused AdamW, grad
    clipping, parquet data loading, one host sync per step) on one GPU, wrapped two ways — ``plain``
    (no FSDP: a bf16 compute copy beside the fp32 masters) and ``fsdp`` (FSDP2 on a world of one) —
    eager and with regional torch.compile, at latents 21×30×52 and 21×60×104 (random init, batch 1,
    512×4096 text);
  - reads the anchor's figures from ``$OUT/wan_step.json`` (run the anchor first in the same job).

  - ``--method dfsft``: the Diffusion-Forcing SFT step of a causal student instead (``CausalWanModel``, chunks of 3
    latent frames, per-chunk timesteps: the block-causal training attention; ``fa4`` runs it as per-chunk prefix
    calls, ``fa4_sparse`` as one block-sparse call);
  - ``--compile-mode model``: the whole transformer compiled instead of each block (``training.model.compile_mode``).

The random initial weights are drawn on the training device (as ``distill_step.py`` does), not the CPU.

Usage (device machine):  python bench/sft_step.py [--wrappers plain,fsdp] [--modes eager,compile]
Prints a table and writes ``$OUT/sft_step.json`` (after every configuration).
One configuration, profiled:  python bench/sft_step.py --one 21 30 52 0 0 native --profile $OUT/profile.txt
One configuration, FA4, DFSFT:  python bench/sft_step.py --one 21 60 104 default 0 fa4_sparse --method dfsft
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WAN_1_3B = dict(
    _class_name="WanTransformer3DModel", patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128,
    in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
SIZES = [(21, 30, 52), (21, 60, 104)]
TEXT_LEN, TEXT_DIM = 512, 4096
if os.environ.get("BENCH_SMOKE") == "1":  # a CPU check of this script itself, tiny shapes
    WAN_1_3B.update(num_attention_heads=2, attention_head_dim=16, text_dim=64, ffn_dim=64, num_layers=2)
    SIZES, TEXT_LEN, TEXT_DIM = [(3, 8, 8)], 16, 64


def causal_fraction(t: int, chunk: int) -> float:
    """Share of the query × key pairs a block-causal mask over ``chunk``-frame chunks of ``t`` frames keeps."""
    ends = [min(s + chunk, t) for s in range(0, t, chunk)]
    return sum((e - s) * e for s, e in zip(range(0, t, chunk), ends)) / (t * t)


def flops_per_sample(t: int, h: int, w: int, text: int = TEXT_LEN, attn_fraction: float = 1.0) -> tuple[float, int]:
    """Training FLOPs (3 × forward) of one sample, the anchor's formula; and the token count. ``attn_fraction``:
    the share of self-attention pairs computed (block-causal: :func:`causal_fraction`)."""
    d = WAN_1_3B["num_attention_heads"] * WAN_1_3B["attention_head_dim"]
    layers, ffn = WAN_1_3B["num_layers"], WAN_1_3B["ffn_dim"]
    n = t * (h // 2) * (w // 2)
    dense = n * layers * 2 * (4 * d * d + 2 * d * d + 2 * d * ffn) + text * layers * 2 * (2 * d * d)
    attn = layers * (4 * n * n * d * attn_fraction + 4 * n * text * d)
    return 3 * (dense + attn), n


def make_assets(root: Path, size: tuple[int, int, int]) -> tuple[Path, Path]:
    """A config-only Wan-1.3B folder (random init) and a 2-sample latent set of ``size``."""
    import torch

    from distillery.data import LatentRecord, write_latent_shards

    model = root / "wan-1.3b"
    (model / "transformer").mkdir(parents=True, exist_ok=True)
    (model / "scheduler").mkdir(parents=True, exist_ok=True)
    (model / "transformer" / "config.json").write_text(json.dumps(WAN_1_3B))
    (model / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "num_train_timesteps": 1000}))
    data = root / f"latents-{'x'.join(map(str, size))}"
    g = torch.Generator().manual_seed(0)
    records = [
        LatentRecord(id=f"s{i}", caption="bench", latent=torch.randn(16, *size, generator=g).bfloat16(),
                     text_embedding=torch.randn(TEXT_LEN, TEXT_DIM, generator=g).bfloat16(), num_frames=4 * (size[0] - 1) + 1,
                     height=size[1] * 8, width=size[2] * 8, fps=16.0, source="bench")
        for i in range(2)
    ]
    write_latent_shards(records, data, rows_per_shard=2)
    return model, data


CHUNK_SIZE = 3  # dfsft: latent frames per causal chunk


def init_weights_on(device) -> None:  # a torch.device
    """On CUDA, make ``WanTransformer3DModel.from_config`` draw its random initial weights on ``device`` (a 1.3B
    model's init on the CPU takes longer than the benchmark); elsewhere do nothing. For this benchmark process only."""
    if device.type != "cuda":
        return
    import torch
    from diffusers import WanTransformer3DModel

    on_cpu = WanTransformer3DModel.from_config

    def from_config_on_device(*args, **kwargs):
        with torch.device(device):
            return on_cpu(*args, **kwargs)

    WanTransformer3DModel.from_config = from_config_on_device


def bench_run_config(model: Path, data: Path, output_dir: Path, steps: int, compile_blocks: bool | None,
                     shard_single_rank: bool, attention: str = "auto", reshard: bool | None = None, method: str = "sft",
                     compile_mode: str = "blocks", ac: bool = False) -> dict:
    """The raw run config of one benchmark configuration (batch 1, lr 1e-5, no tracking; ``ac``: activation checkpointing)."""
    student = {"_target_": "distillery.models.wan.WanModel", "init_from": str(model), "random_init": True}
    method_cfg = {"_target_": "distillery.methods.sft.SFTMethod"}
    if method == "dfsft":
        student = {**student, "_target_": "distillery.models.wan.CausalWanModel", "chunk_size": CHUNK_SIZE}
        method_cfg = {"_target_": "distillery.methods.dfsft.DFSFTMethod", "chunk_size": CHUNK_SIZE}
    return {
        "models": {"student": student},
        "method": method_cfg,
        "training": {
            "distributed": {"shard_single_rank": shard_single_rank, "reshard_after_forward": reshard, **sp_settings()},
            "data": {"path": str(data), "batch_size": 1, "text_max_length": TEXT_LEN},
            "optimizer": {"learning_rate": 1e-5},
            "loop": {"max_train_steps": steps, "progress_bar": False},
            "checkpoint": {"output_dir": str(output_dir), "save_final": False},
            "tracker": {"backend": "none"},
            "model": {"compile": compile_blocks, "compile_mode": compile_mode, "attention_backend": attention,
                      "activation_checkpointing": ac},
        },
        "callbacks": {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}},
    }


def sp_settings() -> dict:
    """``training.distributed.sp_size`` / ``tp_size`` from ``$BENCH_SP_SIZE`` / ``$BENCH_TP_SIZE`` (a run under torchrun:
    ``bench/sp_step.py``); unset: none."""
    return {key: int(os.environ[var]) for key, var in (("sp_size", "BENCH_SP_SIZE"), ("tp_size", "BENCH_TP_SIZE"))
            if os.environ.get(var)}


def run_one(size: tuple[int, int, int], compile_blocks: bool | None, shard_single_rank: bool, attention: str, steps: int,
            warmup: int, profile_to: Path | None = None, breakdown: bool = False, reshard: bool | None = None,
            method: str = "sft", compile_mode: str = "blocks", ac: bool = False) -> dict:
    """Train ``steps`` steps with the real Trainer; report the median of the post-warm-up step times
    (host interval and GPU span, the trainer's ``step_time_s`` / ``gpu_step_time_s``).

    ``profile_to``: also write a torch.profiler table (GPU time, then host time) of the whole run there.
    ``breakdown``: profile two steady steps after the warm-up and report GPU time per kernel family
    (``bench/kernel_breakdown.py``).
    """
    import contextlib

    import torch

    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.assemble import build_trainer
    from distillery.engine.builder import resolve_compile

    with tempfile.TemporaryDirectory() as tmp:
        model, data = make_assets(Path(tmp), size)
        raw = bench_run_config(model, data, Path(tmp) / "run", steps, compile_blocks, shard_single_rank, attention, reshard,
                               method, compile_mode, ac)
        config = load_run_config(raw=raw, prefixes=allowed_prefixes())
        env = init_distributed(config.training.distributed)
        init_weights_on(env.device)
        profiler = contextlib.nullcontext()
        if breakdown:
            from torch.profiler import ProfilerActivity, profile, schedule

            profiler = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU],
                               schedule=schedule(wait=warmup, warmup=1, active=2, repeat=1))
        elif profile_to is not None:
            from torch.profiler import ProfilerActivity, profile

            profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        try:
            trainer = build_trainer(config, env)
            if breakdown:
                from kernel_breakdown import ProfilerStepper

                trainer.run.callbacks.append(ProfilerStepper(profiler))
            compiled = resolve_compile(config.training.model, env)
            resolved = getattr(trainer.run.models["student"], "attention_backend", "native")
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with profiler as prof:
                result = trainer.fit()
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        finally:
            shutdown()
    if profile_to is not None:
        table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40)
        profile_to.write_text(table + "\n\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    times = [row["step_time_s"] for row in result.history]
    gpu_times = [row["gpu_step_time_s"] for row in result.history if "gpu_step_time_s" in row]
    step_s = statistics.median(times[warmup:])
    flops, tokens = flops_per_sample(*size, attn_fraction=causal_fraction(size[0], CHUNK_SIZE) if method == "dfsft" else 1.0)
    out = {"size": list(size), "tokens": tokens, "compile": compile_blocks, "compiled": compiled, "shard_single_rank": shard_single_rank,
           "reshard_after_forward": reshard, "attention": attention, "attention_resolved": resolved, "method": method,
           "compile_mode": compile_mode, "step_s": step_s, "first_step_s": times[0],
           "tflops": flops / step_s / 1e12, "peak_mem_gib": peak, "step_times": times, "gpu_step_times": gpu_times,
           "final_loss": result.history[-1]["total_loss"]}
    if gpu_times[warmup:]:
        out["gpu_step_s"] = statistics.median(gpu_times[warmup:])
    if breakdown:
        from kernel_breakdown import kernel_families

        out["breakdown"] = kernel_families(profiler, steps=2)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", nargs=6, metavar=("T", "H", "W", "COMPILE", "SHARD_SINGLE_RANK", "ATTENTION"))
    parser.add_argument("--anchor-json", default=os.path.join(os.environ.get("OUT", "/tmp"), "wan_step.json"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--wrappers", default="plain,fsdp",
                        help="comma list: plain (one rank, no FSDP: bf16 compute copy + fp32 master), fsdp (FSDP2 on one rank)")
    parser.add_argument("--modes", default="eager,compile",
                        help="comma list of eager, compile, default (training.model.compile left null: the library decides)")
    parser.add_argument("--attention", default="auto", help="comma list of training.model.attention_backend values")
    parser.add_argument("--tag", default="", help="write $OUT/sft_step<tag>.json (several invocations in one job)")
    parser.add_argument("--profile", metavar="FILE", help="with --one: write a torch.profiler table to FILE")
    parser.add_argument("--breakdown", action="store_true", help="with --one: GPU time per kernel family of 2 steady steps")
    parser.add_argument("--reshard", choices=["0", "1"], help="with --one: training.distributed.reshard_after_forward")
    parser.add_argument("--method", default="sft", choices=["sft", "dfsft"], help="sft (WanModel) or dfsft (CausalWanModel)")
    parser.add_argument("--ac", action="store_true", help="with --one: activation checkpointing (the real-shape DFSFT pretrain needs it)")
    parser.add_argument("--compile-mode", default="blocks", choices=["blocks", "model"], help="training.model.compile_mode")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    if args.one:
        t, h, w, comp, shard, attention = args.one
        out = run_one((int(t), int(h), int(w)), {"0": False, "1": True}.get(comp), shard == "1", attention, args.steps, args.warmup,
                      Path(args.profile) if args.profile else None, args.breakdown,
                      None if args.reshard is None else args.reshard == "1", args.method, args.compile_mode, args.ac)
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun (bench/sp_step.py): rank 0's figures
            print("RESULT " + json.dumps(out), flush=True)
        return 0
    anchor = json.loads(Path(args.anchor_json).read_text()) if Path(args.anchor_json).is_file() else {}
    rows = []
    configs = [(w, size, m, a) for w in args.wrappers.split(",") for a in args.attention.split(",")
               for m in args.modes.split(",") for size in SIZES]
    for wrapper, size, mode, attention in configs:
        comp, shard = {"eager": "0", "compile": "1", "default": "default"}[mode], int(wrapper == "fsdp")
        cmd = [sys.executable, __file__, "--one", *map(str, size), comp, str(shard), attention,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--method", args.method, "--compile-mode", args.compile_mode]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            tail = (proc.stderr or proc.stdout)[-1500:]
            print(f"FAILED {wrapper} size={size} {mode}:\n{tail}", flush=True)
            rows.append({"size": list(size), "compile": mode, "wrapper": wrapper, "attention": attention,
                         "error": tail[-300:]})
            continue
        row = {"wrapper": wrapper, **json.loads(line[0][len("RESULT "):])}
        key = f"{size[0]}x{size[1]}x{size[2]}"
        ref = anchor.get(f"eager_{key}")
        if isinstance(ref, dict):
            row["anchor_eager_step_s"] = ref["step_s"]
            row["anchor_eager_peak_mem_gib"] = ref["peak_mem_gib"]
            row["ratio_to_anchor_eager"] = row["step_s"] / ref["step_s"]
        cref = anchor.get(f"compiled_{key}")
        if isinstance(cref, dict):
            row["anchor_compiled_step_s"] = cref["step_s"]
            row["ratio_to_anchor_compiled"] = row["step_s"] / cref["step_s"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "step_times"}), flush=True)
        (out_dir / f"sft_step{args.tag}.json").write_text(json.dumps({"anchor": anchor, "ours": rows}, indent=1))
    print(f"\n{'wrapper':>7} {'attention':>9} {'latent':>12} {'mode':>8} {'step s':>8} {'TFLOP/s':>8} {'mem GiB':>8} {'anchor s':>9} {'ratio':>6}")
    for r in rows:
        mode = {True: "compile", False: "eager", None: "default"}.get(r["compile"], str(r["compile"]))
        if r.get("compiled") is not None and r["compile"] is None:
            mode = "def:" + ("comp" if r["compiled"] else "eager")
        if "error" in r:
            print(f"{r['wrapper']:>7} {r['attention']:>9} {'x'.join(map(str, r['size'])):>12} {mode:>8}  FAILED")
            continue
        print(f"{r['wrapper']:>7} {r['attention']:>9} {'x'.join(map(str, r['size'])):>12} {mode:>8} {r['step_s']:8.3f} "
              f"{r['tflops']:8.1f} {r['peak_mem_gib']:8.1f} {r.get('anchor_eager_step_s', float('nan')):9.3f} "
              f"{r.get('ratio_to_anchor_eager', float('nan')):6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
