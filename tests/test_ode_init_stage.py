"""ODE-init through the DAG (issue 42 item 3): ``pretrain.method: ode_init`` makes the teacher's ODE trajectories,
trains the causal student on them by knowledge distillation, and ``distill`` (Self-Forcing) starts from that
student with no other change — through ``dvc repro`` in a git + DVC workspace of the tiny default.

The trajectories are resumable and tracked: they live in ``runs/pretrain_trajectories`` while the stage works
and are published inside ``artifacts/pretrain/trajectories`` (a DVC out); a pretrain rerun for another reason
(``ode_init_bidirectional``: a bidirectional student, then DMD2) makes none again and publishes the same bytes.
``pretrain.data: prompts`` (the trajectories from a prompts file, with a given teacher) runs in
tests/test_given_teacher.py, the published recipe's whole DAG.

The workspaces are copies of the session's ``trained`` one (conftest.py: clips, base, latents and teacher made by
`dvc repro teacher` with the small params, which no param set here feeds), with these params set and committed.
The uninterrupted ODE-init pretrain (:func:`ode_pretrained`) is made once for this file: the DAG test goes on from a
copy of it, the kill-and-resume test compares against it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import model_folders_of_the_tiny_base
from workspace import committed_copy, copy_pipeline, copy_workspace, set_params, sh, tree_sha

from distillery.pipeline.dvcfile import stage_params
from distillery.pipeline.params.reader import Params, StageParams

# pretrain and distill params only (the teacher is ``trained``'s); 16 rows in 2 shards, made 4 at a time (shard 0 is
# written while shard 1 is still to make: the kill-and-resume test kills the stage then)
FEW = {"pretrain.method": "ode_init", "pretrain.teacher_steps": 2, "pretrain.trajectory_rows_per_shard": 8,
       "pretrain.trajectory_batch_size": 4, "pretrain.steps": 4, "distill.steps": 2}


def _workspace(source: Path, repo: Path, params: dict[str, object]) -> Path:
    """A copy of the session workspace ``source`` with ``params`` set in params.yaml, committed."""
    return committed_copy(source, repo, params, "ode-init params")


@pytest.fixture(scope="module")
def ode_pretrained(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``trained`` with :data:`FEW` set and `dvc repro pretrain` run uninterrupted: the workspace (read-only: copy
    it) and what dvc printed."""
    repo = _workspace(trained, tmp_path_factory.mktemp("ode") / "ws", FEW)
    return repo, sh(["dvc", "repro", "pretrain"], repo).stdout


@pytest.mark.parametrize("method, target, model, chunks", [
    ("dfsft", "distillery.methods.dfsft.DFSFTMethod", "distillery.models.wan.CausalWanModel", True),
    ("ode_init", "distillery.methods.kd.KDMethod", "distillery.models.wan.CausalWanModel", True),
    ("ode_init_bidirectional", "distillery.methods.kd.KDMethod", "distillery.models.wan.WanModel", False)])
def test_pretrain_method_picks_its_recipe(tmp_path, monkeypatch, method, target, model, chunks):
    """pretrain.method picks the recipe: the causal chunks where the student is causal, the t_list of KD, and
    (ODE-init) the trajectory set it makes first as the data."""
    from distillery.pipeline.launch.run_config import PreparedData
    from stages.training import stage_run_config

    copy_pipeline(tmp_path)
    model_folders_of_the_tiny_base(tmp_path)  # the folders the roles start from, read for their family
    data = yaml.safe_load((tmp_path / "params.yaml").read_text())
    data["pretrain"].update(method=method, chunk_size=2, t_list=[1000, 750, 500, 0])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    for folder in ("artifacts/latents/data", "runs/pretrain_trajectories"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "preprocess.json").write_text(json.dumps({"settings": {"max_sequence_length": 24}}))
    monkeypatch.chdir(tmp_path)
    view = StageParams(Params.load("params.yaml"), "pretrain", stage_params("pretrain"))
    makes_data = hasattr(view.recipe(), "prepare")
    assert makes_data == (method != "dfsft")
    prepared = PreparedData(Path("runs/pretrain_trajectories"), "trajectories") if makes_data else None
    config, _ = stage_run_config(view, "parent", prepared)
    assert config.method.target == target and config.models["student"].target == model
    assert config.training.data.path == str(prepared.folder if prepared else "artifacts/latents/data")
    if chunks:
        assert config.method.config.chunk_size == config.models["student"].config.chunk_size == 2
    else:
        assert not hasattr(config.method.config, "chunk_size") or config.method.config.chunk_size is None
        assert not hasattr(config.models["student"].config, "chunk_size")
    if makes_data:
        assert config.method.config.t_list == [1000.0, 750.0, 500.0, 0.0]


@pytest.mark.slow
def test_ode_init_then_self_forcing_through_dvc_repro(ode_pretrained, tmp_path):
    made_by, pretrain_out = ode_pretrained
    repo = copy_workspace(made_by, tmp_path / "ws")
    out = sh(["dvc", "repro", "distill"], repo)
    assert "Running stage 'pretrain'" in pretrain_out and "Running stage 'distill'" in out.stdout, (pretrain_out, out.stdout)
    pretrain = repo / "artifacts" / "pretrain"
    lineage = json.loads((pretrain / "lineage.json").read_text())
    assert lineage["method"] == "distillery.methods.kd.KDMethod"
    assert {i["role"]: i["path"] for i in lineage["inputs"]} == {"student_init": "artifacts/teacher", "data": "artifacts/latents",
                                                                 "teacher": "artifacts/teacher"}
    assert lineage["config"]["method"]["t_list"] == [999.0, 937.0, 833.0, 624.0, 0.0]
    assert lineage["config"]["training"]["data"]["path"] == "runs/pretrain_trajectories"
    # the trajectories it trained on, tracked with it: 16 prompts x 1 seed, 5 stacked points of the [8, 5, 4, 4] latents
    made = json.loads((pretrain / "trajectories" / "trajectories.json").read_text())
    assert made["rows"] == 16 and made["shards"] == 2 and made["settings"]["t_list"] == [999.0, 937.0, 833.0, 624.0, 0.0]
    assert made["settings"]["guidance_scale"] == 4.0 and made["settings"]["teacher_steps"] == 2
    manifest = json.loads((pretrain / "trajectories" / "preprocess.json").read_text())
    latents = json.loads((repo / "artifacts" / "latents" / "data" / "preprocess.json").read_text())
    assert manifest["latent_shape"] == [5 * latents["latent_shape"][0], *latents["latent_shape"][1:]]
    # distill started from the ODE-init student, unchanged
    distill = json.loads((repo / "artifacts" / "distill" / "lineage.json").read_text())
    assert {i["role"]: i["path"] for i in distill["inputs"]}["student_init"] == "artifacts/pretrain"
    assert distill["method"] == "distillery.methods.self_forcing.SelfForcingMethod"
    assert "distill" not in sh(["dvc", "status", "distill"], repo).stdout
    # the bidirectional student for DMD2: pretrain again, no trajectory made again (the same settings), the same bytes
    before = tree_sha(pretrain / "trajectories")
    set_params(repo, {"pretrain.method": "ode_init_bidirectional", "distill.method": "dmd2"})
    again = sh(["dvc", "repro", "distill"], repo)
    assert "Running stage 'pretrain'" in again.stdout and "Running stage 'teacher'" not in again.stdout
    assert "16 trajectories in 2 shard(s): 0 made this run" in again.stderr + again.stdout
    assert tree_sha(pretrain / "trajectories") == before
    lineage = json.loads((pretrain / "lineage.json").read_text())
    assert lineage["config"]["models"]["student"]["_target_"] == "distillery.models.wan.WanModel"
    assert json.loads((pretrain / "model" / "sampling.json").read_text()).get("chunk_size") is None
    distill = json.loads((repo / "artifacts" / "distill" / "lineage.json").read_text())
    assert distill["method"] == "distillery.methods.dmd2.DMD2Method"
    assert {i["role"]: i["path"] for i in distill["inputs"]}["student_init"] == "artifacts/pretrain"


@pytest.mark.slow
def test_a_pretrain_killed_mid_shard_resumes_to_the_same_trajectories_and_student(trained, ode_pretrained, tmp_path):
    """``distillery stage pretrain`` SIGKILLed while it makes the trajectories — shard 0 written, shard 1 under way —
    then ``dvc repro``: it makes shard 1 only, and the published trajectories and the trained student are byte for byte
    those of a run never killed (:func:`ode_pretrained`: the same params on a copy of the same ``trained``)."""
    import os
    import signal
    import subprocess
    import time

    from workspace import env, wait_no_processes

    repo = _workspace(trained, tmp_path / "ws", FEW)
    reference = ode_pretrained[0]
    proc = subprocess.Popen(["distillery", "stage", "pretrain"], cwd=repo, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    shards = repo / "runs" / "pretrain_trajectories" / "train"
    deadline = time.time() + 600
    while not (shards / "shard-00000.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the stage ended before its first shard"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not wait_no_processes(repo)
    assert not (shards / "shard-00001.parquet").exists() and not (repo / "artifacts" / "pretrain").exists()  # mid-shard 1
    out = sh(["dvc", "repro", "pretrain"], repo)
    assert "16 trajectories in 2 shard(s): 8 made this run (1 shard(s)" in out.stdout + out.stderr
    assert tree_sha(repo / "artifacts" / "pretrain" / "trajectories") == tree_sha(reference / "artifacts" / "pretrain" / "trajectories")
    assert tree_sha(repo / "artifacts" / "pretrain" / "model" / "transformer") == \
        tree_sha(reference / "artifacts" / "pretrain" / "model" / "transformer")
