"""Image-to-video through ``dvc repro`` (issue 45 item 2): with ``base.path`` a Wan 2.1 I2V folder (the tiny one), the
latents stage stores the first frames' condition and image embeddings, the teacher stage trains the I2V model on
them — killed mid-run with dvc and rerun, it ends bitwise where an uninterrupted run does —, the rest of the DAG
(DFSFT, Self-Forcing, PDD, validate with the stored frames) runs on them, and the teacher's export is a folder stock
``WanImageToVideoPipeline`` loads and samples (a student only our pipeline samples is one line at export)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import dcp_tensors
from workspace import (
    copy_workspace,
    make_workspace,
    read_log_steps,
    repro_killed_beside_whole,
    set_params,
    sh,
)

pytestmark = pytest.mark.slow


def test_an_i2v_teacher_trains_through_dvc_and_resumes_after_a_kill(tmp_path):
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from PIL import Image
    from safetensors.torch import load_file

    from distillery.tinybase.tiny_i2v import make_tiny_i2v_base

    base = make_tiny_i2v_base(tmp_path / "i2v-base", seed=0)
    whole = make_workspace(tmp_path / "whole", {"base.path": str(base), "teacher.steps": 4, "teacher.save_every": 2})
    sh(["dvc", "repro", "latents"], whole)
    manifest = json.loads((whole / "artifacts" / "latents" / "data" / "preprocess.json").read_text())
    assert manifest["image_conditioning"]["first_frame_shape"][0] == 12  # 4 mask + 8 latent channels
    assert manifest["image_conditioning"]["image_embedding_shape"] == [17, 32]
    killed = copy_workspace(whole, tmp_path / "killed")
    out = repro_killed_beside_whole(killed, whole, "teacher", tmp_path / "whole.log")
    assert "resumed from runs/teacher/checkpoint-" in out.stderr
    assert read_log_steps(killed / "runs" / "teacher")[-1] == 4
    a = dcp_tensors(whole / "runs" / "teacher" / "checkpoint-4", ("roles.", "optimizers."))
    b = dcp_tensors(killed / "runs" / "teacher" / "checkpoint-4", ("roles.", "optimizers."))
    assert a.keys() == b.keys() and any("image_embedder" in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    name = "transformer/diffusion_pytorch_model.safetensors"
    wa, wb = load_file(whole / "artifacts" / "teacher" / "model" / name), load_file(killed / "artifacts" / "teacher" / "model" / name)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    trained = WanTransformer3DModel.from_pretrained(whole / "artifacts" / "teacher" / "model" / "transformer")
    assert trained.config.in_channels == 20 and trained.config.image_dim == 32

    # the rest of the DAG on the I2V latents (DFSFT and Self-Forcing causal students, PDD, validate with the stored
    # frames); the default export.student (the distill student) is one line: only our pipeline samples it
    sh(["dvc", "repro", "validate"], whole, timeout=1800)
    report = json.loads((whole / "artifacts" / "validate" / "report" / "report.json").read_text())
    assert {c["name"].split("_")[0] for c in report["candidates"]} >= {"teacher", "pretrain", "distill", "pdd"}
    failed = sh(["distillery", "stage", "export"], whole, check=False)
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert "stage export: the distill student of an image-to-video base samples with the" in failed.stderr.strip().splitlines()[-1]
    assert not (whole / "artifacts" / "export").exists()
    set_params(whole, {"export.student": "teacher"})
    sh(["dvc", "repro", "export"], whole)
    folder = whole / "artifacts" / "export"
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "WanImageToVideoPipeline"
    card = (folder / "README.md").read_text()
    assert "pipeline_tag: image-to-video" in card and "WanImageToVideoPipeline.from_pretrained(" in card
    exported = load_file(folder / name)
    assert all(torch.equal(exported[k], wa[k]) for k in wa)  # the teacher's transformer, as trained
    pipe = WanImageToVideoPipeline.from_pretrained(str(folder))  # stock diffusers samples the export
    text = torch.randn(1, 512, 32)
    video = pipe(image=Image.fromarray(np.zeros((32, 32, 3), np.uint8)), prompt_embeds=text,
                 negative_prompt_embeds=torch.zeros_like(text), num_frames=9, height=32, width=32,
                 num_inference_steps=1, output_type="np").frames[0]
    assert video.shape == (9, 32, 32, 3) and np.isfinite(video).all()
