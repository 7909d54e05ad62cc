"""The posttrain stage through ``dvc repro`` (issue 61): DiffusionNFT post-training of the DMD2 student, killed mid-run
with dvc and rerun, ends bitwise where an uninterrupted run does — its checkpoints (the student, its optimizer, the old
policy and the reference, the rollout group's random stream) and the published transformer; its lineage records the
student it started from, the base whose VAE and analyzer it read and the reward; switched off, the stage publishes a
record of that and no model, and ``export.student: posttrain`` is one line; a reward folder that does not load is
one line, exit 2, the artifact untouched.

The chain that makes its student — a bidirectional pretrain student given as is (the shipped tiny base's weights,
``pretrain.source: given``), then ``distill.method: dmd2`` for 2 steps — runs once in a copy of the session's
``trained`` workspace; the uninterrupted and the killed posttrain run in two copies of that
(``workspace.repro_killed_beside_whole``)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import dcp_tensors
from safetensors.torch import load_file
from workspace import copy_workspace, read_log_steps, repro_killed_beside_whole, set_params, sh

# a chain of stages, then two posttrain runs side by side: beyond the default 600 s on 2 shared cores when this file
# builds the session's `trained` workspace itself
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
CHAIN = {"pretrain.method": "ode_init_bidirectional", "pretrain.source": "given", "pretrain.path": "src/distillery/assets/tiny-wan",
         "distill.method": "dmd2", "distill.steps": 2, "distill.save_every": 0, "distill.student_steps": 2,
         "posttrain.enabled": True, "posttrain.steps": 4, "posttrain.save_every": 2, "posttrain.batch_size": 2,
         "posttrain.samples_per_prompt": 2, "posttrain.learning_rate": 1.0e-3}
WEIGHTS = "model/transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def posttrained(trained, tmp_path_factory):
    """``(whole, killed, rerun)``: the posttrain stage run uninterrupted in ``whole`` and killed mid-run then rerun in
    ``killed`` (what that rerun printed), both after the chain (:data:`CHAIN`) in a copy of ``trained``."""
    root = tmp_path_factory.mktemp("posttrain")
    chain = copy_workspace(trained, root / "chain")
    set_params(chain, CHAIN)
    sh(["dvc", "repro", "distill"], chain)
    whole, killed = copy_workspace(chain, root / "whole"), copy_workspace(chain, root / "killed")
    return whole, killed, repro_killed_beside_whole(killed, whole, "posttrain", root / "whole.log")


def test_posttrain_resumes_after_a_kill_bitwise_and_records_its_reward(posttrained):
    whole, killed, out = posttrained
    assert "resumed from runs/posttrain/checkpoint-" in out.stderr
    assert read_log_steps(killed / "runs" / "posttrain")[-1] == 4

    prefixes = ("roles.", "optimizers.", "schedulers.", "shadows.", "method.")
    a = dcp_tensors(whole / "runs" / "posttrain" / "checkpoint-4", prefixes)
    b = dcp_tensors(killed / "runs" / "posttrain" / "checkpoint-4", prefixes)
    assert a.keys() == b.keys() and {"shadows.old", "shadows.reference"} <= {k.rpartition(".transformer")[0] for k in a}
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    wa, wb = load_file(whole / "artifacts" / "posttrain" / WEIGHTS), load_file(killed / "artifacts" / "posttrain" / WEIGHTS)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    before = load_file(whole / "artifacts" / "distill" / WEIGHTS)
    assert any(not torch.equal(before[k], wa[k]) for k in wa)  # it trained

    # the artifact samples as the student did; its lineage names the student, the data, the base and the reward
    art = whole / "artifacts" / "posttrain"
    assert json.loads((art / "model" / "sampling.json").read_text()) == json.loads(
        (whole / "artifacts" / "distill" / "model" / "sampling.json").read_text())
    lineage = json.loads((art / "lineage.json").read_text())
    assert [i["role"] for i in lineage["inputs"]] == ["student_init", "data", "base"]
    assert lineage["method"] == "distillery.methods.rl.nft.DiffusionNFTMethod"
    reward = lineage["config"]["method"]["rewards"]["adherence"]
    assert reward["_target_"].endswith("AdherenceReward") and reward["folder"] == "artifacts/base/model"
    assert lineage["params"]["posttrain"]["reward_adherence"] == 1.0
    metadata = json.loads((whole / "runs" / "posttrain" / "checkpoint-4" / "metadata.json").read_text())
    assert metadata["frozen_roles"]["reward.adherence"]["path"] == "artifacts/base/model"  # a resume checks its digest



def test_a_bad_reward_folder_is_one_line_and_switched_off_the_stage_publishes_no_model(posttrained, tmp_path):
    whole = copy_workspace(posttrained[0], tmp_path / "ws")
    art = whole / "artifacts" / "posttrain"
    weights = load_file(art / WEIGHTS).keys()
    # a reward model folder that does not load: one line, exit 2, the artifact as it was
    set_params(whole, {"posttrain.reward_clip": 0.5, "posttrain.clip_model": str(tmp_path / "no-clip")})
    (tmp_path / "no-clip").mkdir()
    published = (art / "lineage.json").read_bytes()
    failed = sh(["distillery", "stage", "posttrain"], whole, check=False)
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert "method.rewards.clip" in failed.stderr.strip().splitlines()[-1]
    assert (art / "lineage.json").read_bytes() == published and load_file(art / WEIGHTS).keys() == weights

    # switched off: a record of that, no model; export.student: posttrain is one line before any work
    set_params(whole, {"posttrain.enabled": False, "posttrain.reward_clip": 0.0, "posttrain.clip_model": None,
                       "export.student": "posttrain"})
    sh(["dvc", "repro", "-s", "posttrain"], whole)
    off = json.loads((art / "lineage.json").read_text())
    assert off["kind"] == "off" and off["inputs"] == [] and not (art / "model").exists()
    assert (whole / "runs" / "posttrain" / "checkpoint-4").is_dir()  # kept: switched on again, it resumes
    failed = sh(["distillery", "stage", "export"], whole, check=False)
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert "export.student: posttrain: the posttrain stage is off" in failed.stderr.strip().splitlines()[-1]
    assert not (whole / "artifacts" / "export").exists()
