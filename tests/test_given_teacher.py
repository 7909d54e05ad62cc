"""A teacher that is given, not trained (issue 42 item 1): ``teacher.source: base`` with ``teacher.path`` (a second
tiny Wan of another width and depth, as Wan2.1-14B beside a 1.3B base), the causal student from the base
(``pretrain.student_init: base``) and the critic too (``distill.critic_init: base``) — the published recipes'
layout, all of it (issue 42's DAG): prompt-only data (the prompts stage; ``<stage>.data: prompts`` for pretrain,
distill and pdd), ODE-init (the given teacher's trajectories, then KD into the causal student), Self-Forcing, PDD,
validate and export — through the real stages (`distillery stage`) in a git + DVC workspace. The workspace is a
copy of the session's ``prepared`` one (conftest.py: clips, base and latents made by `dvc repro latents`, which no
param set here feeds), with these params set and committed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from workspace import copy_workspace, set_params, sh, shipped_params_text, stage

from distillery.pipeline.params.loading import validate_params
from distillery.tinybase.tiny import TinyBaseConfig, TinyTransformerConfig, make_tiny_base

ROOT = Path(__file__).resolve().parents[1]
# the published recipes' data and init (issue 42 items 2-3) at the tiny scale: 12 prompts in 3 shards, trajectories of
# 2 teacher steps made 4 at a time, then KD; distill and pdd read the same prompts
RECIPE = {"prompts.path": "prompts.txt", "prompts.rows_per_shard": 4, "pretrain.method": "ode_init",
          "pretrain.data": "prompts", "pretrain.teacher_steps": 2, "pretrain.trajectory_rows_per_shard": 8,
          "pretrain.trajectory_batch_size": 4, "pretrain.batch_size": 4, "distill.data": "prompts", "pdd.data": "prompts"}


def _width(transformer: Path) -> tuple[int, int]:
    config = json.loads((transformer / "config.json").read_text())
    return config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]


def _workspace(prepared: Path, repo: Path, params: dict[str, object]) -> Path:
    """A copy of ``prepared`` (clips, base and latents there) with ``params`` set in params.yaml, committed."""
    copy_workspace(prepared, repo)
    set_params(repo, params)
    sh(["git", "commit", "-qam", "given teacher params"], repo)
    return repo


@pytest.mark.slow
def test_the_published_recipe_given_wider_teacher_prompts_ode_init_to_export(prepared, tmp_path):
    wide = make_tiny_base(tmp_path / "tiny-wan-wide", TinyBaseConfig(transformer=TinyTransformerConfig(
        num_attention_heads=6, attention_head_dim=48, ffn_dim=640, num_layers=5)), seed=1)
    repo = _workspace(prepared, tmp_path / "ws", {"teacher.source": "base", "teacher.path": str(wide),
                                                  "pretrain.student_init": "base", "distill.critic_init": "base",
                                                  **RECIPE})
    prompts = (ROOT / "src" / "distillery" / "assets" / "prompts" / "tiny.txt").read_text().splitlines()[:12]
    (repo / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    for name in ("prompts", "teacher", "pretrain", "distill", "pdd", "posttrain", "validate", "export"):
        stage(repo, name, check=True)
    teacher = repo / "artifacts" / "teacher"
    # published as given: the folder's transformer and scheduler, byte for byte, its Euler contract; nothing trained
    for part in ("transformer", "scheduler"):
        given = sorted(p.relative_to(wide / part) for p in (wide / part).rglob("*") if p.is_file())
        assert given and all((teacher / "model" / part / f).read_bytes() == (wide / part / f).read_bytes() for f in given)
    assert json.loads((teacher / "model" / "sampling.json").read_text()) == {"sampler": "euler", "shift": 3.0,
                                                                            "num_train_timesteps": 1000}
    lineage = json.loads((teacher / "lineage.json").read_text())
    assert lineage["weights"] == {"role": "student", "source": "given", "path": str(wide)}
    assert [i["role"] for i in lineage["inputs"]] == ["source"] and lineage["metrics"] == {"steps": 0}
    assert not (repo / "runs" / "teacher").exists()
    # the student from the base (not the wide teacher), the critic from the base, the teacher the wide model
    assert _width(repo / "artifacts" / "pretrain" / "model" / "transformer") == (128, 4)
    pretrain = json.loads((repo / "artifacts" / "pretrain" / "lineage.json").read_text())
    assert {i["role"]: i["path"] for i in pretrain["inputs"]} == {
        "student_init": "artifacts/base", "data": "artifacts/prompts", "teacher": "artifacts/teacher"}
    # ODE-init: the wide teacher's trajectories of the 12 prompts, with no video anywhere upstream of the student
    made = json.loads((repo / "artifacts" / "pretrain" / "trajectories" / "trajectories.json").read_text())
    assert made["rows"] == 12 and made["settings"]["latent_shape"] == [8, 5, 8, 8]  # the prompts stage's derived shape
    captions = json.loads((repo / "artifacts" / "pretrain" / "trajectories" / "preprocess.json").read_text())
    assert captions["data"] == "artifacts/prompts/data" and captions["latent_shape"] == [40, 5, 8, 8]  # 5 t_list points
    assert json.loads((repo / "metrics" / "pretrain.json").read_text())["steps"] == 6  # the workspace's pretrain.steps
    distill = json.loads((repo / "artifacts" / "distill" / "lineage.json").read_text())
    roles = {i["role"]: i["path"] for i in distill["inputs"]}
    assert roles["critic_init"] == "artifacts/base" and roles["teacher_init"] == "artifacts/teacher"
    assert roles["data"] == "artifacts/prompts" and roles["student_init"] == "artifacts/pretrain"
    pdd = json.loads((repo / "artifacts" / "pdd" / "lineage.json").read_text())
    assert {i["role"]: i["path"] for i in pdd["inputs"]}["data"] == "artifacts/prompts"
    assert _width(repo / "artifacts" / "distill" / "model" / "transformer") == (128, 4)
    assert _width(teacher / "model" / "transformer") == (288, 5)
    meta = json.loads(sorted((repo / "runs" / "distill").glob("checkpoint-*/metadata.json"))[-1].read_text())
    assert meta["frozen_roles"]["teacher"]["path"] == "artifacts/teacher/model/transformer"
    # validate scores the given teacher as the reference (many-step Euler with CFG) and export ships the student
    scores = json.loads((repo / "metrics" / "validate.json").read_text())
    assert {"teacher_6/all", "distill_4/frechet"} <= set(scores) and scores["distill_4/frechet"] > 0.0
    assert _width(repo / "artifacts" / "export" / "transformer") == (128, 4)


@pytest.mark.process
def test_a_given_teacher_that_is_no_model_folder_is_one_line(prepared, tmp_path):
    repo = _workspace(prepared, tmp_path / "ws", {"teacher.source": "base", "teacher.path": str(tmp_path)})
    out = stage(repo, "teacher")
    assert out.returncode == 2 and "teacher.path" in out.stderr and "not a diffusers model folder" in out.stderr
    assert "Traceback" not in out.stderr and not (repo / "artifacts" / "teacher").exists()


def test_teacher_path_needs_source_base_and_the_defaults_train_the_teacher():
    shipped = yaml.safe_load(shipped_params_text())
    p = validate_params(shipped)
    assert (p.teacher.source, p.teacher.path, p.pretrain.student_init, p.distill.critic_init) == (
        "sft", "artifacts/base/model", "teacher", "teacher")  # the default path stands for the base: nothing given
    shipped["teacher"]["path"] = "/models/Wan2.1-T2V-14B-Diffusers"
    with pytest.raises(Exception, match="teacher.path: .*needs teacher.source: base"):
        validate_params(shipped)
