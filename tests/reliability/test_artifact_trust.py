"""Cases 9.1, 9.5, 9.11, 9.12 and 9.13 (issue 22, "Trust, second pass"): what an artifact may carry
into the pipeline and the export, and what the stages trust about the artifacts they read.

The workspaces are the session's ``prepared`` (clips → base → latents) and ``trained`` (+ teacher)
of conftest.py, each test on its own copy. The export stage needs a validate artifact, which
``trained`` lacks: ``exportable`` adds one written by hand (its report files and a sealed lineage
over the real teacher, base and latents; nothing is sampled), and exports the teacher
(``export.student: teacher``), so one ``distillery stage export`` runs the real export code over
real upstream artifacts in seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from workspace import copy_workspace, error_lines, set_params, sh, stage, tree_sha

from distillery.cli.guard import run_guarded
from distillery.cli.main import build_parser
from distillery.export.code import CODE_RECORD_KEY, write_export_code
from distillery.lineage.artifact_code import EXPORT_OWN_CODE
from distillery.lineage.contract import DIGEST_KEY
from distillery.lineage.hashing import hash_tree
from distillery.lineage.manifest import Input, manifest_digest, write_lineage
from distillery.lineage.verify import verify_chain
from distillery.tinybase.shipped import shipped_tiny_base

slow = pytest.mark.slow  # the tests that work on a copy of a DAG workspace
TEACHER_WEIGHTS = Path("artifacts/teacher/model/transformer/diffusion_pytorch_model.safetensors")
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".so")
# the load command of the export's own model card (README.md), run as a user pastes it from the workspace root
LOAD = ("from diffusers import DiffusionPipeline\n"
        "folder = 'artifacts/export'\n"
        "pipe = DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, trust_remote_code=True)\n"
        "print(type(pipe).__name__, type(pipe.scheduler).__name__)\n")


def _cli(*args: str) -> int:
    """``distillery ARGS`` in-process through the real parser and its error guard."""
    ns = build_parser().parse_args([str(a) for a in args])
    return run_guarded(lambda: ns.func(ns))


def _code_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.suffix in CODE_SUFFIXES)


def _evil_base(where: Path, marker: Path) -> Path:
    """The shipped tiny Wan whose model_index.json names ``["evil_sched", "EvilScheduler"]`` for its
    scheduler, with ``scheduler/evil_sched.py`` beside it: importing it writes ``marker``."""
    base = where / "evil-wan"
    shutil.copytree(shipped_tiny_base(), base)
    index = json.loads((base / "model_index.json").read_text())
    index["scheduler"] = ["evil_sched", "EvilScheduler"]
    (base / "model_index.json").write_text(json.dumps(index, indent=2))
    (base / "scheduler" / "evil_sched.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('foreign code ran')\n"
        "from diffusers import FlowMatchEulerDiscreteScheduler\n\n\n"
        "class EvilScheduler(FlowMatchEulerDiscreteScheduler):\n"
        "    pass\n")
    return base


def _write_validate_artifact(repo: Path) -> None:
    """``artifacts/validate`` as the validate stage lays it out (the files the export reads), sealed
    over the real teacher, base and latents; run with the current directory at ``repo``."""
    folder = Path("artifacts/validate")
    report = folder / "report"
    report.mkdir(parents=True)
    metrics = {"teacher_6/all": 0.5, "teacher_6/all_std": 0.0, "teacher_6/nfe": 12.0, "teacher_2/all": 0.25,
               "teacher_2/nfe": 4.0}
    (report / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (report / "report.json").write_text(json.dumps({
        "config": {"num_frames": 17, "height": 32, "width": 32, "fps": 8.0}, "reference": "teacher_6",
        "prompts": ["a red circle moving left on a black background"], "seeds": [0], "num_seeds": 1,
        "max_sequence_length": 32}, indent=2))
    (folder / "metrics.json").write_text(json.dumps({"teacher_6/all": 0.5}, indent=2))
    write_lineage(folder, kind="validation", stage="validate", params={"validate": {"num_prompts": 1}},
                  inputs=[Input("teacher", Path("artifacts/teacher")), Input("base", Path("artifacts/base")),
                          Input("data", Path("artifacts/latents"))], artifact_name="artifacts/validate")


@pytest.fixture(scope="module")
def exportable(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``trained`` + a validate artifact, exporting the teacher: ready for ``distillery stage export``
    (read-only: copy it)."""
    repo = copy_workspace(trained, tmp_path_factory.mktemp("exportable") / "ws")
    here = Path.cwd()
    os.chdir(repo)
    try:
        _write_validate_artifact(repo)
    finally:
        os.chdir(here)
    set_params(repo, {"export.student": "teacher"})
    return repo


# -- 9.1 foreign code ----------------------------------------------------------------------------------------


@slow
@pytest.mark.reliability(case="9.1", title="a base naming foreign code is refused; a base's .py never copied",
                         injected="base.path = the tiny Wan with model_index.json scheduler ['evil_sched', "
                                  "'EvilScheduler'] and scheduler/evil_sched.py; then a base with a clean index and "
                                  "stray .py/.pyc/.so files; `distillery stage base` each",
                         expect="the first: exit 2, one line naming the scheduler entry, artifacts/base as it was; the "
                                "second: exit 0 and no code file in artifacts/base")
def test_base_naming_foreign_code_is_refused(ws, tmp_path, data_lost):
    marker = tmp_path / "ran.txt"
    before = tree_sha(ws / "artifacts" / "base")
    set_params(ws, {"base.path": str(_evil_base(tmp_path, marker))})
    out = stage(ws, "base")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and "scheduler" in lines[0] and "evil_sched" in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    data_lost.record(0 if tree_sha(ws / "artifacts" / "base") == before else 1, "previous base artifacts changed")

    stray = tmp_path / "stray-wan"
    shutil.copytree(shipped_tiny_base(), stray)
    (stray / "scheduler" / "helper.py").write_text("raise SystemExit('never imported')\n")
    (stray / "text_encoder" / "__pycache__").mkdir()
    (stray / "text_encoder" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\x00" * 16)
    (stray / "vae" / "native.so").write_bytes(b"\x7fELF")
    set_params(ws, {"base.path": str(stray)})
    out = stage(ws, "base")
    assert out.returncode == 0, out.stderr[-2000:]
    shipped = _code_files(ws / "artifacts" / "base")
    data_lost.record(len(shipped), "code files copied into artifacts/base")
    assert data_lost.total == 0, shipped
    assert not marker.exists()


@slow
@pytest.mark.reliability(case="9.1", title="the export never ships or runs a base's code",
                         injected="artifacts/base replaced by the evil base as the unchecked base stage copied it "
                                  "(model_index.json naming evil_sched.EvilScheduler, scheduler/evil_sched.py, "
                                  "sealed lineage); `distillery stage export`; then the model card's load command",
                         expect="exit 2, one line naming the scheduler entry; no export published; the load runs no "
                                "foreign code")
def test_export_never_ships_a_base_s_code(exportable, tmp_path, monkeypatch, data_lost):
    ws = copy_workspace(exportable, tmp_path / "ws")
    marker = tmp_path / "ran.txt"
    evil = _evil_base(tmp_path, marker)
    shutil.rmtree(ws / "artifacts" / "base")
    shutil.copytree(evil, ws / "artifacts" / "base" / "model")  # what the base stage did before it checked
    monkeypatch.chdir(ws)
    write_lineage(Path("artifacts/base"), kind="model", stage="base", params={"base": {"path": str(evil)}},
                  inputs=[Input("source", evil)], artifact_name="artifacts/base")
    monkeypatch.chdir(tmp_path)
    out = stage(ws, "export")
    export = ws / "artifacts" / "export"
    if export.is_dir():  # the model card's own load command, in a fresh process
        sh([sys.executable, "-c", LOAD], ws, check=False)
    data_lost.record(1 if marker.exists() else 0, "foreign code runs on load")
    data_lost.record(len([f for f in _code_files(export) if f not in EXPORT_OWN_CODE]) if export.is_dir() else 0,
                     "foreign code files shipped in the export")
    assert data_lost.total == 0, out.stderr[-2000:]
    assert out.returncode == 2 and not export.exists(), out.stderr[-2000:]
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and "scheduler" in lines[0] and "evil_sched" in lines[0], out.stderr[-2000:]


def _hand_made_export(root: Path, *, evil: bool) -> Path:
    export = Path("artifacts/export")
    (root / export / "transformer").mkdir(parents=True)
    (root / export / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(bytes(range(256)) * 4)
    index = {"_class_name": "WanPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "transformer": ["diffusers", "WanTransformer3DModel"]}
    code = write_export_code(root / export)  # the export's own modules, as the export stage writes them
    if evil:
        index["scheduler"] = ["evil_sched", "EvilScheduler"]
        (root / export / "scheduler").mkdir()
        (root / export / "scheduler" / "evil_sched.py").write_text("import os\n")
    (root / export / "model_index.json").write_text(json.dumps(index))
    write_lineage(export, kind="export", stage="export", params={"export": {"student": "teacher"}},
                  config={CODE_RECORD_KEY: code})
    return export


@pytest.mark.reliability(case="9.1", title="lineage --verify of an export refuses foreign code",
                         injected="an export folder holding scheduler/evil_sched.py and a model_index.json naming it, "
                                  "both recorded in its sealed lineage.json",
                         expect="`distillery lineage --verify` exits 2 naming the code file and the index entry; the "
                                "same export without them (its own pipeline.py only) verifies")
def test_lineage_verify_refuses_code_in_an_export(tmp_path, monkeypatch, capsys, data_lost):
    monkeypatch.chdir(tmp_path)
    export = _hand_made_export(tmp_path, evil=True)
    capsys.readouterr()
    rc = _cli("lineage", export, "--verify")
    lines = capsys.readouterr().out.splitlines()
    data_lost.record(0 if rc == 2 else 1, "exports with foreign code reported as verified")
    assert data_lost.total == 0, lines
    assert any(ln.startswith("refused: scheduler/evil_sched.py (a code file") for ln in lines), lines
    assert any(ln.startswith("refused: model_index.json: scheduler") and "evil_sched" in ln for ln in lines), lines
    shutil.rmtree(tmp_path / "artifacts")
    export = _hand_made_export(tmp_path, evil=False)
    rc = _cli("lineage", export, "--verify")
    assert rc == 0, capsys.readouterr().out


@pytest.mark.reliability(case="9.1", title="an export carries exactly the code the export stage wrote",
                         injected="an export whose lineage.json (re-sealed) records its modules, then: one of them "
                                  "rewritten (the record and outputs rewritten to match, but not config.shipped_code); "
                                  "a module missing from the record; an extra top-level distilled_extra.py recorded "
                                  "everywhere; a recorded module in a subfolder",
                         expect="`distillery lineage --verify` exits 2 each time, naming the file; the export as written "
                                "verifies")
def test_lineage_verify_allows_only_the_export_s_own_recorded_code(tmp_path, monkeypatch, capsys, data_lost):
    from distillery.lineage.hashing import hash_tree
    from distillery.lineage.manifest import seal

    monkeypatch.chdir(tmp_path)
    export = _hand_made_export(tmp_path, evil=False)
    genuine = json.loads((export / "lineage.json").read_text())
    assert _cli("lineage", export, "--verify") == 0

    def variant(change) -> list[str]:
        shutil.rmtree(tmp_path / "artifacts")
        _hand_made_export(tmp_path, evil=False)
        manifest = json.loads(json.dumps(genuine))
        change(manifest)
        manifest["outputs"] = [e for e in hash_tree(export) if e["path"] != "lineage.json"]
        (export / "lineage.json").write_text(json.dumps(seal(manifest), indent=2))
        capsys.readouterr()
        rc = _cli("lineage", export, "--verify")
        data_lost.record(0 if rc == 2 else 1, "exports with code the export stage did not write reported as verified")
        return capsys.readouterr().out.splitlines()

    def rewritten(m):
        (export / "distilled_wan.py").write_text("import os\nos.system('true')\n")
    lines = variant(rewritten)
    assert any(ln.startswith("refused: distilled_wan.py (code of another digest") for ln in lines), lines

    def unrecorded(m):
        del m["config"]["shipped_code"]["distilled_causal.py"]
    lines = variant(unrecorded)
    assert any(ln.startswith("refused: distilled_causal.py (code the export's lineage.json does not record") for ln in lines)

    def extra(m):
        (export / "distilled_extra.py").write_text("import os\n")
        m["config"]["shipped_code"]["distilled_extra.py"] = hashlib.sha256(b"import os\n").hexdigest()
    lines = variant(extra)
    assert any(ln.startswith("refused: distilled_extra.py (a code file") for ln in lines), lines

    def nested(m):
        (export / "vae" / "pipeline.py").parent.mkdir(exist_ok=True)
        (export / "vae" / "pipeline.py").write_bytes((export / "pipeline.py").read_bytes())
        m["config"]["shipped_code"]["vae/pipeline.py"] = m["config"]["shipped_code"]["pipeline.py"]
    lines = variant(nested)
    assert any(ln.startswith("refused: vae/pipeline.py (a code file") for ln in lines), lines
    assert data_lost.total == 0


# -- 9.5 a tampered upstream ----------------------------------------------------------------------------------


@slow
@pytest.mark.reliability(case="9.5", title="a tampered upstream artifact does not ship",
                         injected="export once; flip a byte of artifacts/teacher's weights and put its size and mtime "
                                  "back (DVC and the hash cache trust both); `distillery stage export` again",
                         expect="exit 2, one line naming artifacts/teacher and the changed file; the previous export "
                                "as it was; the export's log states what verifying the chain read (MiB, s)")
def test_export_refuses_a_tampered_upstream(exportable, tmp_path, data_lost):
    ws = copy_workspace(exportable, tmp_path / "ws")
    first = stage(ws, "export")
    assert first.returncode == 0, first.stderr[-3000:]
    genuine = tree_sha(ws / "artifacts" / "export")
    weights = ws / TEACHER_WEIGHTS
    st = weights.stat()
    with open(weights, "r+b") as fh:
        fh.seek(st.st_size // 2)
        byte = fh.read(1)
        fh.seek(st.st_size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    second = stage(ws, "export")
    shipped = (ws / "artifacts" / "export" / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    data_lost.record(1 if shipped == weights.read_bytes() else 0, "exports shipping the tampered weights")
    data_lost.record(0 if tree_sha(ws / "artifacts" / "export") == genuine else 1, "previous good exports changed")
    assert data_lost.total == 0, second.stderr[-3000:]
    lines = error_lines(second.stderr)
    assert second.returncode == 2 and len(lines) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert "artifacts/teacher" in lines[0] and "model/transformer/diffusion_pytorch_model.safetensors" in lines[0], lines
    cost = [ln for ln in first.stderr.splitlines() if "export: verified the chain it ships" in ln]
    assert len(cost) == 1 and " MiB read in " in cost[0] and cost[0].rstrip().endswith(" s"), first.stderr[-3000:]


# -- 9.11 plain mistakes -------------------------------------------------------------------------------------


def _one_line_error(rc: int, err: str) -> bool:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return rc == 2 and len(lines) == 1 and lines[0].startswith("error: ")


def _lineage_variants(root: Path) -> dict[str, Path]:
    """Artifact folders whose lineage.json is malformed or deep, each in its own way."""
    good = root / "good"
    good.mkdir(parents=True)
    (good / "weights.bin").write_bytes(b"\x01" * 64)
    manifest = write_lineage(good, kind="export", stage="export")

    def variant(name: str, change) -> None:
        folder = root / name
        shutil.copytree(good, folder)
        m = json.loads(json.dumps(manifest))
        text = change(m)
        (folder / "lineage.json").write_text(text if isinstance(text, str) else json.dumps(m))

    nested = {"outputs": 5, "inputs": [], "stage": "x", "kind": "y", "artifact": "z"}
    changes = {
        "outputs_5": lambda m: m.update(outputs=5),
        "outputs_item_5": lambda m: m.update(outputs=[5]),
        "outputs_bytes_text": lambda m: m["outputs"][0].update(bytes="many"),
        "inputs_5": lambda m: m.update(inputs=5),
        "inputs_item_5": lambda m: m.update(inputs=[5]),
        "input_lineage_outputs_5": lambda m: m.update(inputs=[{"role": "r", "path": "p", "sha256": "0", "lineage": nested}]),
        "input_files_5": lambda m: m.update(inputs=[{"role": "r", "path": "p", "sha256": "0", "lineage": None, "files": 5}]),
        "code_text": lambda m: m.update(code="abc"),
        "mlflow_5": lambda m: m.update(mlflow=5),
        "params_deep_5000": lambda m: json.dumps(m)[:-1] + ', "params": ' + "[" * 5000 + "]" * 5000 + "}",
        "inputs_deep_1200": lambda m: json.dumps({**m, "inputs": "@"}).replace(
            '"@"', '[{"lineage": {"inputs": ' * 400 + "[]" + "}}]" * 400),
        "json_deep_100000": lambda m: "[" * 100_000 + "]" * 100_000,
    }
    for name, change in changes.items():
        variant(name, change)
    return {name: root / name for name in changes}


@slow
@pytest.mark.reliability(case="9.11", title="plain mistakes are one line, not a traceback",
                         injected="`export-weights --out` an existing file (and a path under it); `distillery lineage` "
                                  "(tree, --json, --verify, --verify --recursive) on 12 malformed or deep lineage.json "
                                  "files (\"outputs\": 5, a 5,000-deep params, ...); `--verify --dvc-lock` a 5,000-deep YAML",
                         expect="each exits 2 with one `error:` line (or, for --verify, its problem list), no traceback")
def test_plain_mistakes_are_one_line(trained, tmp_path, monkeypatch, capsys, data_lost):
    monkeypatch.chdir(tmp_path)
    crashed: list[str] = []

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            rc = _cli(*args)
        except Exception as exc:  # noqa: BLE001 - a traceback is what this case counts
            crashed.append(f"{' '.join(map(str, args))}: {type(exc).__name__}")
            return -1, "", ""
        out, err = capsys.readouterr()
        return rc, out, err

    checkpoint = trained / "runs" / "teacher" / "checkpoint-6"
    a_file = tmp_path / "weights.txt"
    a_file.write_text("not a folder")
    for out_arg in (a_file, a_file / "sub"):
        rc, _, err = run("export-weights", checkpoint, "--role", "student", "--out", out_arg)
        if rc != -1 and not _one_line_error(rc, err):
            crashed.append(f"export-weights --out {out_arg}: rc {rc}, {err!r}")
    assert a_file.read_text() == "not a folder"

    for name, folder in _lineage_variants(tmp_path / "lineage").items():
        for mode in ([], ["--json"], ["--verify"], ["--verify", "--recursive"]):
            rc, out, err = run("lineage", folder, *mode)
            if rc == -1:
                continue
            problems_listed = (mode[:1] == ["--verify"] and rc == 2 and not err.strip()
                               and out.splitlines()[-1:] and out.splitlines()[-1].startswith("lineage check failed"))
            printed = mode == ["--json"] and rc == 0 and not err.strip()
            if not (_one_line_error(rc, err) or problems_listed or printed):
                crashed.append(f"lineage {name} {' '.join(mode)}: rc {rc}, {err[-200:]!r}")

    lock = tmp_path / "dvc.lock"
    lock.write_text("schema: '2.0'\nstages:\n  export:\n    outs: " + "[" * 5000 + "]" * 5000 + "\n")
    rc, _, err = run("lineage", tmp_path / "lineage" / "good", "--verify", "--dvc-lock", lock)
    if rc != -1 and not _one_line_error(rc, err):
        crashed.append(f"lineage --dvc-lock deep: rc {rc}, {err[-200:]!r}")
    data_lost.record(len(crashed), "plain mistakes that ended in a traceback or not in one line")
    assert data_lost.total == 0, "\n".join(crashed)
    rc, _, err = run("lineage", tmp_path / "lineage" / "outputs_5")
    assert _one_line_error(rc, err) and "outputs" in err, err  # the tree view names what is malformed


# -- 9.12 a failed stage keeps its metrics and plots -----------------------------------------------------------


@slow
@pytest.mark.reliability(case="9.12", title="a failed stage keeps the last good metrics and plots",
                         injected="commit dvc.lock, metrics/ and plots/ of a finished teacher; "
                                  "a bad teacher.steps and `dvc repro teacher`; then clips.num_train: 10000000000000 and `dvc repro clips`",
                         expect="both fail (exit 2 in the stage); `git status` shows metrics/ and plots/ unchanged "
                                "(no `D metrics/clips.json`), their bytes as committed")
def test_failed_stage_keeps_metrics_and_plots(trained, tmp_path, data_lost):
    ws = copy_workspace(trained, tmp_path / "ws")
    sh(["git", "add", "dvc.lock", "metrics", "plots"], ws)
    sh(["git", "commit", "-qm", "baseline run"], ws)
    tracked = ["metrics/clips.json", "metrics/teacher.json", "plots/teacher_loss.json"]
    before = {p: (ws / p).read_bytes() for p in tracked}
    good = yaml.safe_load((ws / "params.yaml").read_text())
    set_params(ws, {"teacher.steps": -5})  # first: a failed clips stage would make DVC rerun clips before teacher
    teacher = sh(["dvc", "repro", "teacher"], ws, check=False)
    set_params(ws, {"teacher.steps": good["teacher"]["steps"], "clips.num_train": 10_000_000_000_000})
    clips = sh(["dvc", "repro", "clips"], ws, check=False)
    assert clips.returncode != 0 and teacher.returncode != 0, (clips.stdout, teacher.stdout)
    assert "exited with 2" in clips.stderr + clips.stdout and "exited with 2" in teacher.stderr + teacher.stdout
    status = sh(["git", "status", "--porcelain", "--", "metrics", "plots"], ws).stdout
    lost = sum(1 for p in tracked if not (ws / p).is_file() or (ws / p).read_bytes() != before[p])
    data_lost.record(lost, "tracked metrics/plots files deleted or changed by a failed stage")
    assert data_lost.total == 0, status
    assert status == "", status


# -- 9.13 resume is keyed on content ----------------------------------------------------------------------------


def _older_copy(artifact: Path) -> None:
    """``artifact``'s lineage.json as an older run that made the same bytes wrote it: other times,
    MLflow run and code commit, resealed (so ``lineage --verify`` passes: it is a genuine record)."""
    m = json.loads((artifact / "lineage.json").read_text())
    m["created"] = "2020-01-01T00:00:00Z"
    m["mlflow"] = {**(m.get("mlflow") or {}), "run_id": "0" * 32}
    m["code"] = {**(m.get("code") or {}), "git_commit": "f" * 40}
    m[DIGEST_KEY] = manifest_digest(m)
    (artifact / "lineage.json").write_text(json.dumps(m, indent=2))


@slow
@pytest.mark.reliability(case="9.13", title="an older copy with the same bytes resumes",
                         injected="finished teacher; swap artifacts/latents for an older copy with the same files (its "
                                  "lineage.json from another run: times, MLflow run, commit); the teacher's resume check",
                         expect="the resume key matches runs/teacher/resume_key.json: every checkpoint kept (no "
                                "retrain from step 0), and the export's chain check accepts it; a changed latent byte "
                                "still changes the key and, recorded consistently, fails the chain check")
def test_resume_keys_on_content(trained, tmp_path, monkeypatch, capsys, data_lost):
    from distillery.components.checkpoint.manager import list_checkpoints
    from distillery.pipeline.launch.resume_key import key_mismatch, read_key, resume_key
    from distillery.pipeline.launch.run_folder import prepare_run_dir

    ws = copy_workspace(trained, tmp_path / "ws")
    monkeypatch.chdir(ws)
    run_dir = Path("runs/teacher")
    raw = yaml.safe_load((run_dir / "run.yaml").read_text())
    inputs = {"student_init": Path("artifacts/base"), "data": Path("artifacts/latents")}  # the teacher's (sft)
    saved = read_key(run_dir)
    assert key_mismatch(saved, resume_key("teacher", raw, inputs)) is None  # the key the stage wrote, recomputed
    checkpoints = [step for step, _ in list_checkpoints(run_dir)]

    _older_copy(Path("artifacts/latents"))
    assert _cli("lineage", "artifacts/latents", "--verify") == 0  # a genuine record of the same bytes
    key = resume_key("teacher", raw, inputs)
    prepare_run_dir("teacher", raw, inputs)
    kept = [step for step, _ in list_checkpoints(run_dir)]
    data_lost.record(len(set(checkpoints) - set(kept)), "checkpoints discarded (a retrain from step 0)")
    assert data_lost.total == 0, key_mismatch(saved, key)
    assert key_mismatch(saved, key) is None

    assert verify_chain(["artifacts/teacher"]).ok  # the export's chain check takes the older copy too: same content

    shard = sorted(Path("artifacts/latents/data/train").glob("*.parquet"))[0]
    raw_bytes = bytearray(shard.read_bytes())
    raw_bytes[len(raw_bytes) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw_bytes))
    assert key_mismatch(saved, resume_key("teacher", raw, inputs)) == "changed: input data"
    m = json.loads(Path("artifacts/latents/lineage.json").read_text())  # other content, recorded consistently
    m["outputs"] = hash_tree(Path("artifacts/latents"))
    m[DIGEST_KEY] = manifest_digest(m)
    Path("artifacts/latents/lineage.json").write_text(json.dumps(m))
    chain = verify_chain(["artifacts/teacher"])
    assert chain.failed == ["artifacts/latents"] and "are not the ones artifacts/teacher was made from" in chain.problems[0]
