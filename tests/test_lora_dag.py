"""A LoRA stage through ``dvc repro``: ``pretrain.lora_rank: 4`` on the DFSFT pretrain (a causal student), killed
mid-run with dvc and rerun, ends bitwise where an uninterrupted run does — its checkpoints' adapter, the published
merged weights and adapter file — and the artifact's merged transformer is its base plus that adapter; the adapter
export (``export.lora: adapter``) loads as its card says in stock diffusers onto the base it names and gives the
merged weights' forward; ``export.lora: adapter`` of a student without a LoRA is one line before any work."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import dcp_tensors
from workspace import copy_workspace, read_log_steps, repro_killed_beside_whole, set_params, sh

pytestmark = pytest.mark.slow
LORA = {"pretrain.lora_rank": 4, "pretrain.lora_alpha": 8.0, "pretrain.learning_rate": 1e-2, "pretrain.steps": 6,
        "pretrain.save_every": 2}


def test_a_lora_pretrain_resumes_after_a_kill_bitwise(trained, tmp_path):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    from distillery.export.weights import load_base_with_adapter, load_role_weights

    whole, killed = copy_workspace(trained, tmp_path / "whole"), copy_workspace(trained, tmp_path / "killed")
    for repo in (whole, killed):
        set_params(repo, LORA)
    # the uninterrupted run works beside the killed one and its resume (two workspaces, nothing shared): one core each
    out = repro_killed_beside_whole(killed, whole, "pretrain", tmp_path / "whole.log")
    assert "resumed from runs/pretrain/checkpoint-" in out.stderr
    assert read_log_steps(killed / "runs" / "pretrain")[-1] == 6

    a = dcp_tensors(whole / "runs" / "pretrain" / "checkpoint-6", ("roles.", "optimizers."))
    b = dcp_tensors(killed / "runs" / "pretrain" / "checkpoint-6", ("roles.", "optimizers."))
    assert a.keys() == b.keys() and all(".lora_" in k for k in a if ".state." in k or k.startswith("roles."))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for name in ("transformer/diffusion_pytorch_model.safetensors", "lora/pytorch_lora_weights.safetensors"):
        wa, wb = load_file(whole / "artifacts" / "pretrain" / "model" / name), load_file(killed / "artifacts" / "pretrain" / "model" / name)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name

    # the published merged weights are the base (the teacher artifact) + the adapter the checkpoint holds
    model = whole / "artifacts" / "pretrain" / "model"
    info = json.loads((model / "lora" / "base.json").read_text())
    assert info["base"]["path"] == "artifacts/teacher/model/transformer" and info["rank"] == 4
    lineage = json.loads((whole / "artifacts" / "pretrain" / "lineage.json").read_text())
    assert lineage["config"]["models"]["student"]["lora"]["rank"] == 4
    ckpt = whole / "runs" / "pretrain" / "checkpoint-6"
    meta = json.loads((ckpt / "metadata.json").read_text())
    config = json.loads((ckpt / "roles" / "student" / "config.json").read_text())
    cwd = os.getcwd()
    os.chdir(whole)  # the base path is recorded relative to the pipeline folder
    try:
        adapted = load_base_with_adapter(meta["lora"]["student"], config, "test")
    finally:
        os.chdir(cwd)
    load_role_weights(ckpt, "student", adapted, adapters_only=True)
    merged = WanTransformer3DModel.from_pretrained(model / "transformer")
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 8, 3, 8, 8, generator=g), torch.randn(1, 8, 32, generator=g)
    with torch.no_grad():
        ya = adapted(hidden_states=x, timestep=torch.tensor([400.0]), encoder_hidden_states=text, return_dict=False)[0]
        ym = merged(hidden_states=x, timestep=torch.tensor([400.0]), encoder_hidden_states=text, return_dict=False)[0]
    torch.testing.assert_close(ym, ya, atol=1e-5, rtol=1e-5)
    base = WanTransformer3DModel.from_pretrained(whole / "artifacts" / "teacher" / "model" / "transformer")
    with torch.no_grad():
        yb = base(hidden_states=x, timestep=torch.tensor([400.0]), encoder_hidden_states=text, return_dict=False)[0]
    assert (yb - ym).abs().max() > 1e-3  # the adapter trained

    # the export's adapter folder, as `export.lora: adapter` assembles it, loaded as its card says (stock diffusers,
    # from the workspace root) onto the base it names: the merged artifact's forward
    from diffusers import WanPipeline

    from distillery.export.lora_card import adapter_model_card, assemble_adapter_export

    out = tmp_path / "export"
    out.mkdir()
    shipped = assemble_adapter_export(model, out)
    card = adapter_model_card("pretrain", shipped, json.loads((out / "sampling.json").read_text()), folder=str(out))
    assert "It needs its base:** the transformer `artifacts/teacher/model/transformer`" in card
    assert info["base"]["sha256"] in card and "export it merged" in card  # a causal student: not stock-sampled
    os.chdir(whole)
    try:
        pipe = WanPipeline.from_pretrained("artifacts/base/model",
                                           transformer=WanTransformer3DModel.from_pretrained(info["base"]["path"]))
        pipe.load_lora_weights(str(out))
    finally:
        os.chdir(cwd)
    with torch.no_grad():
        ys = pipe.transformer(hidden_states=x, timestep=torch.tensor([400.0]), encoder_hidden_states=text, return_dict=False)[0]
    torch.testing.assert_close(ys, ym, atol=1e-5, rtol=1e-5)

    # export.lora: adapter of a student that trained its full weights (the teacher): one line, before any work
    set_params(whole, {"export.student": "teacher", "export.lora": "adapter"})
    failed = sh(["distillery", "stage", "export"], whole, check=False)
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert "export.lora: adapter: the teacher stage trained its full weights, not a LoRA" in failed.stderr.strip().splitlines()[-1]
    assert not (whole / "artifacts" / "export").exists()
