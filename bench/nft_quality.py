"""Quality benchmark of DiffusionNFT: does post-training the distilled student on the adherence reward raise it?

1. **Training** (``bench/quality.py``'s stages, its ``--scale``): clips → base → latents → teacher → pretrain in
   ``<work>/base``, then the DMD2 student ``--student`` (default ``dmd2_2``: DMD2 on a 2-step ladder) in its own
   workspace — what ``python bench/quality.py --students dmd2_2`` trains.
2. **Post-training**: that student's artifact (its weights, scheduler and ``sampling.json``) post-trained by
   ``distillery.methods.rl.nft.DiffusionNFTMethod`` through ``distillery.cli.train`` (torchrun, one process), once per
   ``--train-seeds`` seed (``training.loop.seed``: prompt order, rollout noise, minibatch order), on the latents
   stage's prompts, with the analyzer's adherence reward (``distillery.rewards.adherence.AdherenceReward`` over the base's
   ``analyzer.json``: a third per attribute read back). Each result is exported as an artifact that samples as the
   student did (``nft_s<seed>``).
3. **Evaluation** (``bench/quality.py``'s, validate's sampling): ``teacher_40`` (the reference), the student before
   (``dmd2_2``) and after (``nft_s<seed>``), each on ``bench/quality_prompts.txt`` × the scale's seeds (the same noise
   for every candidate): adherence (the analyzer's ``all``, as validate reports it) with its 95% bootstrap interval,
   and beside it the distances to the teacher that show reward hacking — Fréchet distance, KID, paired distance —
   and sharpness.

Usage::

    python bench/nft_quality.py --device cpu --scale small          # CPU: tens of minutes (through /work/bin/heavy)
    python bench/nft_quality.py --reuse --nft-steps 80              # retrain only the post-training, evaluate again

Writes ``--out`` (default ``bench/results/nft_quality.json``: settings, the candidates' rows as quality.py writes
them, the post-training logs' reward per rollout group) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import SCALES, STUDENTS, CandidateSpec, Scale, _env, evaluate, summary_table, train, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def nft_run_config(work: Path, student: Path, run_dir: Path, seed: int, args: argparse.Namespace, text_max_length: int) -> dict:
    base = work / "base" / "artifacts" / "base" / "model"
    return {
        "models": {"student": {"_target_": "distillery.models.wan.WanModel", "init_from": str(student)}},
        "method": {"_target_": "distillery.methods.rl.nft.DiffusionNFTMethod", "samples_per_prompt": args.k,
                   "minibatch_size": args.minibatch, "inner_epochs": args.inner_epochs,
                   "sampling": json.loads((student / "sampling.json").read_text()), "timestep_fraction": args.timestep_fraction,
                   "beta": args.beta, "kl_beta": args.kl_beta, "vae_from": str(base),
                   "rewards": {"adherence": {"_target_": "distillery.rewards.adherence.AdherenceReward", "folder": str(base)}}},
        "training": {
            "data": {"path": str(work / "base" / "artifacts" / "latents" / "data"), "batch_size": args.prompts_per_group,
                     "text_max_length": text_max_length},
            "optimizer": {"learning_rate": args.lr, "weight_decay": 0.0},
            "loop": {"max_train_steps": args.nft_steps, "seed": seed, "progress_bar": False},
            "checkpoint": {"output_dir": str(run_dir), "save_every": 0, "keep_last": 1},
            "tracker": {"backend": "none"},
        },
        "callbacks": {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}},
    }


def post_train(work: Path, student: Path, seed: int, args: argparse.Namespace) -> tuple[Path, list[dict[str, float]]]:
    """DiffusionNFT on ``student`` with ``seed``; returns the exported artifact's model folder and the rollout steps'
    logged rows."""
    from distillery.export.weights import export_weights
    from distillery.models.registry import locate_transformer
    from distillery.pipeline.publish.run_summary import read_run_summary

    folder = work / f"nft_s{seed}"
    shutil.rmtree(folder, ignore_errors=True)
    run_dir = folder / "run"
    run_dir.mkdir(parents=True)
    distill_run = yaml.safe_load((work / args.student / "runs" / "distill" / "run.yaml").read_text())
    raw = nft_run_config(work, student, run_dir, seed, args, int(distill_run["training"]["data"]["text_max_length"]))
    (run_dir / "run.yaml").write_text(yaml.safe_dump(raw, sort_keys=True))
    cmd = [sys.executable, "-m", "distillery.cli.launch", "--standalone", "--nproc_per_node", "1",
           "-m", "distillery.cli.train", "--config", str(run_dir / "run.yaml")]
    with (folder / "train.log").open("w") as log:
        code = subprocess.run(cmd, env=_env(args.device), stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"error: post-training seed {seed} exited {code}:\n{(folder / 'train.log').read_text()[-2000:]}")
    summary = read_run_summary(run_dir)
    model = folder / "model"
    export_weights(summary.checkpoint_dir(run_dir), "student", model)
    _, scheduler = locate_transformer(str(student))
    if scheduler is not None:
        shutil.copytree(scheduler, model / "scheduler")
    (model / "sampling.json").write_text(json.dumps(summary.sampling))
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines() if line.strip()]
    return model, [{k: v for k, v in r.items() if k.startswith(("step", "reward"))} for r in rows if "reward" in r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    parser.add_argument("--scale", choices=sorted(SCALES), default="small")
    parser.add_argument("--work", type=Path, default=ROOT / ".nft-quality-work")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "nft_quality.json")
    parser.add_argument("--student", default="dmd2_2", choices=[s.name for s in STUDENTS if s.method == "dmd2"])
    parser.add_argument("--train-seeds", default="0,1", help="post-training seeds, comma-separated (≥ 2 for a spread)")
    parser.add_argument("--seeds", type=int, default=None, help="evaluation noise seeds per prompt (default: the scale's)")
    parser.add_argument("--prompts", type=int, default=None, help="evaluation prompts (default: the scale's)")
    parser.add_argument("--nft-steps", type=int, default=48, help="post-training optimizer steps")
    parser.add_argument("--k", type=int, default=4, help="rollouts per prompt")
    parser.add_argument("--prompts-per-group", type=int, default=4, help="prompts per rollout group (batch_size)")
    parser.add_argument("--minibatch", type=int, default=4, help="samples per update")
    parser.add_argument("--inner-epochs", type=int, default=1)
    parser.add_argument("--timestep-fraction", type=float, default=1.0, help="1: every timestep of the student's ladder")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--kl-beta", type=float, default=1e-4)
    parser.add_argument("--reuse", action="store_true", help="keep the work folder's base and student; post-train again")
    args = parser.parse_args(argv)
    import torch

    scale0 = SCALES[args.scale]
    scale = Scale(scale0.params, args.prompts or scale0.prompts, args.seeds or scale0.seeds, scale0.bootstrap)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    settings: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                                "device": args.device, "torch": torch.__version__, "scale": args.scale, "params": scale.params,
                                "student": args.student, "nft": {k: v for k, v in vars(args).items() if k not in ("work", "out")},
                                "skipped": [], "reference": "teacher_40", "bootstrap_resamples": scale.bootstrap}
    targs = argparse.Namespace(reuse=args.reuse, students=[args.student], train_jobs=1, eval_reserve_s=0.0, device=args.device)
    trained = train(targs, scale, work, float("inf"), settings)
    student = trained[args.student]
    seeds = [int(s) for s in args.train_seeds.split(",") if s]
    specs = [CandidateSpec("teacher_40", "teacher", str(work / "base" / "artifacts" / "teacher" / "model"), 40),
             CandidateSpec(args.student, "dmd2", str(student), None)]
    rewards = {}
    for seed in seeds:
        t0 = time.perf_counter()
        model, rows = post_train(work, student, seed, args)
        settings.setdefault("stage_seconds", {})[f"nft_s{seed}"] = round(time.perf_counter() - t0, 1)
        rewards[f"nft_s{seed}"] = rows
        print(f"[nft] post-trained seed {seed} in {settings['stage_seconds'][f'nft_s{seed}']} s: reward per group "
              f"{[round(r['reward'], 3) for r in rows]}", flush=True)
        specs.append(CandidateSpec(f"nft_s{seed}", "nft", str(model), None))
    settings["rollout_rewards"] = rewards
    eargs = argparse.Namespace(eval_jobs=1, sample_batch=1, device=args.device, rescore=False, keep_sampled=False)
    rows, floor = evaluate(eargs, scale, work, trained, float("inf"), settings, args.out, specs)
    settings["total_s"] = round(time.monotonic() - started, 1)
    write_results(args.out, settings, rows, floor)
    print(summary_table(rows, floor))
    print(f"[nft] {len(rows)} candidates in {settings['total_s']} s; results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
