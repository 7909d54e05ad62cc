"""Causal consistency distillation and Teacher-Forcing SFT through the DAG (issue 60): ``pretrain.method: causal_cd``
(and ``tfsft``) trains the causal student with ``dvc repro``, and ``distill`` (Self-Forcing) starts from it with no
other change — with the collapse watch on, whose choice the distill artifact's lineage records. A causal-CD pretrain
SIGKILLed mid-run resumes through ``dvc repro`` to the bytes of a run never killed (its target network — the student's
shadow — resumed with it).

The workspaces are copies of the session's ``trained`` one (conftest.py: clips, base, latents and teacher made by
`dvc repro teacher` with the small params), with these params set and committed. The uninterrupted causal-CD pretrain
(:func:`cd_pretrained`) is made once for this file: the DAG test goes on from a copy of it, the kill test compares
against it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from workspace import committed_copy, copy_workspace, set_params, sh, tree_sha

pytestmark = pytest.mark.slow

# pretrain and distill only (the teacher is ``trained``'s): 6 pretrain steps, a checkpoint each (the kill lands after
# one); the target follows the student from step 2, so the resumed run must carry the shadow weights to match
FEW = {"pretrain.method": "causal_cd", "pretrain.steps": 6, "pretrain.save_every": 1, "pretrain.cd_steps": 8,
       "pretrain.target_start_step": 2, "pretrain.target_decay": 0.5, "distill.steps": 2,
       "distill.collapse_every": 1}


def _workspace(source: Path, repo: Path, params: dict[str, object]) -> Path:
    """A copy of the session workspace ``source`` with ``params`` set in params.yaml, committed."""
    return committed_copy(source, repo, params, "causal-cd params")


@pytest.fixture(scope="module")
def cd_pretrained(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``trained`` with :data:`FEW` set and `dvc repro pretrain` run uninterrupted (read-only: copy it)."""
    repo = _workspace(trained, tmp_path_factory.mktemp("cd") / "ws", FEW)
    sh(["dvc", "repro", "pretrain"], repo)
    return repo


def _inputs(lineage: dict) -> dict[str, str]:
    return {i["role"]: i["path"] for i in lineage["inputs"]}


def test_causal_cd_then_self_forcing_with_the_collapse_watch_through_dvc_repro(cd_pretrained, tmp_path):
    repo = copy_workspace(cd_pretrained, tmp_path / "ws")
    pretrain = json.loads((repo / "artifacts" / "pretrain" / "lineage.json").read_text())
    assert pretrain["method"] == "distillery.methods.causal_cd.CausalCDMethod"
    assert _inputs(pretrain) == {"student_init": "artifacts/teacher", "teacher_init": "artifacts/teacher",
                                 "data": "artifacts/latents"}
    method = pretrain["config"]["method"]
    assert (method["num_discrete_steps"], method["target_start_step"], method["guidance_scale"]) == (8, 2, 4.0)
    assert json.loads((repo / "artifacts" / "pretrain" / "model" / "sampling.json").read_text())["chunk_size"] == 1
    out = sh(["dvc", "repro", "distill"], repo)
    assert "Running stage 'distill'" in out.stdout and "Running stage 'pretrain'" not in out.stdout
    distill = json.loads((repo / "artifacts" / "distill" / "lineage.json").read_text())
    assert distill["method"] == "distillery.methods.self_forcing.SelfForcingMethod"
    assert _inputs(distill)["student_init"] == "artifacts/pretrain" and _inputs(distill)["base"] == "artifacts/base"
    # the watch checked steps 0, 1, 2; the checkpoint that ships is the one it selected, and the lineage says why
    selected = distill["weights"]["selected"]
    assert selected["by"] == "collapse" and selected["checkpoint"] == f"checkpoint-{selected['step']}"
    assert selected["step"] in (1, 2) and selected["reason"] and selected["stopped"] is False
    assert set(selected["metrics"]) == {"saturation", "diversity", "motion", "teacher_distance"}
    metrics = json.loads((repo / "metrics" / "distill.json").read_text())
    assert metrics["selected_step"] == selected["step"]
    log = [json.loads(line) for line in (repo / "runs" / "distill" / "train_log.jsonl").read_text().splitlines()]
    assert {"collapse/diversity", "collapse/teacher_distance"} <= {k for row in log for k in row}
    assert "distill" not in sh(["dvc", "status", "distill"], repo).stdout
    # Teacher-Forcing SFT: pretrain again with the other causal recipe, distill follows from it
    set_params(repo, {"pretrain.method": "tfsft", "distill.collapse_every": 0})
    again = sh(["dvc", "repro", "distill"], repo)
    assert "Running stage 'pretrain'" in again.stdout and "Running stage 'distill'" in again.stdout
    lineage = json.loads((repo / "artifacts" / "pretrain" / "lineage.json").read_text())
    assert lineage["method"] == "distillery.methods.tfsft.TFSFTMethod" and "teacher_init" not in _inputs(lineage)
    distill = json.loads((repo / "artifacts" / "distill" / "lineage.json").read_text())
    assert "selected" not in distill["weights"] and "base" not in _inputs(distill)  # the watch off: no VAE read


def test_a_causal_cd_pretrain_killed_mid_run_resumes_to_the_same_student(trained, cd_pretrained, tmp_path):
    """``distillery stage pretrain`` SIGKILLed after its step-3 checkpoint (steps 4–6 to go; the target network
    already following the student), then ``dvc repro pretrain``: it resumes, and the published student is byte for byte
    that of the run never killed (:func:`cd_pretrained`)."""
    from workspace import kill_after_checkpoint

    repo = _workspace(trained, tmp_path / "ws", FEW)
    runs = repo / "runs" / "pretrain"
    kill_after_checkpoint(["distillery", "stage", "pretrain"], repo, "pretrain", step=3)
    assert not (runs / "checkpoint-6").exists() and not (repo / "artifacts" / "pretrain").exists()
    out = sh(["dvc", "repro", "pretrain"], repo)
    assert "resumed from" in out.stdout + out.stderr
    assert tree_sha(repo / "artifacts" / "pretrain" / "model" / "transformer") == \
        tree_sha(cd_pretrained / "artifacts" / "pretrain" / "model" / "transformer")
