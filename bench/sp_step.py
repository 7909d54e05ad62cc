"""Benchmark: sequence parallelism (``training.distributed.sp_size``) on GPUs, and the one-GPU step beside the code
it replaced.

Every configuration runs in its own process (peak memory per configuration) through ``bench/sft_step.py --one`` (SFT,
``WanModel``) or ``bench/distill_step.py --one`` (``dmd2_data`` DMD2, ``sf`` Self-Forcing: three Wan-1.3B-shaped
roles), the real ``Trainer`` at batch 1, 512×4096 text, random init. Three parts:

- ``regression --base DIR`` (one GPU, sp 1): each of ``--runs`` from DIR — a copy of the base commit's ``src/`` and
  ``bench/`` (``git archive <commit> src bench | tar -x -C DIR``) — and from this tree, alternating base, ours, base,
  ours … (``--rounds``), so drift of the machine falls on both; the ratio ours / base of each round's medians.
- ``sp --nproc N`` (N GPUs of one host): each of ``--runs`` at sp 1 (N data ranks, one sample each: the step trains N
  samples), at sp N (one data rank: the N GPUs on one sample) and with ``--tp`` at tp N, under ``torchrun``; per-sample
  time (step time / data ranks) and peak memory of rank 0's GPU.
- ``activations`` (one GPU): SFT at two latent sizes, activation checkpointing off and on; peak memory against the
  token count, fitted as ``states + per_token · tokens`` (what docs/gpus.md scales to other models and SP sizes).

Run spec (``--runs``, comma list): ``METHOD:TxHxW:AC`` — METHOD ``sft`` | ``dmd2_data`` | ``sf``, AC ``on``/``off``;
compile is the library's default (regional compile on CUDA), attention ``--attention`` (default ``auto``: FA4's
block-sparse kernels where they run).

Memory: SFT at 21×60×104 without activation checkpointing peaks at 105.8 GiB and DMD2 without it at 134.9 GiB on one
GPU (BENCHMARKS.md): ``sft:21x60x104:off`` needs an H200; with activation checkpointing on (DMD2: 58.6 GiB) both fit an
H100. At sp 2 the activations of a sample split over two GPUs (whether DMD2 at 21×60×104 then fits two H100s without
activation checkpointing is what the ``sp`` part measures).

The one-GPU regression (issue 62: no step slower than the code before sequence parallelism, b3d4e5b), one device call
of ~6–7 min on an H100 (~5 on an H200), one attention kernel on both sides whatever wheels the machine has (``native``: PyTorch
SDPA; ``auto`` runs FA4 where its wheels are carried, adding its kernels' first compile to every process)::

  rm -rf .bench_base && mkdir .bench_base && git archive b3d4e5b src bench | tar -x -C .bench_base   # here, then carry it
  bash bench/gpu_job.sh sp regression --base .bench_base --runs sft:21x60x104:on,dmd2_data:21x60x104:on \
      --rounds 1 --steps 5 --warmup 2 --attention native --timeout 240

Several GPUs of one host: ``bash bench/gpu_job.sh sp sp --nproc 2 --tp``; one GPU: ``bash bench/gpu_job.sh sp
activations``. Results in ``$OUT/sp_step_<part>.json``, the table at the end of ``$OUT/sp_step.log``.
CPU check of this script (tiny shapes, gloo): ``BENCH_SMOKE=1 python bench/sp_step.py sp --nproc 2``, and the
regression against a base copy with ``--runs sft:3x8x8:on,dmd2_data:9x8x8:on``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
REGRESSION_RUNS = "sft:21x60x104:off,dmd2_data:21x60x104:on"
SP_RUNS = "sft:21x60x104:off,dmd2_data:21x60x104:on,sf:21x60x104:on"
if SMOKE:
    REGRESSION_RUNS = SP_RUNS = "sft:3x8x8:off,dmd2_data:9x8x8:on,sf:9x8x8:off"


def one_command(bench: Path, method: str, size: tuple[int, ...], ac: bool, steps: int, warmup: int, attention: str) -> list[str]:
    """The ``--one`` command of a configuration, for the benchmark scripts in ``bench`` (this tree's or the base's)."""
    if method == "sft":
        return [str(bench / "sft_step.py"), "--one", *map(str, size), "default", "0", attention, "--steps", str(steps),
                "--warmup", str(warmup), *(["--ac"] if ac else [])]
    return [str(bench / "distill_step.py"), "--one", method, *map(str, size), "default", "on" if ac else "off",
            "--steps", str(steps), "--warmup", str(warmup), "--attention", attention]


def run(cmd: list[str], env: dict[str, str], timeout: float, nproc: int = 1) -> tuple[dict | None, str]:
    """One configuration (under ``torchrun`` when ``nproc`` > 1): its RESULT line (rank 0's), or None and the end of its
    output."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(nproc)]
    try:
        proc = subprocess.run([*launcher, *cmd], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return None, (proc.stderr or proc.stdout)[-2500:]
    return json.loads(lines[-1][len("RESULT "):]), ""


def figures(res: dict) -> dict:
    """Step time (host, GPU span) and peak memory of either script's result."""
    step = res.get("step_s", res.get("iteration_s"))
    gpu = res.get("gpu_step_s", res.get("gpu_iteration_s"))
    return {"step_s": step, "gpu_step_s": gpu, "peak_mem_gib": res.get("peak_mem_gib"), "tokens": res.get("tokens")}


def parse_runs(spec: str) -> list[tuple[str, tuple[int, ...], bool]]:
    out = []
    for item in spec.split(","):
        method, latent, ac = item.split(":")
        out.append((method, tuple(int(v) for v in latent.split("x")), ac == "on"))
    return out


def env_with(src: Path, **extra: str) -> dict[str, str]:
    """This process's environment with ``src`` (a tree's ``src/``) on PYTHONPATH in place of this tree's (the wheels
    bench/gpu_job.sh put there kept)."""
    ours = str(HERE.parent / "src")
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p.rstrip("/") != ours]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), *rest]), **extra}


def regression(args: argparse.Namespace) -> dict:
    base = Path(args.base).resolve()
    if not (base / "src" / "distillery").is_dir() or not (base / "bench" / "sft_step.py").is_file():
        raise SystemExit(f"--base {base}: not a copy of a commit's src/ and bench/ (git archive <commit> src bench | tar -x -C DIR)")
    trees = {"base": (base / "src", base / "bench"), "ours": (HERE.parent / "src", HERE)}
    rows = []
    for method, size, ac in parse_runs(args.runs):
        for r in range(args.rounds):
            for tree, (src, bench) in trees.items():
                t0 = time.time()
                res, err = run(one_command(bench, method, size, ac, args.steps, args.warmup, args.attention), env_with(src),
                               args.timeout)
                row = {"method": method, "size": list(size), "ac": ac, "round": r, "tree": tree, "wall_s": time.time() - t0}
                row.update(figures(res) if res else {"error": err[-600:]})
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'method':>10} {'latent':>10} {'AC':>3} {'round':>5} {'base s':>8} {'ours s':>8} {'ours/base':>9} "
          f"{'base GPU s':>10} {'ours GPU s':>10} {'base GiB':>8} {'ours GiB':>8}")
    for method, size, ac in parse_runs(args.runs):
        for r in range(args.rounds):
            pair = {row["tree"]: row for row in rows if row["method"] == method and tuple(row["size"]) == size
                    and row["ac"] == ac and row["round"] == r}
            b, o = pair.get("base", {}), pair.get("ours", {})
            if "step_s" not in b or "step_s" not in o:
                print(f"{method:>10} {'x'.join(map(str, size)):>10} {'on' if ac else 'off':>3} {r:>5}  FAILED "
                      f"{(b.get('error') or o.get('error') or '')[-120:]!r}")
                continue
            nan = float("nan")
            print(f"{method:>10} {'x'.join(map(str, size)):>10} {'on' if ac else 'off':>3} {r:>5} {b['step_s']:8.3f} "
                  f"{o['step_s']:8.3f} {o['step_s'] / b['step_s']:9.3f} {b['gpu_step_s'] or nan:10.3f} "
                  f"{o['gpu_step_s'] or nan:10.3f} {b['peak_mem_gib'] or nan:8.1f} {o['peak_mem_gib'] or nan:8.1f}")
    return {"rows": rows}


def sequence_parallel(args: argparse.Namespace) -> dict:
    rows = []
    layouts = [(1, 1), (args.nproc, 1)] + ([(1, args.nproc)] if args.tp else [])  # (sp, tp)
    for method, size, ac in parse_runs(args.runs):
        for sp, tp in layouts:
            t0 = time.time()
            cmd = one_command(HERE, method, size, ac, args.steps, args.warmup, args.attention)
            res, err = run(cmd, env_with(HERE.parent / "src", BENCH_SP_SIZE=str(sp), BENCH_TP_SIZE=str(tp)), args.timeout,
                           args.nproc)
            row = {"method": method, "size": list(size), "ac": ac, "gpus": args.nproc, "sp_size": sp, "tp_size": tp,
                   "data_ranks": args.nproc // (sp * tp), "wall_s": time.time() - t0}
            if res:
                row.update(figures(res))
                row["per_sample_s"] = row["step_s"] / row["data_ranks"]
            else:
                row["error"] = err[-600:]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'method':>10} {'latent':>10} {'AC':>3} {'sp':>3} {'tp':>3} {'step s':>8} {'s/sample':>8} {'GPU s':>8} "
          f"{'GiB/GPU':>8}")
    for row in rows:
        head = (f"{row['method']:>10} {'x'.join(map(str, row['size'])):>10} {'on' if row['ac'] else 'off':>3} "
                f"{row['sp_size']:>3} {row['tp_size']:>3}")
        if "error" in row:
            print(f"{head}  FAILED {row['error'][-120:]!r}")
            continue
        nan = float("nan")
        print(f"{head} {row['step_s']:8.3f} {row['per_sample_s']:8.3f} {row['gpu_step_s'] or nan:8.3f} "
              f"{row['peak_mem_gib'] or nan:8.1f}")
    return {"rows": rows}


def activations(args: argparse.Namespace) -> dict:
    sizes = [(3, 8, 8), (5, 8, 8)] if SMOKE else [(21, 30, 52), (21, 60, 104)]
    rows, fits = [], {}
    for ac in (False, True):
        points = []
        for size in sizes:
            res, err = run(one_command(HERE, "sft", size, ac, args.steps, args.warmup, args.attention),
                           env_with(HERE.parent / "src"), args.timeout)
            row = {"size": list(size), "ac": ac, **(figures(res) if res else {"error": err[-600:]})}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if res and row["peak_mem_gib"] == row["peak_mem_gib"]:  # not NaN (CPU)
                points.append((row["tokens"], row["peak_mem_gib"]))
        if len(points) == 2:
            (n1, m1), (n2, m2) = points
            per_token = (m2 - m1) / (n2 - n1)
            fits["on" if ac else "off"] = {"states_gib": m1 - per_token * n1, "gib_per_1k_tokens": 1000 * per_token}
    print(json.dumps({"fits": fits}), flush=True)
    return {"rows": rows, "fits": fits}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=["regression", "sp", "activations"])
    parser.add_argument("--base", help="regression: a copy of the base commit's src/ and bench/")
    parser.add_argument("--runs", help="comma list of METHOD:TxHxW:AC")
    parser.add_argument("--rounds", type=int, default=2, help="regression: base/ours pairs per configuration")
    parser.add_argument("--nproc", type=int, default=2, help="sp: GPUs (and the SP size compared with 1)")
    parser.add_argument("--tp", action="store_true", help="sp: also tp_size = --nproc (tensor parallelism)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--timeout", type=float, default=420, help="seconds per configuration")
    args = parser.parse_args()
    if args.runs is None:
        args.runs = REGRESSION_RUNS if args.part == "regression" else SP_RUNS
    if args.part == "regression" and not args.base:
        parser.error("regression needs --base")
    result = {"regression": regression, "sp": sequence_parallel, "activations": activations}[args.part](args)
    out = Path(os.environ.get("OUT", "/tmp")) / f"sp_step_{args.part}.json"
    out.write_text(json.dumps({"args": vars(args), **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
