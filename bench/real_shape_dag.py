"""Benchmark: the whole DAG at the real Wan2.1-T2V-1.3B shape, stage by stage, through ``distillery stage <name>``.

Run from the repository root (the stage's working directory, as under ``dvc repro``). It writes a
Wan2.1-T2V-1.3B-shaped diffusers folder with random weights and a few real-size captioned clips
(``bench/real_shape_pipeline.py``'s ``build_base`` / ``write_clips``), points ``params.yaml`` at them
with the real-shape profile (``--profile``, default ``docs/profiles/wan-1.3b-1gpu.yaml``) cut to a few
steps, then runs every stage in ``dvc.yaml``'s order as its own process — the command ``dvc.yaml``
calls — and, after the chain:

- ``distill`` with each method (``self_forcing`` first, then ``dmd2``) and ``pdd`` with each
  ``student_init`` (``teacher``, then ``distill``: the DMD2 student);
- a real-shape resume (``--resume-stage``): the ``teacher`` stage (default) or the ``distill`` stage (DMD2: two
  trainable roles, 34 GB a checkpoint) killed (SIGKILL to its process group) once its first mid-run checkpoint is
  on disk, rerun, and its exported weights compared with the uninterrupted run's tensor by tensor. For ``distill``
  the uninterrupted run is the ``distill_dmd2`` row (run it with the final checkpoint only: two 34 GB checkpoints
  of the default ``keep_last`` 2 in ``/dev/shm`` take half the GPU machine's memory) and the test's mid-run
  cadence comes from ``--set distill.save_every=N``.

With ``--dvc`` every stage runs through ``dvc repro <stage>`` instead, as a user runs the DAG: the copy becomes a
git repository (``git init`` + one commit where it is none), DVC's cache links instead of copying
(``cache.type hardlink,symlink``: the real-shape artifacts are ~30 GB on a 64 GiB disk), and ``distillery`` on
``PATH`` is a shim that runs ``python -m distillery.cli.main`` and writes when the stage's own command started and
ended, so each row also says what DVC spent before and after it (hashing deps and outs, linking the cache). After the
chain (label ``dvc_noop``) a second ``dvc repro`` of the whole DAG and ``dvc status`` show nothing left to run.

Per stage: wall seconds, GPU busy fraction and peak GPU memory (``nvidia-smi`` every 0.2 s), MiB
hashed / reused (the stage's own log line), the trainer's step timing (``run_summary.json``) and where
the wall time outside the GPU went (start-up to the first busy sample, tail after the last).
``$OUT/real_shape_dag.json`` is rewritten after every stage, so a job cut short still reports what ran.

Usage (device machine, under ``bash bench/gpu_job.sh run``): ``python bench/real_shape_dag.py
[--steps 2] [--budget 560] [--only teacher,pretrain,...]``; ``BENCH_SMOKE=1`` on CPU checks the script
at tiny shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shape_pipeline as rsp  # noqa: E402  (build_base, write_clips, GpuSampler, the shape constants)

OUT = Path(os.environ.get("OUT", "/tmp"))
LOGS = Path(os.environ.get("DAG_LOGS", "/tmp/real_shape_dag/logs"))  # each stage's whole log; their tails go to $OUT
STATE = LOGS.parent / "state.json"  # the rows so far: a second call on the same (warm) machine skips what ran
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
CMD_TIMES = LOGS / "stage_command_times.txt"  # --dvc: "<unix start> <unix end> <rc> <argv...>" per `distillery` call
HASH_LINE = re.compile(r"hashed ([\d.]+) MiB \((\d+) files\) from disk, reused ([\d.]+) MiB \((\d+) files\)")


def set_key(params: dict, dotted: str, value) -> None:
    node = params
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node[p]
    if leaf not in node:
        raise KeyError(f"params.yaml has no {dotted}")
    node[leaf] = value


def real_shape_params(base: Path, videos: Path, profile: Path, steps: int, resume_stage: str | None = "teacher",
                      sets: list[str] = ()) -> dict:
    """The repository's params.yaml with the profile's overrides, pointed at ``base``/``videos`` and cut
    to ``steps`` optimizer steps per training stage (the teacher also checkpoints at ``steps // 2`` when it is the
    ``resume_stage``), then ``sets`` (``KEY=VALUE``, the value read as YAML) on top."""
    params = yaml.safe_load(Path("params.yaml").read_text())
    overrides = yaml.safe_load(profile.read_text())["overrides"]
    for key, value in overrides.items():
        set_key(params, key, value)
    set_key(params, "base.path", str(base))
    set_key(params, "latents.data", str(videos))
    if SMOKE:
        for key, value in (("latents.num_frames", rsp.FRAMES), ("latents.height", rsp.HEIGHT), ("latents.width", rsp.WIDTH)):
            set_key(params, key, value)
    set_key(params, "clips.num_train", 2)
    set_key(params, "clips.num_validation", 2)
    for stage in ("teacher", "pretrain", "distill", "pdd"):
        set_key(params, f"{stage}.steps", steps)
        set_key(params, f"{stage}.save_every", steps)  # the final checkpoint only: 17 GB per trainable 1.3B role
    if resume_stage == "teacher":  # --resume-stage distill: its cadence comes from --set distill.save_every=N
        set_key(params, "teacher.save_every", max(1, steps // 2))  # the resume test's stage: a checkpoint mid-run
    set_key(params, "distill.generator_update_interval", steps)  # the last step updates the student too: one whole iteration
    set_key(params, "validate.num_prompts", 2)
    set_key(params, "validate.num_seeds", 2)
    set_key(params, "validate.teacher_steps", [4])
    set_key(params, "validate.pretrain_steps", 4)
    set_key(params, "validate.pdd_nfe", [4])
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set wants KEY=VALUE, got {item!r}")
        set_key(params, key, yaml.safe_load(value))
    return params


def write_params(params: dict) -> None:
    tmp = Path("params.yaml.tmp")
    tmp.write_text(yaml.safe_dump(params, sort_keys=False))
    tmp.replace("params.yaml")


def folder_mib(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20, 1) if path.exists() else 0.0


def weights_difference(a: Path, b: Path) -> dict:
    """Two model folders' ``*.safetensors`` compared tensor by tensor: the largest absolute difference, the largest
    relative L2 difference ``‖x − y‖ / ‖x‖`` and how many tensors are bitwise equal."""
    import torch
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        out: dict = {}
        for f in sorted(folder.rglob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    x, y = tensors(a), tensors(b)
    if x.keys() != y.keys():
        return {"weights_compared": False, "why": "different tensor names"}
    max_abs = max_rel = 0.0
    equal = 0
    for name, t in x.items():
        u, v = t.double(), y[name].double()
        equal += bool(torch.equal(t, y[name]))
        max_abs = max(max_abs, float((u - v).abs().max()))
        max_rel = max(max_rel, float((u - v).norm() / u.norm().clamp_min(1e-30)))
    return {"weights_compared": True, "tensors": len(x), "tensors_bitwise_equal": equal, "max_abs_diff": max_abs,
            "max_rel_l2_diff": max_rel}


def validate_phases(sampler, folder: Path) -> dict:
    """The validate stage's sampling phase: GPU busy over its candidates' sampling windows (report.json
    ``timeline``), and per candidate load s, sampling s, the wait for scoring, and the median s per video."""
    report = json.loads((folder / "report.json").read_text())
    metrics = json.loads((folder / "metrics.json").read_text()) if (folder / "metrics.json").exists() else {}
    samples = [r for r in sampler.rows if any(a <= r[0] <= b for a, b in (t["sampling_unix"] for t in report["timeline"].values()))]
    per = {name: {**{k: t[k] for k in ("load_s", "sampling_s", "scoring_wait_s")},
                  "latency_s": metrics.get(f"{name}/latency_s", report["latency"].get(name, {}).get("median_s"))}
           for name, t in report["timeline"].items()}
    return {"sampling_gpu_busy_fraction": round(sum(r[1] for r in samples) / len(samples) / 100, 3) if samples else None,
            "sampling_samples": len(samples), "candidates": per, "report_seconds": report.get("seconds")}


class Job:
    def __init__(self, budget: float, dvc_env: dict | None = None) -> None:
        self.dvc_env = dvc_env  # --dvc: the environment `dvc repro` runs in (the shim on PATH); None: `distillery stage`
        self.sampler = rsp.GpuSampler()
        self.started = time.time()
        self.budget = budget
        self.rows: list[dict] = []
        self.meta: dict = {"shape": [rsp.FRAMES, rsp.HEIGHT, rsp.WIDTH], "smoke": SMOKE}
        self.free_checkpoints = True
        self.earlier: list[dict] = json.loads(STATE.read_text())["stages"] if STATE.exists() else []

    def left(self) -> float:
        return self.budget - (time.time() - self.started)

    def save(self) -> None:
        mine = {r["stage"] for r in self.rows}  # an earlier call's rows stay (a call with --only runs a few)
        rows = [r for r in self.earlier if r["stage"] not in mine] + self.rows
        text = json.dumps({**self.meta, "stages": rows}, indent=1)
        (OUT / "real_shape_dag.json").write_text(text)
        STATE.write_text(text)  # the next call of the job on this machine goes on from here

    def done(self, label: str) -> dict | None:
        """The row of ``label`` if it ran to the end, in this call or an earlier one on the same machine."""
        return next((r for r in self.rows + self.earlier if r["stage"] == label and r.get("rc") == 0), None)

    def stage(self, name: str, label: str | None = None, kill_when=None, min_left: float = 25) -> dict:
        """``distillery stage name`` as its own process (its log in ``LOGS``); ``kill_when()`` true → SIGKILL its group."""
        label = label or name
        if (row := self.done(label)) is not None and kill_when is None:
            self.rows.append({**row, "from_earlier_call": True})
            self.save()
            return row
        row: dict = {"stage": label}
        if self.left() < min_left:
            row["skipped"] = "out of the job's time"
            self.rows.append(row)
            self.save()
            return row
        log_path = LOGS / f"stage-{label}.log"
        LOGS.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        with open(log_path, "w") as log:
            argv = ([sys.executable, "-m", "dvc", "repro", name] if self.dvc_env is not None
                    else [sys.executable, "-m", "distillery.cli.main", "stage", name])
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.dvc_env)
            killed = False
            while proc.poll() is None:
                if kill_when is not None and not killed and kill_when():
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = True
                if self.left() < 5 and not killed:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = True
                    row["cut"] = "killed at the job's time limit"
                time.sleep(0.2)
        t1 = time.time()
        row.update(rc=proc.returncode, wall_s=round(t1 - t0, 1), **self.sampler.window(t0, t1))
        busy = [r for r in self.sampler.rows if t0 <= r[0] <= t1 and r[1] > 0]
        if busy:
            row["before_gpu_s"] = round(busy[0][0] - t0, 1)  # imports, params check, hashing, model load to the first kernel
            row["after_gpu_s"] = round(t1 - busy[-1][0], 1)  # checkpoint/artifact writes, lineage, exit
        text = log_path.read_text(errors="replace")
        if self.dvc_env is not None:
            row.update(dvc_split(t0, t1, name))
        if m := HASH_LINE.search(text):
            row.update(hashed_mib=float(m[1]), reused_mib=float(m[3]))
        if killed:
            row["killed"] = True
        elif proc.returncode != 0:
            row["error"] = " | ".join(line for line in text.strip().splitlines()[-4:])[-600:]
        summary = Path("runs", name, "run_summary.json")
        if name in ("teacher", "pretrain", "distill", "pdd") and summary.exists() and summary.stat().st_mtime >= t0:
            data = json.loads(summary.read_text())
            row["timing"] = data.get("timing")
            row["last_metrics"] = {k: v for k, v in (data.get("last_metrics") or {}).items() if not k.startswith("lr/")}
        if Path("artifacts", name).exists() and not killed:
            row["artifact_mib"] = folder_mib(Path("artifacts", name))
        if name == "validate" and proc.returncode == 0:
            row.update(validate_phases(self.sampler, Path("artifacts", "validate", "report")))
        if name in ("teacher", "pretrain", "distill", "pdd") and proc.returncode == 0 and self.free_checkpoints:
            row["checkpoints_mib"] = folder_mib(Path("runs", name))
            for ckpt in Path("runs", name).glob("checkpoint-*"):  # the device's 64 GiB disk holds few 17 GB checkpoints
                shutil.rmtree(ckpt, ignore_errors=True)
        self.rows.append(row)
        self.save()
        with open(OUT / "stage_log_tails.txt", "a") as tails:
            tails.write(f"===== {label} rc={proc.returncode}\n" + "\n".join(text.splitlines()[-25:]) + "\n")
        print(json.dumps(row), flush=True)
        return row


def dvc_split(t0: float, t1: float, name: str) -> dict:
    """What ``dvc repro`` spent around the stage's own command (the shim's start/end lines within ``[t0, t1]``): the
    stage commands DVC ran, the command's seconds, DVC's seconds before it (reading dvc.yaml and the lock, hashing
    deps) and after it (hashing the outs, moving them into the cache and linking them back, writing dvc.lock)."""
    calls = []
    if CMD_TIMES.exists():
        for line in CMD_TIMES.read_text().splitlines():
            start, end, rc, *argv = line.split()
            if t0 <= float(start) <= t1:
                calls.append((float(start), float(end), int(rc), argv))
    row: dict = {"dvc_ran": [" ".join(argv) for *_, argv in calls]}
    mine = [c for c in calls if c[3][-1:] == [name]]
    if mine:
        start, end, _, _ = mine[-1]
        row.update(stage_command_s=round(end - start, 1), dvc_before_s=round(start - t0, 1), dvc_after_s=round(t1 - end, 1))
    return row


def setup_dvc(root: Path) -> dict:
    """The copy as a DVC user's repository: a git repository with one commit (made here when the copy has none: the
    device's copy of a working tree has no ``.git``), DVC's cache linking outs instead of copying them, and a
    ``distillery`` shim on ``PATH`` (the package is on ``PYTHONPATH`` there, not pip-installed) that records each stage
    command's start and end in ``CMD_TIMES``. Returns the environment ``dvc repro`` runs in."""
    if subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], capture_output=True).returncode != 0:
        subprocess.run(["git", "init", "-q"], check=True)
        with open(".git/info/exclude", "a") as exclude:  # the carried wheels and the device's own set-up file
            exclude.write("/.whl/\n/.whl-parts/\n/device-env.sh\n/runs\n")  # runs: a symlink to scratch
        subprocess.run(["git", "add", "-A"], check=True)
        subprocess.run(["git", "-c", "user.name=real-shape-bench", "-c", "user.email=bench@localhost", "commit", "-q", "-m",
                        "the device's copy of the working tree"], check=True)
    dvc = [sys.executable, "-m", "dvc"]
    for key, value in (("cache.type", "hardlink,symlink"), ("core.analytics", "false")):
        subprocess.run([*dvc, "config", "--local", key, value], check=True)
    bindir = root / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    shim = bindir / "distillery"
    shim.write_text("#!/bin/sh\n"
                    "start=$(date +%s.%N)\n"
                    f'"{sys.executable}" -m distillery.cli.main "$@"\n'
                    "rc=$?\n"
                    f'echo "$start $(date +%s.%N) $rc distillery $*" >> "{CMD_TIMES}"\n'
                    "exit $rc\n")
    shim.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir.resolve()}:{os.environ.get('PATH', '')}", "DVC_NO_ANALYTICS": "1"}


def dvc_noop(job: "Job") -> None:
    """After the chain: ``dvc repro`` of the whole DAG again (nothing changed: nothing may run) and ``dvc status``;
    the row says how long each took, what DVC printed, and the cache's size on disk (hard links: counted once)."""
    row: dict = {"stage": "dvc_noop"}
    for key, argv in (("repro", ["repro"]), ("status", ["status"])):
        t0 = time.time()
        done = subprocess.run([sys.executable, "-m", "dvc", *argv], capture_output=True, text=True, env=job.dvc_env)
        row[f"{key}_s"] = round(time.time() - t0, 2)
        row[f"{key}_rc"] = done.returncode
        row[f"{key}_output"] = (done.stdout + done.stderr).strip().splitlines()[-12:]
        row[f"{key}_dvc_ran"] = dvc_split(t0, time.time(), "")["dvc_ran"]  # must be empty: nothing reran
    du = subprocess.run(["du", "-sm", ".dvc/cache", "artifacts"], capture_output=True, text=True).stdout.split()
    row["disk_mib"] = dict(zip(du[1::2], (int(x) for x in du[0::2])))  # du counts a hard-linked file once
    job.rows.append(row)
    job.save()
    print(json.dumps(row), flush=True)


def resume_test(job: "Job", stage: str, reference: dict, first: int) -> None:
    """``stage`` killed (SIGKILL to its process group) once ``checkpoint-<first>`` is on disk, rerun, and its artifact's
    weights compared tensor by tensor with the uninterrupted run's (``reference``: its row; its artifact is copied aside
    first, as nothing since rewrote it)."""
    run_dir = Path("runs", stage)
    shutil.rmtree(run_dir, ignore_errors=True)
    kept = Path("runs", f"uninterrupted-{stage}")  # its weights, to compare numerically (GPU kernels are not bitwise)
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(Path("artifacts", stage, "model"), kept)
    killed = job.stage(stage, f"{stage}_killed", kill_when=lambda: (run_dir / f"checkpoint-{first}").is_dir(), min_left=60)
    read_mib = folder_mib(run_dir / f"checkpoint-{first}")
    resumed = job.stage(stage, f"{stage}_resumed", min_left=40)
    difference = weights_difference(kept, Path("artifacts", stage, "model"))
    resumed["resume"] = {"killed_after_checkpoint": first, "checkpoint_read_mib": read_mib, "killed_rc": killed.get("rc"),
                         "weights_equal_uninterrupted": difference.get("tensors_bitwise_equal") == difference.get("tensors"),
                         **difference,
                         "loss": {"uninterrupted": (reference.get("last_metrics") or {}).get("total_loss"),
                                  "resumed": (resumed.get("last_metrics") or {}).get("total_loss")}}
    shutil.rmtree(kept, ignore_errors=True)
    log_file = LOGS / f"stage-{stage}_resumed.log"
    text = log_file.read_text(errors="replace") if log_file.exists() else ""  # not run: out of the job's time
    resumed["resume"]["log"] = [line[-200:] for line in text.splitlines() if "resum" in line.lower()][:4]
    job.save()
    print(json.dumps(resumed["resume"]), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/tmp/real_shape_dag")
    parser.add_argument("--profile", default="docs/profiles/wan-1.3b-1gpu.yaml")
    parser.add_argument("--text-encoder", choices=["xxl", "small"], default="small",
                        help="small: a 2-layer UMT5 of the XXL's width (the 11 GB XXL does not leave room on a 64 GiB disk)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--budget", type=float, default=560, help="seconds; stages that would start later are skipped")
    parser.add_argument("--only", default="", help="comma-separated labels to run (default: all)")
    parser.add_argument("--no-resume-test", action="store_true")
    parser.add_argument("--resume-stage", choices=["teacher", "distill"], default="teacher",
                        help="the stage the resume test kills and reruns (distill: the DMD2 run is the uninterrupted one; "
                             "give it a mid-run checkpoint with --set distill.save_every=N)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a params.yaml value after the profile and the step cut, e.g. distill.steps=4")
    parser.add_argument("--dvc", action="store_true", help="each stage through `dvc repro <stage>` (a git repository and "
                        "DVC's linking cache set up first), then a no-op `dvc repro` and `dvc status` (label dvc_noop)")
    parser.add_argument("--workdir", default="", help="run in a copy of the repository there (made by the first call; "
                        "later calls on the same machine go on in it: the device refreshes its copy of the working tree "
                        "between calls, which would drop the .git and dvc.lock a --dvc run made)")
    parser.add_argument("--runs-dir", default="", help="put runs/ (checkpoints) there, e.g. /dev/shm/runs (a symlink)")
    args = parser.parse_args()
    if not Path("dvc.yaml").exists():
        raise SystemExit("run from the repository root (the stages' working directory)")
    if args.workdir:
        workdir = Path(args.workdir).resolve()
        if not (workdir / "dvc.yaml").exists():
            shutil.copytree(".", workdir, symlinks=True, ignore=shutil.ignore_patterns(
                ".git", ".whl", ".whl-parts", ".venv", "artifacts", "runs", "mlruns", "mlflow.db", "__pycache__", "*.egg-info"))
        os.chdir(workdir)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(workdir / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    if args.runs_dir and not Path("runs").exists():  # checkpoints on scratch space (the stages count them there)
        Path(args.runs_dir).mkdir(parents=True, exist_ok=True)
        Path("runs").symlink_to(Path(args.runs_dir).resolve(), target_is_directory=True)
    job = Job(args.budget, setup_dvc(root) if args.dvc else None)
    want = set(filter(None, args.only.split(",")))

    def run(name: str, label: str | None = None, **kw) -> dict | None:
        if want and (label or name) not in want:
            return None
        return job.stage(name, label, **kw)

    t0 = time.time()
    base = root / "wan-1.3b-shape"
    if not (base / "model_index.json").exists():
        base = rsp.build_base(root, args.text_encoder)
    videos = root / "videos"
    if not (videos / "train" / "captions.jsonl").exists():
        videos = rsp.write_clips(root, train=3, validation=2)
    job.meta["setup_s"] = round(time.time() - t0, 1)
    params = real_shape_params(base, videos, Path(args.profile), args.steps,
                               None if args.no_resume_test else args.resume_stage, args.set)
    write_params(params)
    job.meta["params"] = params
    for name in ("clips", "base", "latents"):
        run(name)
    run("teacher")
    run("pretrain")
    for name, label, key, value in (("distill", "distill_self_forcing", "distill.method", "self_forcing"),
                                    ("pdd", "pdd_from_teacher", "pdd.student_init", "teacher"),
                                    ("distill", "distill_dmd2", "distill.method", "dmd2"),
                                    ("pdd", "pdd_from_distill", "pdd.student_init", "distill")):  # each recipe of a stage
        if want and label not in want and not job.done(label):
            continue  # params.yaml keeps the recipe whose artifact is on disk (validate and export read those)
        set_key(params, key, value)
        write_params(params)
        run(name, label)
    run("validate")
    run("export")
    if args.dvc and (not want or "dvc_noop" in want):
        dvc_noop(job)
    stage = args.resume_stage
    reference = job.done({"teacher": "teacher", "distill": "distill_dmd2"}[stage])  # the uninterrupted run
    if (not args.no_resume_test and reference and (not want or f"{stage}_resume" in want)
            and not job.done(f"{stage}_resumed")):
        resume_test(job, stage, reference, first=max(1, args.steps // 2) if stage == "teacher" else params[stage]["save_every"])
    job.meta["total_s"] = round(time.time() - job.started, 1)
    job.save()
    job.sampler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
