"""Benchmark: our SFT step and DMD2 iteration against FastVideo 0.2.1's own trainer, in one GPU job.

FastVideo (``fastvideo.train``, its YAML trainer: ``Trainer.run`` → ``FineTuneMethod`` / ``DMD2Method`` → its
``WanModel`` under its FSDP2 loader, its parquet dataloader) is what a user would pick instead of this project. This
script runs both on the same machine, one configuration per process, at the same shape: Wan2.1-T2V-1.3B layout with
random weights, latents 16×21×60×104 (an 81×480×832 video, 32,760 tokens), batch 1, text 512×4096.

FastVideo's side is the prepared job of ``../shared/anchors/fastvideo_peer/`` (its ``HOWTO.md`` says what each piece
does): ``make_inputs.py`` writes the random-weight model folder and parquet rows in FastVideo's
``pyarrow_schema_t2v`` at the shape, ``config_sft.yaml`` / ``config_dmd2.yaml`` are FastVideo's example configs
(``fine_tuning/wan/t2v.yaml``, ``distribution_matching/wan/dmd2_t2v.yaml``) at this shape on one GPU, and
``fv_timed_train.py`` runs FastVideo's entrypoint while recording FastVideo's own per-step ``step_time_sec`` (from
before the batch is fetched to after the optimizer step and a host sync) and the CUDA peak per step. Copy that folder
into a git-ignored place (e.g. ``.peer/fv``) with its wheels (``fetch-wheels.sh``); none of it enters this repository.

Our side is ``bench/sft_step.py --one`` and ``bench/distill_step.py --one`` (the real Trainer, each run's default
settings on a GPU: FlashAttention-4 when installed, each block compiled, fused AdamW, fp32 masters).

Runs (``--runs``, comma list, in order; each is skipped when fewer than its ``need`` seconds are left of ``--deadline``):

  ours_sft            our SFT step as shipped (no activation checkpointing at this shape)
  ours_sft_ac         the same with every block checkpointed (FastVideo's example setting)
  ours_dmd2_sim       our DMD2 iteration, 4-step simulate rollout (FastVideo's example mode), 6 of 30 blocks
                      checkpointed (the one-GPU profile's DMD2 setting)
  ours_dmd2_data      the same with the data-latent rollout
  ours_dmd2_sim_ac1   simulate, every block checkpointed (FastVideo's example setting)
  ours_sft_ac_fsdp, ours_dmd2_sim_ac1_fsdp
                      the same with FSDP2 on the one rank, resharding after forward
                      (``training.distributed.shard_single_rank`` + ``reshard_after_forward``): no resident bf16
                      compute copy — FastVideo's loader's memory layout
  fv_sft_sdpa_ac      FastVideo's finetune as its example ships (AC full) with the attention it selects on this
                      image: torch SDPA (its FLASH_ATTN backend needs flash-attn 2/3, which has no wheel for this torch)
  fv_sft_sdpa         the same, AC off
  fv_sft_fa4          FastVideo with FlashAttention-4 (its opt-in ``FASTVIDEO_FA4=1``), AC off: our settings but
                      torch.compile, which FastVideo 0.2.1's trainer hard-codes off
  fv_sft_fa4_ac       FA4, AC full
  fv_dmd2_sdpa_ac     FastVideo's DMD2 as its example ships (simulate, AC full), SDPA, generator every iteration
  fv_dmd2_fa4_ac      the same with FA4
  fv_dmd2_fa4         FA4, AC off (our attention and no recompute; expected not to fit)
  fv_dmd2_data_fa4_ac data-latent rollout, FA4, AC full

Usage (device machine, repo root; FA4 + diffusers wheels installed as ``../shared/tools/device-env.sh`` does):
  python3 bench/fastvideo_peer.py --peer .peer/fv --runs ours_sft,fv_sft_fa4,fv_sft_sdpa_ac --deadline 560 --tag _a

How the 2026-12-03 figures were taken (BENCHMARKS.md, "Our training steps against FastVideo 0.2.1"), here:
``cp -r ../shared/anchors/fastvideo_peer .peer/fv && .peer/fv/fetch-wheels.sh`` (``/.peer/`` in ``.git/info/exclude``),
``../shared/tools/device-wheels.sh``, ``cp ../shared/tools/device-env.sh .peer/``; then on one warm H200, back to back:
two calls that copy ``.whl-parts/01`` and ``02`` into ``/tmp/parts``, and calls carrying ``.whl-parts/03``, ``.whl`` and
``.peer`` that copy part 03 there, ``source .peer/device-env.sh`` and run this script with ``--runs`` split over calls of
at most ~8 minutes (``--deadline``): FastVideo's wheels and inputs are built on the first call and kept in /tmp.
CPU check of our side of this script: ``BENCH_SMOKE=1 python bench/fastvideo_peer.py --runs ours_sft,ours_dmd2_sim
--ours-latent 3x8x8 --sft-steps 3 --sft-warmup 1 --dmd2-steps 3 --dmd2-warmup 1`` (FastVideo 0.2.1 has no CPU
training path; the anchors' HOWTO describes its CPU shim).
Writes ``$OUT/fastvideo_peer<tag>.json`` (every row, after each run), ``$OUT/fastvideo_peer<tag>.txt`` (the table)
and ``$OUT/fastvideo_peer<tag>_logs.tgz`` (each run's log, FastVideo's per-step JSONL and setup description).
FastVideo's wheels are installed into ``--fv-site`` from ``<peer>/wheels`` when not already there; its inputs are
built once in ``--fv-root`` (kept across calls on a warm machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LATENT = (21, 60, 104)

# name: (side, kind, settings, need_s, cap_s)
RUNS: dict[str, dict] = {
    "ours_sft": {"side": "ours", "kind": "sft", "ac": False, "need": 90, "cap": 240},
    "ours_sft_ac": {"side": "ours", "kind": "sft", "ac": True, "need": 90, "cap": 240},
    "ours_sft_ac_fsdp": {"side": "ours", "kind": "sft", "ac": True, "fsdp": True, "need": 90, "cap": 240},
    "ours_dmd2_sim": {"side": "ours", "kind": "dmd2_sim", "ac_fraction": 0.2, "need": 150, "cap": 330},
    "ours_dmd2_data": {"side": "ours", "kind": "dmd2_data", "ac_fraction": 0.2, "need": 150, "cap": 330},
    "ours_dmd2_sim_ac1": {"side": "ours", "kind": "dmd2_sim", "ac_fraction": 1.0, "need": 150, "cap": 330},
    "ours_dmd2_sim_ac1_fsdp": {"side": "ours", "kind": "dmd2_sim", "ac_fraction": 1.0, "fsdp": True, "need": 120,
                               "cap": 330},
    "fv_sft_sdpa_ac": {"side": "fv", "kind": "sft", "attn": "sdpa", "ac": True, "need": 120, "cap": 300},
    "fv_sft_sdpa": {"side": "fv", "kind": "sft", "attn": "sdpa", "ac": False, "need": 120, "cap": 300},
    "fv_sft_fa4": {"side": "fv", "kind": "sft", "attn": "fa4", "ac": False, "need": 120, "cap": 300},
    "fv_sft_fa4_ac": {"side": "fv", "kind": "sft", "attn": "fa4", "ac": True, "need": 120, "cap": 300},
    "fv_dmd2_sdpa_ac": {"side": "fv", "kind": "dmd2", "attn": "sdpa", "ac": True, "need": 200, "cap": 420},
    "fv_dmd2_fa4_ac": {"side": "fv", "kind": "dmd2", "attn": "fa4", "ac": True, "need": 200, "cap": 420},
    "fv_dmd2_fa4": {"side": "fv", "kind": "dmd2", "attn": "fa4", "ac": False, "need": 120, "cap": 300},
    "fv_dmd2_data_fa4_ac": {"side": "fv", "kind": "dmd2", "attn": "fa4", "ac": True, "rollout": "data_latent",
                            "need": 180, "cap": 420},
}


def _tail(path: Path, n: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _run(cmd: list[str], log: Path, timeout: float, env: dict) -> tuple[int, float]:
    """Run ``cmd`` with stdout+stderr into ``log``; (return code, wall seconds); 124 when it ran past ``timeout``."""
    t0 = time.time()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the whole group: torchrun's workers too
            proc.wait()
            rc = 124
    return rc, time.time() - t0


def _oom(text: str) -> bool:
    return "OutOfMemoryError" in text or "CUDA out of memory" in text


# -- our side --------------------------------------------------------------------------------------------------
def run_ours(name: str, spec: dict, work: Path, steps: int, warmup: int, timeout: float,
             latent: tuple[int, int, int] = LATENT) -> dict:
    t, h, w = latent
    env = dict(os.environ)
    if spec["kind"] == "sft":
        shard = "1" if spec.get("fsdp") else "0"
        cmd = [sys.executable, str(HERE / "sft_step.py"), "--one", str(t), str(h), str(w), "default", shard, "auto",
               "--steps", str(steps), "--warmup", str(warmup), *(["--ac"] if spec["ac"] else []),
               *(["--reshard", "1"] if spec.get("fsdp") else [])]
    else:
        env["BENCH_AC_FRACTION"] = str(spec["ac_fraction"])
        if spec.get("fsdp"):
            env["BENCH_SHARD_SINGLE_RANK"] = "1"
        cmd = [sys.executable, str(HERE / "distill_step.py"), "--one", spec["kind"], str(t), str(h), str(w), "default",
               "on", "--steps", str(steps), "--warmup", str(warmup), "--attention", "auto"]
    log = work / f"{name}.log"
    rc, wall = _run(cmd, log, timeout, env)
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    row: dict = {"run": name, "side": "ours", "kind": spec["kind"], "fsdp_one_rank": bool(spec.get("fsdp")), "rc": rc,
                 "wall_s": round(wall, 1), "command": cmd[1:]}
    if rc != 0 or not lines:
        row["error"] = ("CUDA out of memory: " if _oom(text) else "") + text[-800:]
        return row
    res = json.loads(lines[-1][len("RESULT "):])
    if spec["kind"] == "sft":
        times = res["step_times"]
        row.update(step_s=res["step_s"], gpu_step_s=res.get("gpu_step_s"), first_step_s=res["first_step_s"],
                   peak_alloc_gib=res["peak_mem_gib"], attention=res.get("attention_resolved"),
                   compiled=res.get("compiled"), ac=spec["ac"])
    else:
        times = res["iteration_times"]
        row.update(step_s=res["iteration_s"], gpu_step_s=res.get("gpu_iteration_s"),
                   first_step_s=res["first_iteration_s"], peak_alloc_gib=res["peak_mem_gib"],
                   peak_reserved_gib=res.get("peak_reserved_gib"), attention=res.get("attention_resolved"),
                   compiled=res.get("compiled"), ac_fraction=res.get("ac_fraction"), exits=res.get("exits"),
                   model_tflop_per_iteration=res.get("model_tflop_per_iteration"))
    timed = times[warmup:]
    row.update(step_times=times, timed_n=len(timed), min_step_s=min(timed), max_step_s=max(timed),
               mean_step_s=statistics.fmean(timed))
    return row


# -- FastVideo's side ------------------------------------------------------------------------------------------
def fv_environment(peer: Path, site: Path, work: Path) -> dict:
    """Install FastVideo's carried wheels into ``site`` once; the environment its processes run with."""
    wheels = sorted(str(p) for p in (peer / "wheels").glob("*.whl"))
    stamp = site / ".stamp"
    want = "\n".join(Path(w).name for w in wheels)
    if not stamp.is_file() or stamp.read_text() != want:
        subprocess.run(["rm", "-rf", str(site)], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--disable-pip-version-check", "--target", str(site), *wheels], check=True)
        stamp.write_text(want)
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}".rstrip(":")
    probe = [sys.executable, "-c", "import av"]
    if subprocess.run(probe, env=env, capture_output=True).returncode != 0:  # PyAV: validation video only (off)
        env["PYTHONPATH"] += f":{peer / 'stubs'}"
    ds = subprocess.run([sys.executable, "-c", "import datasets"], env=env, capture_output=True, text=True)
    if ds.returncode != 0:  # only FastVideo's validation uses it
        (work / "fv_datasets_import.txt").write_text(ds.stderr)
        env["PYTHONPATH"] = f"{peer / 'stubs_fallback'}:{env['PYTHONPATH']}"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    versions = subprocess.run([sys.executable, "-c", (
        "import importlib.metadata as m\n"
        "for p in ('torch','fastvideo','diffusers','transformers','flash-attn-4','pyarrow','datasets'):\n"
        "    try: print(p, m.version(p))\n"
        "    except Exception as e: print(p, 'missing')")], env=env, capture_output=True, text=True)
    (work / "fv_env.txt").write_text(versions.stdout + versions.stderr)
    return env


def fv_inputs(peer: Path, root: Path, env: dict, work: Path) -> None:
    rc, wall = _run([sys.executable, str(peer / "make_inputs.py"), "--root", str(root)], work / "fv_make_inputs.log",
                    900, env)
    if rc != 0 or not (root / "inputs.json").is_file():
        raise RuntimeError(f"make_inputs.py failed (rc {rc}):\n{_tail(work / 'fv_make_inputs.log')}")
    print(f"[fastvideo_peer] FastVideo inputs ready in {root} ({wall:.0f} s)", flush=True)


def run_fv(name: str, spec: dict, peer: Path, root: Path, env: dict, work: Path, steps: int, warmup: int,
           timeout: float) -> dict:
    config = (peer / f"config_{spec['kind']}.yaml").read_text().replace("__ROOT__", str(root))
    cfg_path = work / f"fv_{name}.yaml"
    cfg_path.write_text(config)
    args = ["--config", str(cfg_path), "--training.loop.max_train_steps", str(steps),
            "--training.checkpoint.output_dir", str(root / f"out_{name}"),
            "--training.model.enable_gradient_checkpointing_type", "full" if spec["ac"] else "null"]
    if spec.get("rollout"):
        args += ["--method.rollout_mode", spec["rollout"]]
    run_env = dict(env, FV_METRICS=str(work / f"fv_{name}.jsonl"), FV_WARMUP=str(warmup))
    if spec["attn"] == "fa4":  # FastVideo's FLASH_ATTN backend on flash_attn.cute (its opt-in switch)
        run_env.update(FASTVIDEO_ATTENTION_BACKEND="FLASH_ATTN", FASTVIDEO_FA4="1")
    else:
        run_env.update(FASTVIDEO_ATTENTION_BACKEND="TORCH_SDPA")
        run_env.pop("FASTVIDEO_FA4", None)
    (root / "data" / "train" / "map_style_cache" / "file_info.pkl").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(peer / "fv_timed_train.py"), *args]
    log = work / f"fv_{name}.log"
    rc, wall = _run(cmd, log, timeout, run_env)
    text = log.read_text(errors="replace")
    row: dict = {"run": name, "side": "fastvideo", "kind": spec["kind"], "rc": rc, "wall_s": round(wall, 1),
                 "attention_requested": spec["attn"], "ac": spec["ac"], "rollout": spec.get("rollout"),
                 "fastvideo_args": args[2:]}
    jsonl = work / f"fv_{name}.jsonl"
    rows = [json.loads(ln) for ln in jsonl.read_text().splitlines() if ln.strip()] if jsonl.is_file() else []
    setup = work / f"fv_{name}_setup.json"
    if setup.is_file():
        desc = json.loads(setup.read_text())
        row["setup"] = {role: {k: d.get(k) for k in ("fsdp2", "param_dtypes", "trainable_b", "attention_impls",
                                                      "activation_checkpoint_wrappers")}
                        for role, d in desc.get("roles", {}).items()}
        row["sdpa_kernels"] = desc.get("sdpa_kernels_fwd_bwd")
        row["allocated_gib_before_loop"] = desc.get("allocated_gib_before_loop")
    row["fa_log"] = sorted({ln.split("]")[-1].strip()[:120] for ln in text.splitlines()
                            if "FlashAttention-" in ln or "Using Torch SDPA" in ln or "Using Flash Attention" in ln})[:4]
    if _oom(text):
        row["error"] = "CUDA out of memory"
    elif rc != 0 and not rows:
        row["error"] = text[-1200:]
    if rows:
        times = [r["step_time_sec"] for r in rows]
        timed = times[warmup:] if len(times) > warmup else times[-1:]
        row.update(step_s=statistics.median(timed), min_step_s=min(timed), max_step_s=max(timed),
                   mean_step_s=statistics.fmean(timed), timed_n=len(timed), first_step_s=times[0], step_times=times,
                   peak_alloc_gib=max(r.get("peak_alloc_gib", 0.0) for r in rows),
                   peak_reserved_gib=max(r.get("peak_reserved_gib", 0.0) for r in rows),
                   wall_between_steps_s=statistics.median(
                       [r["wall_since_prev_log_sec"] for r in rows[warmup:] if r.get("wall_since_prev_log_sec")] or [0]))
        if "update_student" in rows[0]:
            row["update_student"] = [r.get("update_student") for r in rows]
    return row


# -- the table --------------------------------------------------------------------------------------------------
def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict]) -> str:
    out = [f"{'run':20} {'rc':>4} {'median s':>9} {'min':>7} {'max':>7} {'n':>2} {'first s':>8} {'peak GiB':>9}  note"]
    for r in rows:
        if "step_s" not in r:
            out.append(f"{r['run']:20} {r.get('rc', ''):>4} {'-':>9} {'':>7} {'':>7} {'':>2} {'':>8} {'':>9}  "
                       f"{(r.get('error') or r.get('skipped') or '')[:70]!r}")
            continue
        note = str(r.get("attention") or ",".join(r.get("fa_log", [])))[:60]
        out.append(f"{r['run']:20} {r['rc']:>4} {_f(r['step_s'], '9.3f')} {_f(r['min_step_s'], '7.3f')} "
                   f"{_f(r['max_step_s'], '7.3f')} {r['timed_n']:>2} {_f(r['first_step_s'], '8.2f')} "
                   f"{_f(r.get('peak_alloc_gib'), '9.1f')}  {note}"
                   + ("  [OOM later]" if r.get("error") else ""))
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", default=".peer/fv", help="the FastVideo job folder (a copy of shared/anchors/fastvideo_peer + wheels/)")
    parser.add_argument("--runs", default="ours_sft,fv_sft_fa4,fv_sft_sdpa_ac")
    parser.add_argument("--deadline", type=float, default=560, help="seconds: no run starts later, none outlives it")
    parser.add_argument("--sft-steps", type=int, default=8)
    parser.add_argument("--sft-warmup", type=int, default=3)
    parser.add_argument("--dmd2-steps", type=int, default=6)
    parser.add_argument("--dmd2-warmup", type=int, default=2)
    parser.add_argument("--fv-site", default="/tmp/fvsite")
    parser.add_argument("--fv-root", default="/tmp/fvjob_inputs")
    parser.add_argument("--tag", default="")
    parser.add_argument("--ours-latent", default="x".join(map(str, LATENT)),
                        help="our runs' latent T x H x W (a CPU check of this script: BENCH_SMOKE=1 --ours-latent 3x8x8)")
    args = parser.parse_args()
    started = time.time()
    out = Path(os.environ.get("OUT", "/tmp"))
    work = Path(os.environ.get("FV_WORK", "/tmp/fastvideo_peer_work")) / (args.tag or "run")
    work.mkdir(parents=True, exist_ok=True)
    peer, root = Path(args.peer).resolve(), Path(args.fv_root)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"unknown runs: {unknown}; known: {sorted(RUNS)}", file=sys.stderr)
        return 2
    rows: list[dict] = []
    fv_env: dict | None = None
    meta = {"latent": list(LATENT), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": sys.argv[1:]}
    for name in names:
        spec = RUNS[name]
        left = args.deadline - (time.time() - started)
        if left < spec["need"]:
            rows.append({"run": name, "skipped": f"deadline: {left:.0f} s left, needs {spec['need']}"})
            print(f"[fastvideo_peer] SKIP {name}: {left:.0f} s left", flush=True)
            continue
        timeout = min(spec["cap"], left)
        sft = spec["kind"] == "sft"
        steps, warmup = (args.sft_steps, args.sft_warmup) if sft else (args.dmd2_steps, args.dmd2_warmup)
        print(f"[fastvideo_peer] {name} (limit {timeout:.0f} s)", flush=True)
        try:
            if spec["side"] == "ours":
                row = run_ours(name, spec, work, steps, warmup, timeout,
                               tuple(int(v) for v in args.ours_latent.split("x")))
            else:
                if fv_env is None:
                    fv_env = fv_environment(peer, Path(args.fv_site), work)
                    fv_inputs(peer, root, fv_env, work)
                    meta["fv_env"] = (work / "fv_env.txt").read_text()
                row = run_fv(name, spec, peer, root, fv_env, work, steps, warmup, timeout)
        except Exception as exc:  # a broken run must not lose the others' rows
            row = {"run": name, "error": f"{type(exc).__name__}: {exc}"[-1500:]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("step_times", "command", "fastvideo_args")})[:1500],
              flush=True)
        (out / f"fastvideo_peer{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = table(rows)
    (out / f"fastvideo_peer{args.tag}.txt").write_text(text + "\n")
    with tarfile.open(out / f"fastvideo_peer{args.tag}_logs.tgz", "w:gz") as tar:
        for p in sorted(work.iterdir()):
            if p.is_file() and p.suffix in (".log", ".jsonl", ".json", ".txt", ".yaml"):
                tar.add(p, arcname=p.name)
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
