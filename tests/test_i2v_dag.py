"""Image-to-video through ``dvc repro`` (issue 45 item 2): with ``base.path`` a Wan 2.1 I2V folder (the tiny one), the
latents stage stores the first frames' condition and image embeddings, the teacher stage trains the I2V model on
them — killed mid-run with dvc and rerun, it ends bitwise where an uninterrupted run does —, the rest of the DAG
(DFSFT, Self-Forcing, PDD, validate with the stored frames) runs on them; the distilled student's export is a folder
its own pipeline samples from the stored first frame, bit for bit as validate did, and the teacher's a folder stock
``WanImageToVideoPipeline`` loads and samples."""

from __future__ import annotations

import json
import os

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
    # frames); the default export.student (the distill student) ships its own pipeline, which takes the first frame
    sh(["dvc", "repro", "validate"], whole, timeout=1800)
    report = json.loads((whole / "artifacts" / "validate" / "report" / "report.json").read_text())
    assert {c["name"].split("_")[0] for c in report["candidates"]} >= {"teacher", "pretrain", "distill", "pdd"}
    sh(["dvc", "repro", "export"], whole)
    folder = whole / "artifacts" / "export"
    from diffusers import DiffusionPipeline

    from distillery.export.code import OWN_PIPELINE

    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == list(OWN_PIPELINE)
    card = (folder / "README.md").read_text()
    assert "pipeline_tag: image-to-video" in card and "custom_pipeline=" in card and "pipe(image=image" in card
    pipe = DiffusionPipeline.from_pretrained(str(folder), custom_pipeline=str(folder), trust_remote_code=True)
    cwd = os.getcwd()
    os.chdir(whole)
    try:
        from stages.validate import validation_prompts

        prompts, stored = validation_prompts(len(report["prompts"]))
    finally:
        os.chdir(cwd)
    assert prompts == report["prompts"] and stored is not None and stored.first_frames is not None
    cand = next(c for c in report["candidates"] if c["name"].startswith("distill_"))
    saved = load_file(whole / "artifacts" / "validate" / "report" / "samples" / cand["name"] / "latents.safetensors")["0"]
    text = torch.zeros(1, 512, stored.texts[0].shape[1])
    text[0, :stored.texts[0].shape[0]] = stored.texts[0].float()
    got = pipe(prompt_embeds=text, first_frame=stored.first_frames[0][None], image_embeds=stored.image_embeds[0][None],
               num_frames=report["config"]["num_frames"], height=report["config"]["height"], width=report["config"]["width"],
               num_inference_steps=cand["num_steps"], guidance_scale=cand["guidance_scale"],
               generator=torch.Generator().manual_seed(report["seeds"][0]), output_type="latent").frames
    assert torch.equal(got[0], saved), (got[0] - saved).abs().max()  # what validate sampled for the student
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
