"""The default pipeline on a tiny configuration: real git + DVC in a temp dir, local MLflow.

One module-scoped run of the whole DAG by the Prefect flow built from dvc.yaml (on Prefect's local
ephemeral API); then: a no-op `dvc repro`, lineage of an export copied elsewhere (verify passes,
then fails naming a flipped weight file), the export (the Self-Forcing student) loaded by diffusers
with the folder's own pipeline in a fresh process reproducing the validate stage's samples, and a
changed `pretrain.*` param rerunning only pretrain and what follows, from step 1. Kills and resumes are in tests/reliability (test_kill_anywhere.py,
test_stage_trust.py).

DVC's cache here links instead of copying (``cache.type hardlink,symlink``, what docs/gpus.md advises for
real-shape artifacts; the other DVC tests keep DVC's default copies): every artifact file is the cache's own
file, so a stage that wrote into a published artifact in place would corrupt the cache — the experiment's rerun
checks every cached object still hashes to its name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from workspace import env, make_workspace, set_params, sh

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
_env = env


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = make_workspace(tmp_path_factory.mktemp("pipeline") / "ws", {"teacher.save_every": 3, "pretrain.save_every": 3},
                          dvc_cache_type="hardlink,symlink")
    FLOW.update(_run_prefect_flow(repo, tmp_path_factory.mktemp("prefect-home")))
    return repo


FLOW: dict[str, object] = {}  # the Prefect flow run that built the DAG: results, artifacts
TRACE: dict[str, Path] = {}  # where every process of that run recorded the distillery modules it imported


def _run_prefect_flow(repo: Path, home: Path) -> dict[str, object]:
    """The whole DAG the way a scheduled run does it: the Prefect flow built from dvc.yaml, one task
    per stage running `dvc repro --single-item`, on Prefect's local ephemeral API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.settings import PREFECT_HOME, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    if str(ROOT) not in sys.path:  # flows/ is a top-level package of the checkout
        sys.path.insert(0, str(ROOT))
    from test_dvc_deps import recorder_env

    from flows.dag import build_pipeline_flow

    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH", "DISTILLERY_TRACE_IMPORTS")}
    os.environ["OMP_NUM_THREADS"] = _env()["OMP_NUM_THREADS"]  # the stages' CPU rounding equals later `dvc repro`s
    os.environ.update(recorder_env(home / "recorder", TRACE.setdefault("dir", home / "imports")))  # for test_dvc_deps' check
    try:
        with temporary_settings(updates={PREFECT_HOME: str(home)}), prefect_test_harness(server_startup_timeout=120):
            state = build_pipeline_flow(repo, retries=0, timeout_seconds=900)(return_state=True)
            assert state.is_completed(), state.message
            with get_client(sync_client=True) as client:
                arts = client.read_artifacts(artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"results": state.result(), "artifacts": {a.key: a.data for a in arts},
            "flow_run_id": str(state.state_details.flow_run_id)}


def test_whole_dag_runs_and_a_noop_repro_is_fast(repo, tmp_path):
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    stages = {"clips", "base", "latents", "prompts", "teacher", "pretrain", "distill", "pdd", "posttrain", "validate", "export"}
    assert set(lock["stages"]) == stages  # the Prefect flow ran every stage through DVC
    weights = repo / "artifacts" / "export" / "transformer" / "diffusion_pytorch_model.safetensors"
    assert weights.stat().st_nlink >= 2  # the workspace's file and DVC's cache object are one file (hardlink cache)
    assert {name: r["status"] for name, r in FLOW["results"].items()} == dict.fromkeys(stages, "ran")
    assert set(FLOW["results"]["validate"]["metrics"]) == {"teacher_6/all", *(f"{c}/{k}" for c in ("pretrain_4", "distill_4", "pdd_1")
                                                                              for k in ("all", "frechet"))}  # DVC's few columns
    assert "artifacts/validate/report/grid.gif" in FLOW["artifacts"]["validate-validation-grid"]
    assert {"teacher-metrics", "pretrain-metrics", "distill-metrics", "pdd-metrics", "validate-metrics",
            "export-metrics"} <= set(FLOW["artifacts"])
    report = repo / "artifacts" / "validate" / "report"
    assert (report / "grid.gif").is_file() and (report / "grid.mp4").is_file()
    headline = json.loads((repo / "artifacts" / "validate" / "metrics.json").read_text())  # what DVC shows: a few numbers
    scores = json.loads((report / "metrics.json").read_text())  # every metric
    assert headline == {k.replace("/frechet_distance", "/frechet"): scores[k] for k in (
        "teacher_6/all", "pretrain_4/all", "pretrain_4/frechet_distance", "distill_4/all", "distill_4/frechet_distance",
        "pdd_1/all", "pdd_1/frechet_distance")}
    assert scores["pretrain_4/nfe"] == 8  # Euler under the causal mask, CFG
    assert "5 chunks × 4 + 4 cache writes" in (report / "summary.md").read_text()  # the 24 NFE of the streaming student
    # which prompts validate used, and where from (the clip set has a validation/ split: held-out captions)
    assert "## Prompts (2, from the latent set's validation split" in (report / "summary.md").read_text()
    assert (report / "plots" / "adherence_vs_nfe.png").is_file()
    for stage in ("teacher", "pretrain", "distill", "pdd"):  # each loss curve as an image beside its data
        assert (repo / "artifacts" / stage / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stage
    # the Self-Forcing student streams chunk by chunk (chunk_size 1): 5 chunks × 4 steps + 4 cache writes, no CFG
    assert scores["teacher_6/nfe"] == 12 and scores["teacher_2/nfe"] == 4 and scores["distill_4/nfe"] == 5 * 4 + 4
    assert scores["teacher_6/frechet_distance"] == 0.0 and scores["distill_4/frechet_distance"] > 0.0
    assert scores["teacher_6/kid"] == 0.0 and "teacher_6/kid_floor" in scores and "distill_4/kid_resolved" in scores
    assert scores["pdd_1/nfe"] == 1 and scores["pdd_4/nfe"] == 4  # one fused-block forward per NFE, no CFG
    rows = json.loads((report / "report.json").read_text())["per_prompt"]
    for cand, per in rows.items():  # every headline number is the mean of the per-prompt rows written beside it
        assert len(per) == 2
        for key in ("colour", "shape", "direction", "all"):
            assert scores[f"{cand}/{key}"] == pytest.approx(sum(float(r[key]) for r in per) / len(per), abs=1e-6), (cand, key)
        assert scores[f"{cand}/distance_to_teacher"] == pytest.approx(sum(r["distance_to_teacher"] for r in per) / len(per), abs=1e-6)
    assert scores["pretrain_4/distance_to_teacher"] > 0.0  # a different model than the reference teacher_6
    for stage in lock["stages"]:
        assert (repo / "artifacts" / stage / "lineage.json").is_file(), stage
        shown = json.loads((repo / "metrics" / f"{stage}.json").read_text())  # the artifact's metrics + this run's durations
        held = json.loads((repo / "artifacts" / stage / "metrics.json").read_text())
        assert {k: shown[k] for k in held} == held and set(shown) - set(held) <= {"seconds"}, stage
    assert (repo / "runs" / "teacher" / "checkpoint-6").is_dir()
    out = sh(["dvc", "repro"], repo).stdout
    assert "Data and pipelines are up to date" in out  # its wall time is in BENCHMARKS.md, not asserted here
    table = sh(["dvc", "metrics", "show"], repo).stdout  # one table of every stage's few, shared columns
    assert max(map(len, table.splitlines())) <= 300, table  # issue 58 item 9: narrow enough to read
    shown = json.loads(sh(["dvc", "metrics", "show", "--json"], repo).stdout)
    teacher_metrics = next(d["data"]["metrics/teacher.json"]["data"] for d in shown.values() if "metrics/teacher.json" in d.get("data", {}))
    logged = [json.loads(line) for line in (repo / "runs" / "teacher" / "train_log.jsonl").read_text().splitlines()]
    assert teacher_metrics["loss_last10_mean"] == round(sum(r["total_loss"] for r in logged[-10:]) / len(logged[-10:]), 5)
    assert teacher_metrics["last_loss"] == round(logged[-1]["total_loss"], 5)  # what the stage printed at its end
    assert teacher_metrics["steps"] == 6
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("distillery").experiment_id])
    parents = [r for r in runs if r.data.tags.get("distillery.kind") == "pipeline"]
    assert len(parents) == 1 and parents[0].data.tags["distillery.pipeline_key"] == f"prefect-{FLOW['flow_run_id']}"
    children = {r.data.tags.get("mlflow.runName"): r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert set(children) >= {"clips", "base", "latents", "teacher", "pretrain", "distill", "pdd", "validate", "export"}
    # the parent records the params.yaml it ran with: as dotted params and as the file
    parent = parents[0].info.run_id
    assert parents[0].data.params["pretrain.learning_rate"] == "0.0002" and parents[0].data.params["validate.pdd_nfe"] == "[1, 4]"
    assert client.download_artifacts(parent, "params.yaml", str(tmp_path)) and \
        (tmp_path / "params.yaml").read_text() == (repo / "params.yaml").read_text()
    logged = {f.path for folder in ("grid", "plots") for f in client.list_artifacts(children["validate"].info.run_id, folder)}
    assert logged == {"grid/grid.gif", "grid/grid.mp4", "plots/adherence_vs_nfe.png"}  # validate's grid and plot images
    assert [f.path for f in client.list_artifacts(children["teacher"].info.run_id, "plots")] == ["plots/loss.png"]


def test_every_module_a_stage_imports_is_one_of_its_deps(repo):
    """dvc.yaml knows the code its stages run (the check and the recorder are in test_dvc_deps.py)."""
    from test_dvc_deps import check_stage_imports, imports_by_stage

    check_stage_imports(imports_by_stage(TRACE["dir"]), ROOT)


def _stale_after_editing(repo: Path, module: str) -> set[str]:
    """The stages `dvc status` calls changed after appending a comment to ``module`` (then restored)."""
    path = repo / module
    before = path.read_bytes()
    try:
        path.write_bytes(before + b"\n# an edit\n")
        out = sh(["dvc", "status", "--json"], repo).stdout
    finally:
        path.write_bytes(before)
    return {name for name, changes in json.loads(out or "{}").items() if "changed command" not in str(changes) and changes}


def test_a_stage_depends_only_on_the_code_it_runs(repo):
    """Editing a module only the export uses (its model card) makes only `export` stale; a module only
    training uses (the trainer loop) makes the training stages stale, not the data stages, validate or
    export; the CLI's lineage command, which no stage runs, makes nothing stale. Sequence parallelism's Wan code and the
    torchrun agent, which this one-process sp-1 DAG never imports, make the training stages stale all the same: a user
    at ``gpus.nproc_per_node: 2, gpus.sp_size: 2`` runs them in each (issue 62)."""
    assert sh(["dvc", "status", "--json"], repo).stdout.strip() in ("{}", "")
    assert _stale_after_editing(repo, "src/distillery/export/model_card.py") == {"export"}
    training = {"teacher", "pretrain", "distill", "pdd", "posttrain"}
    assert _stale_after_editing(repo, "src/distillery/engine/loop.py") == training
    assert _stale_after_editing(repo, "src/distillery/methods/pdd.py") == {"pdd"}
    assert _stale_after_editing(repo, "src/distillery/cli/lineage.py") == set()
    for unseen in ("models/wan/sequence_parallel.py", "cli/launch.py"):  # run at sp 2, at 2 processes
        assert _stale_after_editing(repo, f"src/distillery/{unseen}") == training, unseen


def test_lineage_of_a_copied_export_verifies_and_names_an_altered_file(repo, tmp_path):
    elsewhere = tmp_path / "elsewhere" / "export"
    shutil.copytree(repo / "artifacts" / "export", elsewhere)
    tree = sh(["distillery", "lineage", str(elsewhere)], tmp_path).stdout
    for stage in ("export", "distill", "pretrain", "teacher", "latents", "base", "clips", "validate", "pdd"):
        full = [ln for ln in tree.splitlines() if f"{stage} [" in ln and "(shown above)" not in ln]
        assert len(full) == 1, (stage, full)  # each artifact in full once; a repeated input is one line back
    assert "critic_init: teacher [checkpoint]  artifacts/teacher  (shown above)" in tree
    manifest = json.loads(sh(["distillery", "lineage", str(elsewhere), "--json"], tmp_path).stdout)
    assert manifest["stage"] == "export" and manifest["inputs"][0]["lineage"]["stage"] == "distill"
    assert "verified" in sh(["distillery", "lineage", str(elsewhere), "--verify"], tmp_path).stdout
    weights = elsewhere / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    bad = sh(["distillery", "lineage", str(elsewhere), "--verify"], tmp_path, check=False)
    assert bad.returncode == 2
    assert "changed: transformer/diffusion_pytorch_model.safetensors" in bad.stdout


def test_export_loads_in_a_fresh_process_and_reproduces_the_validate_samples(repo, tmp_path):
    """diffusers' DiffusionPipeline on the export folder alone, with the folder's own pipeline module
    (the causal Self-Forcing student streams chunk by chunk), and the validate stage's prompts and
    seeds, returns the latents the validate stage sampled for the distilled student (and decodes them)."""
    code = (
        "import json, sys, torch\n"
        "from diffusers import DiffusionPipeline\n"
        "from safetensors.torch import load_file\n"
        "export, report_dir, name = sys.argv[1:4]\n"
        "report = json.load(open(f'{report_dir}/report.json'))\n"
        "saved = load_file(f'{report_dir}/samples/{name}/latents.safetensors')\n"
        "pipe = DiffusionPipeline.from_pretrained(export, custom_pipeline=export, trust_remote_code=True)\n"
        "print('class', type(pipe).__name__)\n"
        "cfg = report['config']\n"
        "kw = dict(num_frames=cfg['num_frames'], height=cfg['height'], width=cfg['width'],\n"
        "          max_sequence_length=report['max_sequence_length'])\n"
        "for i, (prompt, seed) in enumerate(zip(report['prompts'], report['seeds'])):\n"
        "    out = pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type='latent', **kw).frames[0]\n"
        "    print('max_abs_diff', i, (out - saved[str(i)]).abs().max().item())\n"
    )
    card = (repo / "artifacts" / "export" / "README.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0]  # the card's code, run as pasted from the workspace root
    code += "print('card snippet')\n" + snippet
    readme = (ROOT / "docs" / "pipeline.md").read_text()  # the snippet of docs/pipeline.md too, as pasted
    block = next(b.split("```")[0] for b in readme.split("```python\n")[1:] if 'WanPipeline.from_pretrained("artifacts/base' in b)
    code += "print('readme snippet')\n" + block
    report = repo / "artifacts" / "validate" / "report"
    assert json.loads((repo / "artifacts" / "export" / "sampling.json").read_text())["sampler"] == "causal_streaming"
    out = subprocess.run([sys.executable, "-c", code, str(repo / "artifacts" / "export"), str(report), "distill_4"],
                         capture_output=True, text=True, timeout=300, env={**_env(), "HF_HUB_OFFLINE": "1"}, cwd=repo)
    assert out.returncode == 0, out.stderr[-2000:]
    diffs = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("max_abs_diff")]
    assert len(diffs) == 2 and max(diffs) <= 1e-5, out.stdout
    assert "class DistilledWanPipeline" in out.stdout
    card_out, readme_out = out.stdout.split("card snippet")[1].split("readme snippet")
    assert card_out.strip() == "(17, 32, 32, 3)"  # the card's snippet ran and decoded a video
    assert readme_out.strip().splitlines() == ["DistilledWanPipeline (17, 32, 32, 3)", "WanPipeline (17, 32, 32, 3)"]


def test_the_export_has_its_own_model_card(repo):
    """The card says what the export is, the chain that made it (each stage, from lineage), its sampling
    settings and its validation scores (the numbers of validate's metrics.json); its front matter keeps
    the prompt length, so the folder still reads as a base."""
    card = (repo / "artifacts" / "export" / "README.md").read_text()
    assert card.startswith("---\n") and "max_sequence_length: 32" in card.split("---")[1]
    assert "# The `distill` student, exported by distillery" in card and "Tiny Wan" not in card
    assert json.dumps(json.loads((repo / "artifacts" / "export" / "sampling.json").read_text()), indent=2) in card
    chain = card.split("## How it was made")[1].split("## Validation")[0]
    stages = [line.split("|")[1].strip() for line in chain.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert stages == ["distill", "pretrain", "teacher", "base", "latents", "clips"], stages  # each once, as lineage walks them
    scores = json.loads((repo / "artifacts" / "validate" / "report" / "metrics.json").read_text())
    row = next(line for line in card.splitlines() if line.startswith("| distill_4 |"))
    assert f"{scores['distill_4/all']:.2f} ± {scores['distill_4/all_std']:.2f}" in row
    assert any(line.startswith("| teacher_6 |") for line in card.splitlines())  # the reference beside it


def test_an_experiment_on_a_pretrain_param_reruns_only_pretrain_and_what_follows(repo):
    """`dvc exp run -S pretrain.learning_rate=1e-4` on the committed baseline: the rerun trains pretrain
    afresh from step 1 with the new value (never resumes the old run's checkpoints), distills again from
    it, and the export ships those new weights; `dvc exp show` then compares the two rows (params and
    the headline metrics of both); every long stage showed its progress in a few lines."""
    from helpers import role_state

    exported = repo / "artifacts" / "export" / "transformer" / "diffusion_pytorch_model.safetensors"
    old_weights = exported.read_bytes()
    old_final = role_state(repo / "runs" / "pretrain" / "checkpoint-6")
    sh(["git", "add", "-A"], repo)  # the baseline: dvc.lock and the metrics/ and plots/ copies (.gitignore keeps the rest out)
    committed = sh(["git", "diff", "--cached", "--name-only"], repo).stdout.split()
    assert "dvc.lock" in committed and "metrics/validate.json" in committed and not [p for p in committed if p.startswith(("runs/", "artifacts/", "mlruns/"))]
    sh(["git", "commit", "-qm", "baseline run"], repo)
    params_before = yaml.safe_load((repo / "params.yaml").read_text())
    proc = sh(["dvc", "exp", "run", "-S", "pretrain.learning_rate=1e-4"], repo)
    warnings = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("WARNING:")]
    assert not warnings, warnings  # DVC's own (e.g. "'src/distillery/cli/__init__.py' is empty."): none about this change
    params_before["pretrain"]["learning_rate"] = 1.0e-4
    assert yaml.safe_load((repo / "params.yaml").read_text()) == params_before
    ran = [line.split("'")[1] for line in proc.stdout.splitlines() if line.startswith("Running stage")]
    # posttrain (off: its record only) follows the distill student it would post-train
    assert ran[0] == "pretrain" and set(ran) == {"pretrain", "distill", "posttrain", "validate", "export"}, proc.stdout
    assert "not resuming runs/pretrain (changed: the run config): starting from step 0" in proc.stderr
    assert "resumed from" not in proc.stderr
    # progress on the console, not a flood: pretrain's 6 steps are 6 lines (the first, then each new 10 %), validate's too
    progress = [line.split(" INFO ", 1)[1] for line in proc.stderr.splitlines() if " INFO train " in line or " INFO validate " in line]
    train = [line.split(" (")[0] for line in progress if line.startswith("train ")]
    assert train == [f"train {i}/6" for i in range(1, 7)] + [f"train {i}/4" for i in range(1, 5)], progress  # pretrain, distill
    first, last = (next(line for line in progress if line.startswith(f"train {i}/6 ")) for i in (1, 6))
    assert first.startswith("train 1/6 (17%) loss ") and ", ETA " in first and "done in " in last
    # the teacher and the PDD student (teacher init) did not change: reused; pretrain and distill sampled, 2 × 2 prompts × 2 seeds
    assert "validate: reusing 4 of 6 candidates' samples from runs/validate/cache (teacher_6, teacher_2, pdd_1, pdd_4)" in proc.stderr
    videos = [line for line in progress if line.startswith("validate ") and "/8 (" in line]
    assert 2 <= len(videos) <= 9 and "candidate pretrain_4 (1/2)" in videos[0], progress
    rows = _exp_rows(json.loads(sh(["dvc", "exp", "show", "--json"], repo).stdout))
    assert len(rows) == 2, rows  # the baseline commit and the experiment, each with its params and headline metrics
    baseline, experiment = rows
    assert (baseline["params"]["pretrain"]["learning_rate"], experiment["params"]["pretrain"]["learning_rate"]) == (2.0e-4, 1.0e-4)
    for row in rows:
        assert {"loss_last10_mean", "last_loss", "steps"} <= set(row["metrics"]["metrics/pretrain.json"]), row
        assert set(row["metrics"]["metrics/validate.json"]) >= {"distill_4/all", "distill_4/frechet", "teacher_6/all"}
    assert baseline["metrics"]["metrics/pretrain.json"] != experiment["metrics"]["metrics/pretrain.json"]
    table = sh(["dvc", "exp", "show", "--no-pager", "--md", "--only-changed"], repo).stdout
    assert "pretrain.learning_rate" in table and "!" not in table.split("\n", 2)[2], table  # no missing metric in any row
    assert "distill_4/frechet" in table, table  # distill changed (its adherence share of 4 videos may come out the same)
    assert "teacher_6" not in table and "pdd_1" not in table, table  # reused: bitwise the same numbers, so not "changed"
    steps = [json.loads(line)["step"] for line in (repo / "runs" / "pretrain" / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    new_final = role_state(repo / "runs" / "pretrain" / "checkpoint-6")
    assert any(not torch_equal(old_final[k], new_final[k]) for k in new_final)
    assert exported.read_bytes() != old_weights
    lineage = json.loads((repo / "artifacts" / "export" / "lineage.json").read_text())
    student = lineage["inputs"][0]["lineage"]  # the distilled student, whose student init is the new pretrain
    pretrain = next(i["lineage"] for i in student["inputs"] if i["role"] == "student_init")
    assert student["stage"] == "distill" and pretrain["stage"] == "pretrain"
    assert pretrain["config"]["training"]["optimizer"]["learning_rate"] == 1.0e-4
    # the experiment is named, and the params.yaml that -S edited does not make the code dirty
    experiment = proc.stdout.split("Ran experiment(s): ")[1].split()[0]
    for node in (lineage, student, pretrain):
        assert node["code"]["dirty"] is False and node["code"]["experiment"]["name"] == experiment, node["code"]
    shipped = next(o["sha256"] for o in lineage["outputs"] if o["path"] == "transformer/diffusion_pytorch_model.safetensors")
    import hashlib

    assert shipped == hashlib.sha256(exported.read_bytes()).hexdigest()
    # the hardlink cache: the rerun stages published new files beside the cached ones, never wrote into them
    objects = [f for f in (repo / ".dvc" / "cache" / "files" / "md5").rglob("*") if f.is_file() and not f.name.endswith(".dir")]
    assert objects and all(hashlib.md5(f.read_bytes()).hexdigest() == f.parent.name + f.name for f in objects)
    old_md5 = hashlib.md5(old_weights).hexdigest()
    old = repo / ".dvc" / "cache" / "files" / "md5" / old_md5[:2] / old_md5[2:]
    assert old.read_bytes() == old_weights and exported.stat().st_nlink >= 2  # the baseline's export kept; the new one linked
    assert "up to date" in sh(["dvc", "status"], repo).stdout


def _exp_rows(shown: list[dict]) -> list[dict]:
    """``dvc exp show --json`` → the committed baseline's and each experiment's ``{"rev", "params", "metrics"}``
    (params.yaml's data; each metrics file's data), the workspace row left out."""
    rows = []

    def add(entry: dict) -> None:
        data = entry.get("data") or {}
        rows.append({"rev": entry.get("rev"), "params": data["params"]["params.yaml"]["data"],
                     "metrics": {path: m.get("data", {}) for path, m in (data.get("metrics") or {}).items()}})

    for entry in shown:
        if entry.get("rev") == "workspace":
            continue
        add(entry)
        for exp in entry.get("experiments") or []:
            for rev in exp.get("revs") or []:
                add(rev)
    return rows


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_a_pdd_export_samples_its_nfe_curve_and_runs_in_stock_wan_pipeline_at_one_step(repo):
    """``export.student: pdd`` reruns only export. In a fresh process, the folder's own pipeline returns
    the latents validate sampled for the PDD student at 4 NFE (fused blocks from the head bank), and
    stock ``WanPipeline`` with its shift's Euler scheduler, 1 step and no CFG, returns validate's 1-NFE
    latents from the folder's plain (fused) transformer."""
    set_params(repo, {"export.student": "pdd"})
    proc = sh(["dvc", "repro"], repo)
    ran = [line.split("'")[1] for line in proc.stdout.splitlines() if line.startswith("Running stage")]
    assert ran == ["export"], proc.stdout
    export = repo / "artifacts" / "export"
    contract = json.loads((export / "sampling.json").read_text())
    assert contract["sampler"] == "pdd_fused" and contract["num_steps"] == 4
    assert (export / "transformer" / "pdd_heads.safetensors").is_file()
    assert json.loads((export / "metrics.json").read_text())["stock_nfe"] == 1
    card = (export / "README.md").read_text()
    assert "# The `pdd` student" in card and "num_inference_steps=1, guidance_scale=1.0" in card
    assert all(f"| pdd_{n} |" in card for n in (1, 4))  # its NFE curve
    code = (
        "import json, sys, torch\n"
        "from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, WanPipeline\n"
        "from safetensors.torch import load_file\n"
        "export, report_dir = sys.argv[1:3]\n"
        "report = json.load(open(f'{report_dir}/report.json'))\n"
        "cfg = report['config']\n"
        "kw = dict(num_frames=cfg['num_frames'], height=cfg['height'], width=cfg['width'],\n"
        "          max_sequence_length=report['max_sequence_length'], output_type='latent')\n"
        "pipe = DiffusionPipeline.from_pretrained(export, custom_pipeline=export, trust_remote_code=True)\n"
        "saved = load_file(f'{report_dir}/samples/pdd_4/latents.safetensors')\n"
        "for i, (prompt, seed) in enumerate(zip(report['prompts'], report['seeds'])):\n"
        "    out = pipe(prompt, generator=torch.Generator().manual_seed(seed), **kw).frames[0]\n"
        "    print('custom', i, (out - saved[str(i)]).abs().max().item())\n"
        "# its model_index.json names its own pipeline: a stock one over freshly loaded parts, as its card does\n"
        "stock = WanPipeline(**DiffusionPipeline.from_pretrained(export, custom_pipeline=export, trust_remote_code=True).components)\n"
        "stock.scheduler = FlowMatchEulerDiscreteScheduler(shift=json.load(open(f'{export}/sampling.json'))['shift'])\n"
        "saved = load_file(f'{report_dir}/samples/pdd_1/latents.safetensors')\n"
        "for i, (prompt, seed) in enumerate(zip(report['prompts'], report['seeds'])):\n"
        "    out = stock(prompt, num_inference_steps=1, guidance_scale=1.0, generator=torch.Generator().manual_seed(seed),\n"
        "                **kw).frames[0]\n"
        "    print('stock', i, (out - saved[str(i)]).abs().max().item())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(export), str(repo / "artifacts" / "validate" / "report")],
                         capture_output=True, text=True, timeout=300, env={**_env(), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    for kind in ("custom", "stock"):
        diffs = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith(kind)]
        assert len(diffs) == 2 and max(diffs) <= 1e-5, out.stdout


def test_vbench_on_reruns_validate_scoring_its_cached_videos(repo, tmp_path):
    """Issue 65 item 3: ``validate.vbench`` turned on reruns validate (and the export after it) and nothing before;
    every candidate's videos are reused from the sample cache, the headline candidates' scored on the chosen VBench
    dimensions (tiny models of the real classes; the two optical-flow dimensions need larger videos than the tiny
    DAG's): their numbers in DVC's metrics, the report, the export's card, and each model's folder in the lineage. A
    validate rerun that leaves their videos as they were (a teacher step count fewer) scores none of them again."""
    from test_vbench import write_model_folders

    dims = ["subject_consistency", "background_consistency", "temporal_flickering", "aesthetic_quality", "overall_consistency"]
    models = write_model_folders(tmp_path / "models", ("dino", "clip_b32", "clip_l14", "aesthetic", "viclip"))
    set_params(repo, {"validate.vbench.dimensions": dims, "validate.vbench.models": models})
    proc = sh(["dvc", "repro"], repo)
    ran = [line.split("'")[1] for line in proc.stdout.splitlines() if line.startswith("Running stage")]
    assert ran == ["validate", "export"], proc.stdout
    assert "validate: reusing 6 of 6 candidates' samples" in proc.stderr
    headline = json.loads((repo / "metrics" / "validate.json").read_text())
    names = ("teacher_6", "pretrain_4", "distill_4", "pdd_1")  # the reference teacher and each student's first
    assert {f"{n}/vbench_{d}" for n in names for d in dims} <= set(headline)
    assert not any(k.startswith(("teacher_2/vbench", "pdd_4/vbench")) for k in headline)  # the curves' other points: not scored
    report = repo / "artifacts" / "validate" / "report"
    results = json.loads((report / "vbench" / "vbench.json").read_text())["candidates"]
    assert [r["candidate"] for r in results] == list(names) and all(r["protocol"]["name"] == "custom" for r in results)
    scores = json.loads((report / "metrics.json").read_text())  # every metric: the VBench numbers DVC shows too
    assert {k: v for k, v in scores.items() if "/vbench_" in k} == {k: v for k, v in headline.items() if "/vbench_" in k}
    lineage = json.loads((repo / "artifacts" / "validate" / "lineage.json").read_text())
    roles = {i["role"] for i in lineage["inputs"]}
    assert {f"vbench_{k}" for k in models} <= roles
    card = (repo / "artifacts" / "export" / "README.md").read_text()
    assert "## VBench dimensions (validate.vbench, ×100)" in card and "| teacher_6 |" in card.split("## VBench")[1]
    assert "VBench scores of 0 of 4 candidates reused" in proc.stderr
    # a validate-only change that leaves the headline candidates' videos as they were: nothing scored again
    set_params(repo, {"validate.teacher_steps": [6]})
    proc = sh(["dvc", "repro"], repo)
    assert "validate: reusing 5 of 5 candidates' samples" in proc.stderr
    assert "VBench scores of 4 of 4 candidates reused" in proc.stderr and "videos scored" not in proc.stderr, proc.stderr
    again = json.loads((repo / "metrics" / "validate.json").read_text())
    assert {k: v for k, v in again.items() if "/vbench_" in k} == {k: v for k, v in headline.items() if "/vbench_" in k}
    assert "up to date" in sh(["dvc", "status"], repo).stdout
