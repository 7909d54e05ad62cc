"""Quality benchmark: does distillation work? Every student at 1, 2 and 4 NFE against the teacher, with intervals.

Runs the tiny-base DAG's stages with scaled settings in a work folder — what ``distillery stage <name>``
computes: the stages' library functions and the recipes' run configs (:func:`run_one_stage`), without
DVC, MLflow or lineage, which the GPU image lacks —, trains every student, samples every candidate on many
prompts × seeds and scores it against the 40-step teacher's samples:

- **training** (``<work>/base``): clips → base → latents → teacher → pretrain, then each student in a
  workspace of its own (a copy of those artifacts; ``--train-jobs`` at a time, as separate processes):
  DMD2 on 1-, 2- and 4-step ladders (``distill.method: dmd2``, ``distill.student_steps``), Self-Forcing at
  its ladder (``distill.student_steps``), PDD (``pdd.method: pdd``) and DM-PDD (``pdd.method: dm_pdd``);
- **candidates**: the teacher (Euler, CFG ``validate.guidance_scale``) at 40 (the reference), 8, 4, 2 and 1
  steps; ``dmd2_1``, ``dmd2_2``, ``dmd2_4``; ``self_forcing``; ``pdd_{1,2,4,8}``; ``dm_pdd_{1,2,4,8}`` (the PDD
  students at those NFE). Each is sampled by :func:`distillery.evaluation.validate.run_validation` alone (its
  own process, ``--eval-jobs`` at a time) on the prompts of ``bench/quality_prompts.txt`` (the first
  ``prompts`` of them) × ``seeds`` noise seeds, the same noise for every candidate;
- **scores** (per candidate, each with a 95% interval): ``adherence`` (the analyzer's ``all``: colour,
  shape and direction read back, as a fraction of the videos; percentile bootstrap over videos),
  ``kid`` (:mod:`distillery.evaluation.kid`, both sets resampled) and ``frechet`` (the Fréchet distance of
  :mod:`distillery.evaluation.video_metrics`; the candidate's videos resampled against the fixed reference,
  the percentiles shifted by the bootstrap's own bias, as repeated rows inflate the distance: :func:`quality_scores.shifted_ci`)
  to the 40-step teacher's videos over the documented features (``FEATURE_NAMES``, standardised by the
  reference), ``paired_distance`` (mean squared RGB difference to the teacher's video of the same prompt
  and noise; bootstrap over videos), ``sharpness`` (variance of the Laplacian; bootstrap), ``nfe`` and
  ``latency_s`` (median seconds per video, sampling + decode, measured while ``--eval-jobs`` candidates
  sample at once; with ``--sample-batch`` B > 1 — the GPU default, 32 — a batch's wall time / B, which is a
  throughput, not a batch-1 latency);
- **floor**: the 40-step teacher against itself across seeds — its seed indices ``[0, S/2)`` against
  ``[S/2, S)`` (two sets of P·S/2 videos; with the same prompts): KID, Fréchet (with intervals) and
  paired distance, the distances sampling noise alone gives, plus its adherence and sharpness. The
  Fréchet floor compares half-size sets, so it overstates the noise of full-size distances somewhat;
  KID is unbiased at any size.

Output (``--out``, default ``bench/results/quality.json``; rewritten after every candidate, so a run
stopped at its budget keeps what it finished): ``{"settings", "candidates": [{"name", "method", "nfe",
"latency_s", "<m>", "<m>_ci": [lo, hi] for m in kid, frechet, adherence, sharpness, paired_distance, "adherence_parts":
{colour, shape, direction}}],
"floor"}``; beside it ``quality_goals.json`` (the issue's goals checked against the intervals) and
``quality_nfe_vs_distance.png`` (KID and Fréchet against NFE per method, the floor as a band). A
summary table goes to stdout.

Runs::

    python bench/quality.py --device cuda --scale gpu --budget-s 450     # one H200, ~8 minutes
    python bench/quality.py --device cpu --scale small                   # CPU, opt-in long run

``--budget-s``: the shared stages always run; a student that has not finished training when only
``--eval-reserve-s`` (default 45% of the budget) is left is stopped and left out, and no candidate starts
sampling after the budget (the reference always does); what is left out is listed in ``settings.skipped``.
``--reuse`` keeps a work folder's trained students (evaluation only); ``--rescore`` scores its samples again;
``--keep-sampled`` (with ``--reuse``) samples only the candidates the work folder has no current samples of — a
candidate's samples are kept when its report.json has these prompts, seeds, video size and sampling contract and is
newer than every file of its model (a student retrained since is sampled again) — so a cut evaluation resumes, and a
retrained student is compared with the others' samples as they were (``settings.kept_sampled`` names them).
``--train-only`` stops after training: with ``--reuse`` a later call (a later device call on the same machine)
evaluates.

Consistency and GAN (issue 60): ``cd_self_forcing`` and ``ode_self_forcing`` each train their own pretrain first
(``pretrain.method: causal_cd`` / ``ode_init``: the student's workspace makes it, then Self-Forcing from it), the same
Self-Forcing as ``self_forcing`` (whose pretrain is the shared DFSFT one); ``dmd2_4_gan`` is ``dmd2_4`` with
``distill.gan_weight: 0.1``. They run only when named::

    python bench/quality.py --device cpu --scale small --students cd_self_forcing,ode_self_forcing,dmd2_4,dmd2_4_gan \
        --train-seeds 2 --prompts 32 --teacher-steps 40

Sparse against dense (issue 64): ``--sparse 0.9:1,1,2`` trains each chosen student a second time with block-sparse
attention (its stage's params ``<stage>.attention: sparse``, ``sparsity``, ``sparse_tile``: the recipe gives them to
the student's model), sampled with it (its artifact records it); ``--train-seeds N`` trains every student with params
``seed`` 0 … N − 1; ``settings.sparse_vs_dense`` lists, per student and metric, each seed's value and their mean and
spread both ways.
``--teacher-steps 40,4`` limits the teacher's candidates (40 is the reference)::

    python bench/quality.py --device cpu --scale small --students dmd2_4,self_forcing --train-seeds 3 \
        --sparse 0.9:1,1,2 --teacher-steps 40,4

Two experts (issue 63): ``--base a14b`` runs every stage on a tiny Wan 2.2 A14B folder (made in the work folder) with
``pretrain.method: ode_init_bidirectional`` (DFSFT refuses two experts); ``phased_dmd`` (4 steps) joins, ``dmd2_4``
is its baseline: ``--base a14b --students dmd2_4,phased_dmd --train-seeds 2 --teacher-steps 40,4``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quality_scores import Sampled, check_goals, floor_scores, load_sampled, score, sparse_vs_dense, summary_table, write_plot, write_results

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_FILE = ROOT / "bench" / "quality_prompts.txt"
GUIDANCE = 4.0  # the teacher's CFG (validate.guidance_scale)
TEACHER_STEPS = (40, 8, 4, 2, 1)
PDD_NFE = (1, 2, 4, 8)


@dataclass(frozen=True)
class Scale:
    """One benchmark size: the params.yaml values it sets and the evaluation's prompts × seeds."""

    params: dict[str, Any]
    prompts: int
    seeds: int
    bootstrap: int = 500


_SMALL = {"clips.num_train": 48, "clips.num_validation": 8,
          "teacher.steps": 60, "teacher.batch_size": 8, "teacher.save_every": 0,
          "pretrain.steps": 60, "pretrain.batch_size": 8, "pretrain.save_every": 0,
          "distill.steps": 40, "distill.batch_size": 8, "distill.save_every": 0,
          "pdd.steps": 60, "pdd.batch_size": 8, "pdd.save_every": 0}
_GPU = {"clips.num_train": 512, "clips.num_validation": 32,
        "teacher.steps": 600, "teacher.batch_size": 32, "teacher.save_every": 0,
        "pretrain.steps": 400, "pretrain.batch_size": 32, "pretrain.save_every": 0,
        "distill.steps": 400, "distill.batch_size": 32, "distill.save_every": 0,
        "pdd.steps": 600, "pdd.batch_size": 32, "pdd.save_every": 0}
SCALES = {
    "small": Scale(_SMALL, prompts=8, seeds=2, bootstrap=300),  # CPU end to end: minutes, not the ≥ 256 videos
    "gpu": Scale(_GPU, prompts=32, seeds=8),  # 256 videos per candidate; one H200 in ~8 minutes
    "large": Scale({**_GPU, "teacher.steps": 2000, "pretrain.steps": 1200, "distill.steps": 1500, "pdd.steps": 2000},
                   prompts=32, seeds=16),
}


@dataclass(frozen=True)
class Student:
    """A student trained in its own workspace: the stage and the params that pick its recipe (and, ``--sparse``, its
    attention); ``twin_of``: the dense student a sparse one is the twin of (None: not a sparse twin)."""

    name: str
    stage: str  # distill | pdd
    method: str  # dmd2 | self_forcing | pdd | dm_pdd | phased_dmd (a sparse twin: + _sparse)
    params: dict[str, Any] = field(default_factory=dict)
    twin_of: str | None = None
    own_pretrain: bool = False  # its params pick its own pretrain (pretrain.method): trained in its workspace first
    experts: int = 1  # 2: only on a base of two experts (--base a14b)

    @property
    def stages(self) -> str:
        """The stages its workspace runs, ``+``-joined: its own pretrain first when it has one."""
        return f"pretrain+{self.stage}" if self.own_pretrain else self.stage


STUDENTS = (
    Student("dmd2_1", "distill", "dmd2", {"distill.method": "dmd2", "distill.student_steps": 1}),
    Student("dmd2_2", "distill", "dmd2", {"distill.method": "dmd2", "distill.student_steps": 2}),
    Student("dmd2_4", "distill", "dmd2", {"distill.method": "dmd2", "distill.student_steps": 4}),
    Student("self_forcing", "distill", "self_forcing", {"distill.method": "self_forcing"}),
    Student("pdd", "pdd", "pdd", {"pdd.method": "pdd"}),
    Student("dm_pdd", "pdd", "dm_pdd", {"pdd.method": "dm_pdd"}),
    # issue 60: the same Self-Forcing from a causal-CD and from an ODE-init pretrain; DMD2 (4 steps) with its GAN term
    Student("cd_self_forcing", "distill", "self_forcing", {"distill.method": "self_forcing", "pretrain.method": "causal_cd"},
            own_pretrain=True),
    Student("ode_self_forcing", "distill", "self_forcing", {"distill.method": "self_forcing", "pretrain.method": "ode_init"},
            own_pretrain=True),
    Student("dmd2_4_gan", "distill", "dmd2", {"distill.method": "dmd2", "distill.student_steps": 4, "distill.gan_weight": 0.1}),
    Student("phased_dmd", "distill", "phased_dmd", {"distill.method": "phased_dmd", "distill.student_steps": 4}, experts=2),
)
DEFAULT_STUDENTS = ("dmd2_1", "dmd2_2", "dmd2_4", "self_forcing", "pdd", "dm_pdd")  # without --students
ON_A14B = ("dmd2_1", "dmd2_2", "dmd2_4", "phased_dmd")  # the students --base a14b takes (bidirectional ones), its default


@dataclass(frozen=True)
class CandidateSpec:
    """One candidate to sample: a teacher step count, or a student's artifact (at an NFE for PDD)."""

    name: str
    method: str  # teacher | dmd2 | self_forcing | pdd | dm_pdd
    model_dir: str
    steps: int | None  # Euler steps (teacher), the PDD NFE, or None: the artifact's contract


def expand_students(chosen: list[Student], train_seeds: int, sparse: dict[str, Any] | None) -> list[Student]:
    """Each chosen student trained with ``train_seeds`` seeds (params ``seed`` 0 … N − 1; ``<name>`` then
    ``<name>_seed<k>``), and with ``sparse`` (``{"sparsity", "sparse_tile"}``) each also as a twin whose student
    trains and samples with block-sparse attention (``<stage>.attention: sparse`` …; ``<name>_sparse…``, the same
    seeds)."""
    out = []
    for student in chosen:
        for twin in ([False, True] if sparse else [False]):
            for k in range(train_seeds):
                name = student.name + ("_sparse" if twin else "") + (f"_seed{k}" if k else "")
                params = {**student.params, **({"seed": k} if k else {})}
                if twin:
                    params.update({f"{student.stage}.attention": "sparse", **{f"{student.stage}.{key}": value
                                                                               for key, value in sparse.items()}})
                out.append(Student(name, student.stage, student.method + ("_sparse" if twin else ""), params,
                                   student.name if twin else None, student.own_pretrain, student.experts))
    return out


def sparse_twins(students: list[Student]) -> dict[str, dict[str, list[str]]]:
    """Per student trained both ways, its candidates' names, one per training seed: ``{student: {"dense": [...],
    "sparse": [...]}}`` (:func:`quality_scores.sparse_vs_dense`)."""
    twins: dict[str, dict[str, list[str]]] = {}
    for s in students:
        if s.twin_of is not None:
            twins.setdefault(s.twin_of, {"dense": [], "sparse": []})["sparse"].append(s.name)
    for s in students:
        base = s.name.split("_seed")[0]
        if s.twin_of is None and base in twins:
            twins[base]["dense"].append(s.name)
    return twins


def candidate_specs(work: Path, trained: dict[str, Path], students: list[Student] | None = None,
                    teacher_steps: tuple[int, ...] = TEACHER_STEPS) -> list[CandidateSpec]:
    """The reference (teacher_40) first, then every candidate whose model exists."""
    teacher = str(work / "base" / "artifacts" / "teacher" / "model")
    specs = [CandidateSpec(f"teacher_{n}", "teacher", teacher, n) for n in teacher_steps]
    for student in students if students is not None else STUDENTS:
        if student.name not in trained:
            continue
        model = str(trained[student.name])
        if student.stage == "pdd":
            specs += [CandidateSpec(f"{student.name}_{n}", student.method, model, n) for n in PDD_NFE]
        else:
            specs.append(CandidateSpec(student.name, student.method, model, None))
    return specs


# -- running stages ------------------------------------------------------------------------------
def _env(device: str) -> dict[str, str]:
    # one thread per CPU process unless told: on a shared machine two OpenMP threads per training spin against the
    # other processes' (a DM-PDD step: 18 s with two threads beside one other job on the 2-core machine, 0.26 s with one)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if device == "cpu" else "2")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != src]])
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # every stage and worker on the CPU
    return env


def set_params(path: Path, updates: dict[str, Any]) -> None:
    import yaml

    data = yaml.safe_load(path.read_text())
    for dotted, value in updates.items():
        node = data
        *head, last = dotted.split(".")
        for part in head:
            node = node[part]
        node[last] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def make_workspace(folder: Path, updates: dict[str, Any], artifacts_from: Path | None = None,
                   own: tuple[str, ...] = ()) -> Path:
    """A pipeline folder (dvc.yaml, params.yaml, stages) with ``updates`` set; with ``artifacts_from``,
    links to that workspace's artifacts (a student's inputs: base, latents, teacher, pretrain — but those in ``own``,
    which it makes itself)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("dvc.yaml", "params.yaml", "stages"):
        dst = folder / name
        if dst.is_dir():
            shutil.rmtree(dst)
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(ROOT / name, dst)
    set_params(folder / "params.yaml", updates)
    if artifacts_from is not None:
        shutil.rmtree(folder / "artifacts", ignore_errors=True)
        (folder / "artifacts").mkdir()
        for name in sorted({"base", "latents", "teacher", "pretrain"} - set(own)):
            (folder / "artifacts" / name).symlink_to(artifacts_from / "artifacts" / name, target_is_directory=True)
    return folder


def run_one_stage(folder: Path, name: str, device: str) -> None:
    """What ``distillery stage <name>`` computes, in ``folder`` (its cwd), without DVC, MLflow or lineage
    (the device image has neither): clips, base and latents call the stage's library functions; a
    training stage builds its run config with its recipe as the stage does
    (:func:`stages.training.stage_run_config`, tracker off), trains it under ``torchrun``
    (``distillery.cli.launch``) and exports the trained role as the stage's ``artifacts/<name>/model``."""
    os.chdir(folder)
    from distillery.pipeline.dvcfile import stage_params
    from distillery.pipeline.params.reader import Params, StageParams
    from distillery.pipeline.publish.artifacts import ARTIFACTS, RUNS

    params = Params.load("params.yaml")
    view = StageParams(params, name, stage_params(name))
    out = ARTIFACTS / name
    shutil.rmtree(out, ignore_errors=True)
    if name == "clips":
        from distillery.clips.synthetic import ClipSetConfig, make_clip_set

        c = view.get("clips")
        make_clip_set(out / "data", ClipSetConfig(num_train=c.num_train, num_validation=c.num_validation,
                                                  num_frames=c.num_frames, height=c.size, width=c.size,
                                                  fps=int(c.fps), seed=view.get("seed")))
        return
    if name == "base":
        from distillery.pipeline.params.base_path import resolve_base
        from distillery.pipeline.publish.base_folder import copy_model_folder

        copy_model_folder(resolve_base(view.get("base.path")), out / "model", exclude=("lineage.json",))
        return
    if name == "latents":
        from distillery.data.preprocess import PreprocessConfig, preprocess

        size = view.get("clips.size")
        cfg = PreprocessConfig(num_frames=view.get("clips.num_frames"), height=size, width=size, fps=float(view.get("clips.fps")),
                               rows_per_shard=view.get("latents.rows_per_shard"), device="cuda" if device == "cuda" else "cpu")
        preprocess(ARTIFACTS / "base" / "model", ARTIFACTS / "clips" / "data", out / "data", cfg)
        return
    import yaml

    from distillery.config.schema import TrackerConfig
    from distillery.export.weights import export_weights
    from distillery.models.registry import locate_transformer
    from distillery.pipeline.launch.run_config import EXPORT_ROLE, check_run_config
    from distillery.pipeline.launch.sparse_preflight import check_stage_attention
    from distillery.pipeline.params.recipes import prepared_data
    from distillery.pipeline.publish.run_summary import read_run_summary
    from stages.training import stage_run_config

    check_stage_attention(name, params)  # a sparse student that cannot train so: one line, as the stage's preflight
    prepared = prepared_data(view.recipe(), getattr(view.typed, name), view)  # ode_init: the teacher's trajectories first
    config, roles = stage_run_config(view, "", prepared)
    config.training.tracker = TrackerConfig(backend="none")
    check_run_config(name, config, roles)
    run_dir = RUNS / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "run.yaml").write_text(yaml.safe_dump(config.to_plain(), sort_keys=True))
    cmd = [sys.executable, "-m", "distillery.cli.launch", "--standalone", "--nproc_per_node", "1",
           "-m", "distillery.cli.train", "--config", str(run_dir / "run.yaml")]
    code = subprocess.run(cmd, env=_env(device)).returncode
    if code != 0:
        raise SystemExit(f"error: training {name} in {folder} exited {code}")
    summary = read_run_summary(run_dir)
    export_weights(summary.checkpoint_dir(run_dir), EXPORT_ROLE, out / "model")
    _, scheduler = locate_transformer(config.models[EXPORT_ROLE].config.init_from)
    if scheduler is not None:
        shutil.copytree(scheduler, out / "model" / "scheduler")
    (out / "model" / "sampling.json").write_text(json.dumps(summary.sampling))
    (out / "loss.json").write_text(json.dumps(summary.loss_rows()))


def stage_command(folder: Path, name: str, device: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--device", device, "--stage-one", str(folder), name]


def run_stage(folder: Path, name: str, device: str, logs: Path) -> float:
    """:func:`run_one_stage` in its own process (its log in ``logs/``); returns its wall seconds."""
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with (logs / f"{folder.name}-{name}.log").open("w") as log:
        code = subprocess.run(stage_command(folder, name, device), cwd=folder, env=_env(device), stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = (logs / f"{folder.name}-{name}.log").read_text()[-2000:]
        raise SystemExit(f"error: stage {name} in {folder} failed ({code}):\n{tail}")
    return time.perf_counter() - t0


# -- sampling one candidate (a worker process) --------------------------------------------------
def sample_candidate(spec: CandidateSpec, base_dir: str, prompts: list[str], settings: dict[str, Any],
                     out_dir: str, device: str) -> dict[str, Any]:
    """Sample one candidate with :func:`run_validation` (it is its own reference there); returns its NFE,
    latency and wall seconds. Its report.json and latents.safetensors stay in ``out_dir``."""
    import logging

    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    logging.getLogger("distillery").setLevel(logging.WARNING)
    from distillery.evaluation.candidates import Candidate
    from distillery.evaluation.validate import run_validation
    from distillery.evaluation.validation_config import ValidationConfig

    t0 = time.perf_counter()
    if spec.method == "teacher":
        cand = Candidate(spec.name, Path(spec.model_dir), int(spec.steps), GUIDANCE, "euler")
    else:
        cand = Candidate.from_artifact(spec.name, Path(spec.model_dir), spec.steps)
    cfg = ValidationConfig(prompts=prompts, num_frames=settings["num_frames"], height=settings["height"],
                           width=settings["width"], fps=settings["fps"], num_seeds=settings["seeds"], seed=0,
                           bootstrap_resamples=0, grid_formats=[], progress_bar=False,
                           device="cuda" if device == "cuda" else "cpu", sample_batch=int(settings.get("sample_batch", 1)))
    metrics = run_validation(Path(base_dir), [cand], prompts, Path(out_dir), cfg)
    return {"nfe": metrics[f"{spec.name}/nfe"], "latency_s": metrics[f"{spec.name}/latency_s"],
            "sampling_s": round(time.perf_counter() - t0, 2), "sampler": cand.sampler, "num_steps": cand.num_steps}


def current_samples(spec: CandidateSpec, work: Path, prompts: list[str], sampling: dict[str, Any]) -> dict[str, Any] | None:
    """``work/eval/<name>``'s report.json if its samples are of ``spec`` as it is now: the same prompts, seeds, video
    size, model folder (its path inside the work folder: a copied work folder keeps its samples) and step count, and
    written after the model's newest file; else None."""
    folder = work / "eval" / spec.name
    report_file = folder / "report.json"
    if not report_file.is_file():
        return None
    report = json.loads(report_file.read_text())
    inside = Path(spec.model_dir).relative_to(work)
    cfg, cands = report.get("config", {}), report.get("candidates") or []
    cand = cands[0] if len(cands) == 1 else {}
    same = (report.get("prompts") == prompts and report.get("num_seeds") == sampling["seeds"]
            and all(cfg.get(k) == sampling[k] for k in ("num_frames", "height", "width"))
            and cand.get("name") == spec.name
            and Path(cand.get("model_dir", "/")).parts[-len(inside.parts):] == inside.parts
            and (spec.steps is None or cand.get("num_steps") == spec.steps))
    if not same:
        return None
    newest = max((f.stat().st_mtime for f in Path(spec.model_dir).rglob("*") if f.is_file()), default=float("inf"))
    return report if report_file.stat().st_mtime > newest else None


def sampled_meta(spec: CandidateSpec, report: dict[str, Any]) -> dict[str, Any]:
    """What :func:`sample_candidate` returned, read back from the candidate's report.json (``--rescore``)."""
    (cand,) = report["candidates"]
    return {"nfe": cand["nfe"], "latency_s": report["latency"][spec.name]["median_s"], "sampling_s": report["seconds"],
            "sampler": cand["sampler"], "num_steps": cand["num_steps"]}


# -- the run ------------------------------------------------------------------------------------
def latent_settings(work: Path) -> dict[str, Any]:
    manifest = json.loads((work / "base" / "artifacts" / "latents" / "data" / "preprocess.json").read_text())
    s = manifest["settings"]
    return {"num_frames": int(s["num_frames"]), "height": int(s["height"]), "width": int(s["width"]), "fps": float(s["fps"])}


def train(args: argparse.Namespace, scale: Scale, work: Path, deadline: float, settings: dict[str, Any]) -> dict[str, Path]:
    """The shared stages, then every student (``--train-jobs`` at a time); returns name → model folder."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)  # also when --reuse finds the shared stages done (a copied work folder)
    base = work / "base"
    trained: dict[str, Path] = {}
    timings = settings.setdefault("stage_seconds", {})
    timings_file = work / "stage_seconds.json"  # the training times, for a later --reuse call that evaluates
    if args.reuse and timings_file.is_file():
        timings.update({k: v for k, v in json.loads(timings_file.read_text()).items() if k not in timings})
    if not args.reuse or not (base / "artifacts" / "pretrain" / "model").is_dir():
        make_workspace(base, scale.params)
        for name in ("clips", "base", "latents", "teacher", "pretrain"):
            timings[name] = round(run_stage(base, name, args.device, logs), 1)
            print(f"[quality] stage {name}: {timings[name]} s", flush=True)
            timings_file.write_text(json.dumps(timings, indent=1) + "\n")
    chosen = getattr(args, "expanded", None) or [s for s in STUDENTS if s.name in args.students]  # (nft_quality: names only)
    pending = [s for s in chosen if not (args.reuse and (work / s.name / "artifacts" / s.stage / "model").is_dir())]
    for s in chosen:
        if s not in pending:
            trained[s.name] = work / s.name / "artifacts" / s.stage / "model"
    running: dict[str, tuple[subprocess.Popen, float, Student, Any]] = {}
    while pending or running:
        while pending and len(running) < args.train_jobs:
            student = pending.pop(0)
            if time.monotonic() > deadline - args.eval_reserve_s:
                settings["skipped"].append(f"train {student.name} (budget)")
                continue
            folder = make_workspace(work / student.name, {**scale.params, **student.params}, artifacts_from=base,
                                    own=("pretrain",) if student.own_pretrain else ())
            log = (logs / f"{student.name}-{student.stage}.log").open("w")
            proc = subprocess.Popen(stage_command(folder, student.stages, args.device), cwd=folder, env=_env(args.device),
                                    stdout=log, stderr=subprocess.STDOUT)
            running[student.name] = (proc, time.perf_counter(), student, log)
        for name, (proc, t0, student, log) in list(running.items()):
            if proc.poll() is None:
                if time.monotonic() > deadline - args.eval_reserve_s:  # the rest of the budget is the evaluation's
                    proc.terminate()
                    proc.wait()
                    log.close()
                    settings["skipped"].append(f"train {name} (stopped at the budget)")
                    del running[name]
                continue
            log.close()
            del running[name]
            if proc.returncode != 0:
                tail = (logs / f"{name}-{student.stage}.log").read_text()[-1500:]
                print(f"[quality] training {name} failed ({proc.returncode}):\n{tail}", flush=True)
                settings["skipped"].append(f"train {name} (failed: exit {proc.returncode})")
                continue
            timings[name] = round(time.perf_counter() - t0, 1)
            trained[name] = work / name / "artifacts" / student.stage / "model"
            print(f"[quality] trained {name}: {timings[name]} s", flush=True)
            timings_file.write_text(json.dumps(timings, indent=1) + "\n")
        time.sleep(0.5)
    return trained


def evaluate(args: argparse.Namespace, scale: Scale, work: Path, trained: dict[str, Path], deadline: float,
             settings: dict[str, Any], out: Path,
             specs: list[CandidateSpec] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Sample every candidate (``--eval-jobs`` processes), score each as it ends, rewrite the results. ``specs``: the
    candidates (``teacher_40`` first: the reference); default :func:`candidate_specs` of ``trained``."""
    import multiprocessing

    from distillery.data.encoders import BaseEncoders
    from distillery.evaluation.video_metrics import Standardiser

    prompts = PROMPTS_FILE.read_text().splitlines()[: scale.prompts]
    specs = candidate_specs(work, trained, args.expanded, args.teacher_steps) if specs is None else specs
    base_dir = str(work / "base" / "artifacts" / "base" / "model")
    sampling = {**latent_settings(work), "seeds": scale.seeds, "sample_batch": args.sample_batch}
    settings.update(prompts=prompts, num_prompts=len(prompts), num_seeds=scale.seeds, videos_per_candidate=len(prompts) * scale.seeds,
                    video=sampling, candidates_planned=[s.name for s in specs])
    device = "cuda" if args.device == "cuda" else "cpu"
    decoder = BaseEncoders(base_dir, device, text_encoder=False)
    ref: Sampled | None = None
    scaler = None
    floor: dict[str, Any] | None = None
    rows: dict[str, dict[str, Any]] = {}
    done: dict[str, tuple[CandidateSpec, dict[str, Any]]] = {}  # sampled, waiting for the reference
    order = {s.name: i for i, s in enumerate(specs)}
    info = settings.setdefault("candidate_sampling", {})

    def finish(spec: CandidateSpec, meta: dict[str, Any]) -> None:
        nonlocal ref, scaler, floor
        folder = work / "eval" / spec.name
        sampled = load_sampled(folder, decoder)
        if spec.name == "teacher_40":
            ref, scaler = sampled, Standardiser.fit(sampled.features)
            floor = floor_scores(ref, scaler, scale.seeds, scale.bootstrap) if scale.seeds >= 2 else None
        assert ref is not None and scaler is not None
        rows[spec.name] = {"name": spec.name, "method": spec.method, "nfe": meta["nfe"], "latency_s": meta["latency_s"],
                           **score(sampled, ref, scaler, scale.bootstrap)}
        info[spec.name] = {k: meta[k] for k in ("sampler", "num_steps", "sampling_s")}
        ordered = sorted(rows.values(), key=lambda r: order[r["name"]])
        write_results(out, settings, ordered, floor)
        r = rows[spec.name]
        print(f"[quality] {spec.name}: NFE {int(r['nfe'])}, KID {r['kid']:.4f} {r['kid_ci']}, Fréchet {r['frechet']:.3f} "
              f"{r['frechet_ci']}, adherence {r['adherence']:.3f} ({', '.join(f'{k} {v:.2f}' for k, v in r['adherence_parts'].items())}), "
              f"sharpness {r['sharpness'] * 1e3:.3f}e-3, "
              f"sampled in {meta['sampling_s']} s", flush=True)

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.eval_jobs, mp_context=ctx) as pool:
        futures: dict[Future, CandidateSpec] = {}
        queue = list(specs)

        def submit() -> None:
            while queue and len(futures) < args.eval_jobs:
                spec = queue.pop(0)
                if time.monotonic() > deadline and spec.name != "teacher_40":
                    settings["skipped"].append(f"evaluate {spec.name} (budget)")
                    continue
                shutil.rmtree(work / "eval" / spec.name, ignore_errors=True)
                futures[pool.submit(sample_candidate, spec, base_dir, prompts, sampling, str(work / "eval" / spec.name),
                                    args.device)] = spec

        if args.rescore:  # score what an earlier run sampled, sample nothing
            for spec in queue:
                report_file = work / "eval" / spec.name / "report.json"
                if report_file.is_file():
                    done[spec.name] = (spec, sampled_meta(spec, json.loads(report_file.read_text())))
                else:
                    settings["skipped"].append(f"evaluate {spec.name} (not sampled; --rescore)")
            queue.clear()
            for name in sorted(done, key=lambda n: (n != "teacher_40", order[n])):
                finish(*done.pop(name))
        if args.keep_sampled:  # score what is current, sample the rest
            kept = settings.setdefault("kept_sampled", [])
            for spec in list(queue):
                report = current_samples(spec, work, prompts, sampling)
                if report is not None:
                    queue.remove(spec)
                    done[spec.name] = (spec, sampled_meta(spec, report))
                    kept.append(spec.name)
            print(f"[quality] kept the samples of {len(kept)} candidates: {', '.join(kept) or 'none'}", flush=True)
            if "teacher_40" in done:
                for name in sorted(done, key=lambda n: (n != "teacher_40", order[n])):
                    finish(*done.pop(name))
        submit()
        while futures:
            finished, _ = wait(list(futures), return_when=FIRST_COMPLETED)
            for fut in finished:
                spec = futures.pop(fut)
                try:
                    meta = fut.result()
                except Exception as exc:  # one candidate failing does not lose the others
                    print(f"[quality] evaluating {spec.name} failed: {type(exc).__name__}: {exc}", flush=True)
                    settings["skipped"].append(f"evaluate {spec.name} (failed)")
                    if spec.name == "teacher_40":
                        raise SystemExit("error: the reference teacher_40 could not be sampled") from exc
                    continue
                done[spec.name] = (spec, meta)
            if "teacher_40" in done or ref is not None:
                for name in sorted(done, key=lambda n: (n != "teacher_40", order[n])):
                    finish(*done.pop(name))
            submit()
    ordered = sorted(rows.values(), key=lambda r: order[r["name"]])
    return ordered, floor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--scale", choices=sorted(SCALES), default=None, help="default: gpu on cuda, small on cpu")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="wall-clock budget (module doc)")
    parser.add_argument("--eval-reserve-s", type=float, default=None,
                        help="seconds kept for evaluation: no training starts after budget − this (default: 45%% of the budget)")
    parser.add_argument("--work", type=Path, default=ROOT / ".quality-work")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quality.json")
    parser.add_argument("--train-jobs", type=int, default=None, help="students trained at once (default: 6 on cuda, 1 on cpu)")
    parser.add_argument("--eval-jobs", type=int, default=None, help="candidates sampled at once (default: 4 on cuda, 1 on cpu)")
    parser.add_argument("--sample-batch", type=int, default=None,
                        help="videos a candidate samples at once (default: 32 on cuda, 1 on cpu); latency is then per video of a batch")
    parser.add_argument("--prompts", type=int, default=None, help="override the scale's prompt count (≤ 32)")
    parser.add_argument("--seeds", type=int, default=None, help="override the scale's seed count")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a params.yaml value for every workspace (YAML), e.g. --set pdd.dm_weight=0.5")
    parser.add_argument("--students", default=None,
                        help="the students to train and evaluate, comma-separated (default: DEFAULT_STUDENTS; --base a14b: "
                             "ON_A14B); the teacher's candidates always")
    parser.add_argument("--base", choices=("wan2.1", "a14b"), default="wan2.1", help="a14b: a tiny Wan 2.2 A14B (module doc)")
    parser.add_argument("--train-seeds", type=int, default=1,
                        help="train each student with this many seeds (params seed 0 … N − 1): <name>, <name>_seed1, …")
    parser.add_argument("--sparse", default=None, metavar="SPARSITY:F,H,W",
                        help="also train each student with block-sparse attention (<stage>.attention: sparse at this sparsity "
                             "and sparse_tile, e.g. 0.9:1,1,2): <name>_sparse…, sampled with it; the results add sparse_vs_dense")
    parser.add_argument("--teacher-steps", default=",".join(map(str, TEACHER_STEPS)),
                        help="the teacher's candidates (the first must be 40: the reference)")
    parser.add_argument("--reuse", action="store_true", help="keep the work folder's trained models; evaluate only what is missing")
    parser.add_argument("--keep-sampled", action="store_true",
                        help="with --reuse: sample only the candidates without current samples in the work folder (module doc)")
    parser.add_argument("--rescore", action="store_true",
                        help="with --reuse: score the work folder's sampled candidates again, sample nothing")
    parser.add_argument("--train-only", action="store_true",
                        help="train what is missing (within the budget) and stop before evaluating: a run split over several "
                             "device calls trains in one and evaluates with --reuse --keep-sampled in a later one")
    parser.add_argument("--stage-one", nargs=2, metavar=("FOLDER", "STAGE"), help=argparse.SUPPRESS)  # a worker: one stage
    args = parser.parse_args(argv)
    if args.stage_one:
        for stage in args.stage_one[1].split("+"):  # a student with its own pretrain: pretrain+distill
            run_one_stage(Path(args.stage_one[0]), stage, args.device or "cpu")
        return 0
    import torch
    import yaml

    args.reuse = args.reuse or args.rescore or args.keep_sampled
    takes = [s.name for s in STUDENTS if (s.name in ON_A14B if args.base == "a14b" else s.experts == 1)]
    args.students = [n for n in (args.students or ",".join(ON_A14B if args.base == "a14b" else DEFAULT_STUDENTS)).split(",")
                     if n]
    unknown = sorted(set(args.students) - set(takes))
    if unknown:
        print(f"error: --students: {', '.join(unknown)} not on --base {args.base}; valid: {', '.join(takes)}", file=sys.stderr)
        return 2
    args.teacher_steps = tuple(int(v) for v in args.teacher_steps.split(","))
    if args.teacher_steps[0] != 40 or args.train_seeds < 1:
        print("error: --teacher-steps must start with 40 (the reference); --train-seeds must be >= 1", file=sys.stderr)
        return 2
    sparse = None
    if args.sparse:
        try:
            sparsity, tile = args.sparse.split(":")
            sparse = {"sparsity": float(sparsity), "sparse_tile": [int(v) for v in tile.split(",")]}
        except ValueError:
            print(f"error: --sparse {args.sparse!r}: SPARSITY:F,H,W, e.g. 0.9:1,1,2", file=sys.stderr)
            return 2
    args.expanded = expand_students([s for s in STUDENTS if s.name in args.students], args.train_seeds, sparse)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    if args.device == "cpu":  # the sampling workers too (see _env)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.scale = args.scale or ("gpu" if args.device == "cuda" else "small")
    args.train_jobs = args.train_jobs or (6 if args.device == "cuda" else 1)
    args.eval_jobs = args.eval_jobs or (4 if args.device == "cuda" else 1)
    args.sample_batch = args.sample_batch or (32 if args.device == "cuda" else 1)
    if args.eval_reserve_s is None:
        args.eval_reserve_s = 0.45 * args.budget_s if args.budget_s != float("inf") else 0.0
    base_scale = SCALES[args.scale]
    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    if args.base == "a14b":  # the tiny two-expert folder, made once in the work folder
        from distillery.tinybase.wan22 import make_tiny_wan22

        folder = args.work.resolve() / "tiny-a14b"
        if not (folder / "model_index.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.parent.mkdir(parents=True, exist_ok=True)
            make_tiny_wan22(folder, "a14b")
        extra = {"pretrain.method": "ode_init_bidirectional", "base.path": str(folder), **extra}
    scale = Scale({**base_scale.params, **extra}, args.prompts or base_scale.prompts, args.seeds or base_scale.seeds,
                  base_scale.bootstrap)
    if not 1 <= scale.prompts <= len(PROMPTS_FILE.read_text().splitlines()):
        print(f"error: --prompts must be in 1..{len(PROMPTS_FILE.read_text().splitlines())}", file=sys.stderr)
        return 2
    started = time.monotonic()
    deadline = started + args.budget_s
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    settings: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else argv,
        "device": args.device, "gpu": gpu, "torch": torch.__version__, "scale": args.scale, "params": scale.params,
        "teacher_guidance_scale": GUIDANCE, "bootstrap_resamples": scale.bootstrap,
        "interval": ("95% bootstrap: percentiles (KID: both sets resampled; adherence, sharpness, paired: over videos); "
                     "Fréchet's shifted by its bootstrap bias"),
        "budget_s": args.budget_s if args.budget_s != float("inf") else None, "train_jobs": args.train_jobs,
        "eval_jobs": args.eval_jobs, "sample_batch": args.sample_batch, "students": [asdict(s) for s in args.expanded], "skipped": [],
        "train_seeds": args.train_seeds, "sparse": sparse,
        "reference": "teacher_40", "comparison": "students vs the teacher at the same step count; nfe counts CFG's 2 forwards",
    }
    if args.rescore and args.out.is_file():  # keep the training times of the run that trained these models
        old = json.loads(args.out.read_text())["settings"]
        settings["stage_seconds"] = old.get("stage_seconds", {})
        settings["rescored_from_run_of"] = old.get("date")
    trained = train(args, scale, work, deadline, settings)
    settings["train_s"] = round(time.monotonic() - started, 1)
    if args.train_only:
        print(f"[quality] trained {', '.join(sorted(trained)) or 'nothing'} in {settings['train_s']} s; "
              f"skipped: {settings['skipped'] or 'none'}; evaluation left for --reuse --keep-sampled", flush=True)
        return 0
    rows, floor = evaluate(args, scale, work, trained, deadline, settings, args.out)
    settings["total_s"] = round(time.monotonic() - started, 1)
    if sparse:
        settings["sparse_vs_dense"] = sparse_vs_dense(rows, sparse_twins(args.expanded))
        print(json.dumps(settings["sparse_vs_dense"], indent=1))
    write_results(args.out, settings, rows, floor)
    goals = check_goals({r["name"]: r for r in rows}, floor or {"kid": 0.0, "frechet": 0.0})
    (args.out.parent / f"{args.out.stem}_goals.json").write_text(json.dumps(goals, indent=2) + "\n")
    try:
        write_plot(rows, floor, args.out.parent / f"{args.out.stem}_nfe_vs_distance.png")
    except ImportError as exc:  # an image without matplotlib: the JSON has every number the plot shows
        print(f"[quality] no plot ({exc})", flush=True)
    print(summary_table(rows, floor))
    print("goals: " + ", ".join(f"{k}: {'met' if v and v.get('met') else 'NOT met' if v else 'n/a'}" for k, v in goals.items()))
    print(f"[quality] {len(rows)} candidates in {settings['total_s']} s (training {settings['train_s']} s); "
          f"skipped: {settings['skipped'] or 'none'}; results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
