"""ODE-init through the DAG (issue 42 item 3): ``pretrain.method: ode_init`` makes the teacher's ODE trajectories,
trains the causal student on them by knowledge distillation, and ``distill`` (Self-Forcing) starts from that
student with no other change — through ``dvc repro`` in a git + DVC workspace of the tiny default.

The trajectories are resumable and tracked: they live in ``runs/pretrain_trajectories`` while the stage works
and are published inside ``artifacts/pretrain/trajectories`` (a DVC out); a pretrain rerun for another reason
(its learning rate) makes none again and publishes the same bytes.
"""

from __future__ import annotations

import json

import pytest
from workspace import make_workspace, set_params, sh, tree_sha

FEW = {"pretrain.method": "ode_init", "pretrain.teacher_steps": 2, "pretrain.trajectory_rows_per_shard": 8,
       "pretrain.trajectory_batch_size": 8, "teacher.steps": 2, "pretrain.steps": 4, "distill.steps": 2}


@pytest.mark.slow
def test_ode_init_then_self_forcing_through_dvc_repro(tmp_path):
    repo = make_workspace(tmp_path / "ws", FEW)
    out = sh(["dvc", "repro", "distill"], repo)
    assert "Running stage 'pretrain'" in out.stdout and "Running stage 'distill'" in out.stdout, out.stdout
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
    # pretrain again for another reason: no trajectory made again, the same trajectory bytes published
    before = tree_sha(pretrain / "trajectories")
    set_params(repo, {"pretrain.learning_rate": 1.0e-4})
    again = sh(["dvc", "repro", "pretrain"], repo)
    assert "Running stage 'pretrain'" in again.stdout and "Running stage 'teacher'" not in again.stdout
    assert "16 trajectories in 2 shard(s): 0 made this run" in again.stderr + again.stdout
    assert tree_sha(pretrain / "trajectories") == before


@pytest.mark.slow
def test_ode_init_from_prompts_only_with_a_given_teacher(tmp_path):
    """The published recipes' layout: a given teacher (here the base itself), the student from the base, the
    trajectories from a prompts file (``pretrain.data: prompts``: the prompts stage's text embeddings, no video)."""
    from workspace import ROOT

    prompts = (ROOT / "src" / "distillery" / "assets" / "prompts" / "tiny.txt").read_text().splitlines()[:12]
    repo = make_workspace(tmp_path / "ws", {**FEW, "pretrain.data": "prompts", "prompts.path": "prompts.txt",
                                            "prompts.rows_per_shard": 4, "teacher.source": "base",
                                            "pretrain.student_init": "base", "pretrain.batch_size": 4})
    (repo / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    sh(["dvc", "repro", "pretrain"], repo)
    lineage = json.loads((repo / "artifacts" / "pretrain" / "lineage.json").read_text())
    assert {i["role"]: i["path"] for i in lineage["inputs"]} == {"student_init": "artifacts/base", "data": "artifacts/prompts",
                                                                 "teacher": "artifacts/teacher"}
    made = json.loads((repo / "artifacts" / "pretrain" / "trajectories" / "trajectories.json").read_text())
    assert made["rows"] == 12 and made["settings"]["latent_shape"] == [8, 5, 8, 8]  # the prompts stage's derived shape
    captions = json.loads((repo / "artifacts" / "pretrain" / "trajectories" / "preprocess.json").read_text())
    assert captions["data"] == "artifacts/prompts/data" and captions["latent_shape"] == [40, 5, 8, 8]
    assert json.loads((repo / "metrics" / "pretrain.json").read_text())["steps"] == 4
