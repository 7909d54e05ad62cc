"""``<stage>.lora_rank`` in params.yaml: the training stage trains a LoRA adapter on its student and publishes the merged
weights (what every later stage reads) beside the adapter (``model/lora/``); the adapter export's folder and card load
in stock diffusers onto the base it names and sample as the merged weights; ``export.lora: adapter`` of a student
without a LoRA is one line before any work. Real stages (``distillery stage``) in a git + DVC workspace on the tiny base."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import tiny_raw_batch
from workspace import make_workspace, set_params, stage

pytestmark = pytest.mark.slow


def _forward(transformer: torch.nn.Module) -> torch.Tensor:
    raw = tiny_raw_batch(2, 3)
    with torch.no_grad():
        return transformer(hidden_states=raw["latents"], timestep=torch.tensor([250.0, 750.0]),
                           encoder_hidden_states=raw["text_embeds"], return_dict=False)[0]


def test_a_lora_stage_ships_merged_weights_and_its_adapter(tmp_path):
    from diffusers import WanPipeline, WanTransformer3DModel

    from distillery.components.checkpoint.dcp_io import read_dcp_metadata
    from distillery.export.lora_card import adapter_model_card, assemble_adapter_export

    repo = make_workspace(tmp_path / "ws", {"teacher.lora_rank": 4, "teacher.lora_alpha": 8.0, "teacher.learning_rate": 1e-2})
    for name in ("clips", "base", "latents", "teacher"):
        stage(repo, name, check=True)
    model = repo / "artifacts" / "teacher" / "model"
    lineage = json.loads((repo / "artifacts" / "teacher" / "lineage.json").read_text())
    assert lineage["config"]["models"]["student"]["lora"]["rank"] == 4
    assert lineage["config"]["models"]["student"]["lora"]["alpha"] == 8.0
    checkpoint = sorted((repo / "runs" / "teacher").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    roles = [k for k in read_dcp_metadata(checkpoint / "dcp").state_dict_metadata if k.startswith("roles.")]
    assert roles and all(".lora_" in k for k in roles)  # the stage's checkpoints hold the adapter only
    info = json.loads((model / "lora" / "base.json").read_text())
    assert info["base"]["path"] == "artifacts/base/model/transformer" and info["rank"] == 4

    # the export's adapter folder, as `export.lora: adapter` assembles it, loaded as its card says (stock diffusers,
    # from the workspace root) onto the base it names: the merged artifact's forward
    out = tmp_path / "export"
    out.mkdir()
    shipped = assemble_adapter_export(model, out)
    card = adapter_model_card("teacher", shipped, json.loads((out / "sampling.json").read_text()), folder=str(out))
    assert "It needs its base:** the transformer `artifacts/base/model/transformer`" in card
    assert info["base"]["sha256"] in card
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        transformer = WanTransformer3DModel.from_pretrained(info["base"]["path"])
        pipe = WanPipeline.from_pretrained("artifacts/base/model", transformer=transformer)
        pipe.load_lora_weights(str(out))
    finally:
        os.chdir(cwd)
    merged = WanTransformer3DModel.from_pretrained(model / "transformer")
    torch.testing.assert_close(_forward(pipe.transformer), _forward(merged), atol=1e-5, rtol=1e-5)
    base = WanTransformer3DModel.from_pretrained(repo / "artifacts" / "base" / "model" / "transformer")
    assert (_forward(base) - _forward(merged)).abs().max() > 1e-3  # the adapter trained

    # export.lora: adapter of a student that trained its full weights: one line, before any work
    set_params(repo, {"teacher.lora_rank": 0, "export.student": "teacher", "export.lora": "adapter"})
    (model / "lora" / "base.json").unlink()  # (as a full-weight teacher stage leaves it: no adapter)
    failed = stage(repo, "export")
    assert failed.returncode == 2, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert "export.lora: adapter: the teacher stage trained its full weights, not a LoRA" in last, failed.stderr[-2000:]
    assert not (repo / "artifacts" / "export").exists()
