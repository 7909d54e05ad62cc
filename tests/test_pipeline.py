"""The default pipeline on a tiny configuration: real git + DVC in a temp dir, local MLflow.

One module-scoped `dvc repro` of the whole DAG; then: a no-op repro, lineage of an export copied
elsewhere (verify passes, then fails naming a flipped weight file), the export in a fresh process
with stock diffusers, a changed `pretrain.*` param rerunning only pretrain and export, and a
pretrain SIGKILLed after its first checkpoint resuming to the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1", "OMP_NUM_THREADS": "2"}


def sh(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def set_params(repo: Path, **updates: object) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for dotted, value in updates.items():
        node = params
        *head, last = dotted.split("__")
        for part in head:
            node = node[part]
        node[last] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("pipeline")
    for name in ("dvc.yaml", "params.yaml", "stages"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, repo / name)
    shutil.copytree(ROOT / "src" / "distillery", repo / "src" / "distillery", ignore=shutil.ignore_patterns("__pycache__"))
    set_params(repo, clips__num_train=16, clips__num_validation=4, teacher__steps=6, teacher__batch_size=4,
               teacher__save_every=3, pretrain__steps=6, pretrain__batch_size=4, pretrain__save_every=3,
               validate__num_prompts=2, validate__teacher_steps=[6, 2], validate__student_steps=4)
    sh(["git", "init", "-q"], repo)
    sh(["git", "config", "user.email", "ci@example.com"], repo)
    sh(["git", "config", "user.name", "ci"], repo)
    sh(["dvc", "init", "-q"], repo)
    sh(["dvc", "config", "core.analytics", "false"], repo)
    sh(["dvc", "config", "core.site_cache_dir", str(repo / ".dvc-site")], repo)
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-qm", "pipeline"], repo)
    sh(["dvc", "repro"], repo)
    return repo


def test_whole_dag_runs_and_a_noop_repro_is_fast(repo):
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"clips", "base", "latents", "teacher", "pretrain", "validate", "export"}
    report = repo / "artifacts" / "validate" / "report"
    assert (report / "grid.gif").is_file() and (report / "grid.mp4").is_file()
    scores = json.loads((repo / "metrics" / "validate.json").read_text())
    assert scores["teacher_6/nfe"] == 12 and scores["teacher_2/nfe"] == 4 and scores["pretrain_4/nfe"] == 8
    assert scores["teacher_6/distance_to_teacher"] == 0.0 and 0.0 <= scores["pretrain_4/colour"] <= 1.0
    for stage in lock["stages"]:
        assert (repo / "artifacts" / stage / "lineage.json").is_file(), stage
        assert json.loads((repo / "metrics" / f"{stage}.json").read_text()) == json.loads(
            (repo / "artifacts" / stage / "metrics.json").read_text())
    assert (repo / "runs" / "teacher" / "checkpoint-6").is_dir()
    started = time.perf_counter()
    out = sh(["dvc", "repro"], repo).stdout
    assert "Data and pipelines are up to date" in out
    assert time.perf_counter() - started < 10
    shown = sh(["dvc", "metrics", "show", "--json"], repo).stdout
    assert "final_loss" in shown
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("distillery").experiment_id])
    parents = [r for r in runs if r.data.tags.get("distillery.kind") == "pipeline"]
    assert len(parents) == 1
    children = {r.data.tags.get("mlflow.runName") for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert children >= {"clips", "base", "latents", "teacher", "pretrain", "validate", "export"}


def test_lineage_of_a_copied_export_verifies_and_names_an_altered_file(repo, tmp_path):
    elsewhere = tmp_path / "elsewhere" / "export"
    shutil.copytree(repo / "artifacts" / "export", elsewhere)
    tree = sh(["distillery", "lineage", str(elsewhere)], tmp_path).stdout
    for stage in ("export", "pretrain", "teacher", "latents", "base", "clips"):  # validate is a sibling, not an input
        assert f"{stage} [" in tree or f": {stage} [" in tree, stage
    manifest = json.loads(sh(["distillery", "lineage", str(elsewhere), "--json"], tmp_path).stdout)
    assert manifest["stage"] == "export" and manifest["inputs"][0]["lineage"]["stage"] == "pretrain"
    assert "verified" in sh(["distillery", "lineage", str(elsewhere), "--verify"], tmp_path).stdout
    weights = elsewhere / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    bad = sh(["distillery", "lineage", str(elsewhere), "--verify"], tmp_path, check=False)
    assert bad.returncode == 2
    assert "changed: transformer/diffusion_pytorch_model.safetensors" in bad.stdout


def test_export_loads_in_a_fresh_process_with_stock_diffusers(repo, tmp_path):
    code = (
        "import sys, torch\n"
        "from diffusers import WanPipeline\n"
        "pipe = WanPipeline.from_pretrained(sys.argv[1])\n"
        "v = pipe('a red circle moving left on a black background', num_frames=17, height=32, width=32,"
        " num_inference_steps=4, max_sequence_length=32, output_type='np', generator=torch.Generator().manual_seed(0)).frames[0]\n"
        "print(v.shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(repo / "artifacts" / "export")], capture_output=True, text=True,
                         timeout=300, env={**_env(), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(17, 32, 32, 3)" in out.stdout


def test_changing_a_pretrain_param_reruns_only_pretrain_and_what_follows(repo):
    set_params(repo, pretrain__learning_rate=1.0e-4)
    status = sh(["dvc", "status"], repo).stdout
    assert "pretrain" in status and "teacher:" not in status and "latents:" not in status
    out = sh(["dvc", "repro"], repo).stdout
    ran = [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")]
    assert ran[0] == "pretrain" and set(ran) == {"pretrain", "validate", "export"}, out


def test_killed_pretrain_resumes_to_the_same_weights(repo, tmp_path):
    from helpers import role_state

    set_params(repo, pretrain__learning_rate=3.0e-4, pretrain__steps=30)  # long enough to be killed mid-run
    shutil.rmtree(repo / "runs" / "pretrain")  # so the first checkpoint we see is this run's
    proc = subprocess.Popen(["dvc", "repro", "pretrain"], cwd=repo, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 600
    while not (repo / "runs" / "pretrain" / "checkpoint-3" / "metadata.json").is_file():
        assert proc.poll() is None and time.time() < deadline, "pretrain ended before its first checkpoint"
        time.sleep(0.1)
    import psutil

    tree = psutil.Process(proc.pid)
    victims = [tree, *tree.children(recursive=True)]  # dvc, the stage, torchrun and its workers (own sessions)
    for p in victims:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(victims, timeout=30)
    proc.wait()
    assert not (repo / "runs" / "pretrain" / "checkpoint-30").exists()
    out = sh(["dvc", "repro"], repo)
    import re

    resumed_at = re.search(r"resumed from runs/pretrain/checkpoint-(\d+)", out.stdout + out.stderr)
    assert resumed_at and 3 <= int(resumed_at.group(1)) < 30, [l for l in out.stderr.splitlines() if "INFO" in l or "rror" in l][:12]
    resumed = role_state(repo / "runs" / "pretrain" / "checkpoint-30")
    shutil.rmtree(repo / "runs" / "pretrain")  # the same config, uninterrupted
    sh(["dvc", "repro", "--force", "pretrain"], repo)
    uninterrupted = role_state(repo / "runs" / "pretrain" / "checkpoint-30")
    import torch

    for k in resumed:
        assert torch.equal(resumed[k], uninterrupted[k]), k
