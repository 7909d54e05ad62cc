"""A training stage with EMA on publishes the EMA's weights (what validate scores and export ships), and its
lineage says so; the latents stage encodes params.yaml's negative prompt. Real stages (`distillery stage`) in
a git + DVC workspace on the tiny base: a copy of the session's ``prepared`` one (conftest.py: clips and base as
`dvc repro` made them; its latents are made again here, with the negative prompt)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import role_state
from workspace import copy_workspace, set_params, sh, stage

pytestmark = pytest.mark.slow


def test_a_stage_with_ema_ships_the_ema_weights(prepared, tmp_path):
    from safetensors.torch import load_file

    from distillery.data import read_empty_prompt_embedding
    from distillery.data.encoders import BaseEncoders

    negative = "blurry, static, worst quality"
    repo = copy_workspace(prepared, tmp_path / "ws")
    set_params(repo, {"teacher.ema_decay": 0.5, "teacher.ema_start_step": 2, "teacher.weight_decay": 0.01,
                      "latents.negative_prompt": negative})
    sh(["git", "commit", "-qam", "ema params"], repo)
    data = repo / "artifacts" / "latents" / "data"
    encoded = BaseEncoders(repo / "artifacts" / "base" / "model").encode_prompts([negative])[0]
    assert not torch.equal(read_empty_prompt_embedding(data, "negative"), encoded)  # the copied latents: the empty prompt's
    for name in ("latents", "teacher"):
        stage(repo, name, check=True)
    assert torch.equal(read_empty_prompt_embedding(data, "negative"), encoded)

    lineage = json.loads((repo / "artifacts" / "teacher" / "lineage.json").read_text())
    assert lineage["weights"] == {"role": "student", "source": "ema", "callback": "ema", "ema_decay": 0.5, "ema_start_step": 2,
                                  "attention": {"kind": "dense"}}
    assert lineage["config"]["training"]["optimizer"]["weight_decay"] == 0.01
    checkpoint = repo / "runs" / "teacher" / "checkpoint-6"
    shadow, trained = role_state(checkpoint, ema="ema"), role_state(checkpoint)
    shipped = load_file(repo / "artifacts" / "teacher" / "model" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert shipped.keys() == shadow.keys()
    for name, tensor in shipped.items():
        assert torch.equal(tensor, shadow[name].to(tensor.dtype)), name
    assert any(not torch.equal(shipped[n], trained[n].to(shipped[n].dtype)) for n in shipped)  # not the raw weights
