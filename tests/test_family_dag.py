"""The DAG on a base of another model family (issue 63): a workspace whose ``base.path`` is the tiny Cosmos Predict 2.5
or the tiny HunyuanVideo 1.5 runs the real stages (`distillery stage`, in a git + DVC workspace) from the clips to the
export — teacher SFT, pretrain, distill, PDD, validate, export — each training stage's roles built from the family's
plugins, which the recipes read from the folder each role starts from (``stages/recipes/parts.py``), never from code.
A recipe the family builds no student for (a causal HunyuanVideo 1.5: DFSFT, Self-Forcing, the shipped defaults) is
one line, exit 2, before the base stage (or any training stage) works, and in ``distillery params check``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from workspace import error_lines, make_workspace, set_params, sh, stage

# the clips both tiny VAEs take (9 frames of 32², 2 latent frames), and two optimizer steps per training stage
TINY = {"clips.num_train": 8, "clips.num_validation": 2, "clips.num_frames": 9, "teacher.steps": 2, "pretrain.steps": 2,
        "distill.steps": 2, "pdd.steps": 2}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # every stage of a DAG, one after another
STAGES = ("clips", "base", "latents", "teacher", "pretrain", "distill", "pdd", "posttrain", "validate", "export")


def _targets(repo: Path, name: str) -> dict[str, str]:
    """Role -> the plugin class (``_target_``) of training stage ``name``'s run config as it ran."""
    config = yaml.safe_load((repo / "runs" / name / "run.yaml").read_text())
    return {role: spec["_target_"].rsplit(".", 1)[1] for role, spec in config["models"].items()}


def _run_dag(repo: Path) -> None:
    for name in STAGES:
        stage(repo, name, check=True)


def test_a_tiny_cosmos_base_runs_every_stage_on_cosmos_plugins(tmp_path):
    from distillery.tinybase.shipped import shipped_tiny_cosmos

    repo = make_workspace(tmp_path / "ws", {**TINY, "base.path": str(shipped_tiny_cosmos())})
    _run_dag(repo)
    assert _targets(repo, "teacher") == {"student": "CosmosModel"}
    assert _targets(repo, "pretrain") == {"student": "CausalCosmosModel"}  # DFSFT: the causal Cosmos
    assert _targets(repo, "distill") == {"student": "CausalCosmosModel", "teacher": "CosmosModel", "critic": "CosmosModel"}
    assert _targets(repo, "pdd") == {"student": "PDDCosmosModel", "teacher": "CosmosModel"}
    scores = json.loads((repo / "metrics" / "validate.json").read_text())
    assert {"teacher_6/all", "pretrain_4/frechet", "distill_4/frechet", "pdd_1/frechet"} <= set(scores)
    export = repo / "artifacts" / "export"
    assert json.loads((export / "model_index.json").read_text())["_class_name"] == ["pipeline_cosmos", "DistilledCosmosPipeline"]
    assert json.loads((export / "sampling.json").read_text())["sampler"] == "causal_streaming"  # the Self-Forcing student


def test_a_tiny_hunyuan15_base_refuses_a_causal_recipe_then_runs_every_stage_on_its_plugins(tmp_path):
    from distillery.tinybase.hunyuan15 import make_tiny_hunyuan15

    base = make_tiny_hunyuan15(tmp_path / "tiny-hunyuan15")
    repo = make_workspace(tmp_path / "ws", {**TINY, "base.path": str(base)})
    # the shipped recipes' pretrain (DFSFT) and distill (Self-Forcing) train causal students: refused before any work,
    # by the base stage (before any latent is encoded) and by the params check
    for args in (["distillery", "stage", "base"], ["distillery", "params", "check"]):
        out = sh(args, repo, check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        [line] = error_lines(out.stderr)
        assert "pretrain.method: dfsft trains a causal student" in line and "hunyuanvideo1.5" in line
    assert not (repo / "artifacts").exists()
    set_params(repo, {"pretrain.method": "ode_init_bidirectional", "pretrain.teacher_steps": 2, "distill.method": "dmd2"})
    sh(["git", "commit", "-qam", "bidirectional recipes"], repo)
    _run_dag(repo)
    family = {"student": "HunyuanVideo15Model"}
    assert _targets(repo, "teacher") == family and _targets(repo, "pretrain") == family  # SFT; KD on its trajectories
    assert _targets(repo, "distill") == {**family, "teacher": "HunyuanVideo15Model", "critic": "HunyuanVideo15Model"}
    assert _targets(repo, "pdd") == {"student": "PDDHunyuanVideo15Model", "teacher": "HunyuanVideo15Model"}
    scores = json.loads((repo / "metrics" / "validate.json").read_text())
    assert {"teacher_6/all", "distill_4/frechet", "pdd_1/frechet"} <= set(scores)
    export = repo / "artifacts" / "export"
    assert json.loads((export / "model_index.json").read_text())["_class_name"] == [
        "pipeline_hunyuan15", "DistilledHunyuanVideo15Pipeline"]
    assert json.loads((export / "sampling.json").read_text())["sampler"] == "few_step_x0"  # the DMD2 student
