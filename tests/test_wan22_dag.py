"""Wan 2.2 through ``dvc repro`` (issue 45, item 3): ``base.path`` a tiny Wan 2.2 folder — TI2V-5B's layout (per-token
timesteps, the 48-channel VAE) or A14B's two experts — and the pipeline's clips, base, latents (through that folder's
VAE) and teacher (SFT; for A14B each sample's timestep picks the expert that trains on it) run as for Wan 2.1. The
two-expert teacher stage killed mid-run with dvc and rerun resumes and ends bitwise where an uninterrupted run does;
the artifact
keeps the layout (a two-expert transformer, the low-noise expert in ``transformer_2/``); the export's folder (the
export stage's assembly) loads in stock ``WanPipeline`` and samples what our sampler samples from the artifact. A
base whose second expert is missing stops the teacher stage in one line, exit 2, before any training."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import dcp_tensors
from workspace import (
    copy_workspace,
    make_workspace,
    read_log_steps,
    repro_killed_beside_whole,
    sh,
    stage,
)

from distillery.models import registry
from distillery.tinybase.wan22 import A14B_BOUNDARY_RATIO, TI2V_Z_DIM, make_tiny_wan22

pytestmark = pytest.mark.slow
FAMILY = {"ti2v": "wan2.2-ti2v-5b", "a14b": "wan2.2-a14b"}


@pytest.mark.parametrize("layout", ["ti2v", "a14b"])
def test_a_wan22_base_trains_through_dvc_resumes_after_a_kill_and_exports_for_stock_diffusers(tmp_path, layout):
    from diffusers import WanPipeline

    from distillery.data.encoders import BaseEncoders
    from distillery.models.base import Conditioning
    from distillery.sampling import GeneratorNoise, build_sampler
    from stages.export import assemble_export

    folder = make_tiny_wan22(tmp_path / f"tiny-wan22-{layout}", layout)
    killed = make_workspace(tmp_path / "killed", {"base.path": str(folder)})
    if layout == "ti2v":  # one uninterrupted run (the kill and resume: the two-expert case, below; suite time)
        sh(["dvc", "repro", "teacher"], killed)
    else:
        sh(["dvc", "repro", "latents"], killed)
        whole = copy_workspace(killed, tmp_path / "whole")
        out = repro_killed_beside_whole(killed, whole, "teacher", tmp_path / "whole.log")
        assert "resumed from runs/teacher/checkpoint-" in out.stderr
        a = dcp_tensors(whole / "runs" / "teacher" / "checkpoint-6", ("roles.", "optimizers."))
        b = dcp_tensors(killed / "runs" / "teacher" / "checkpoint-6", ("roles.", "optimizers."))
        assert a.keys() == b.keys() and a
        for key in a:
            assert torch.equal(a[key], b[key]), key
        assert any(k.startswith("roles.student.transformer.transformer_2.") for k in a)  # one role, both experts in it
    assert read_log_steps(killed / "runs" / "teacher")[-1] == 6

    repo = killed
    model = repo / "artifacts" / "teacher" / "model"
    assert registry.family_of(repo / "artifacts" / "base" / "model").name == FAMILY[layout]
    assert registry.family_of(model).name == FAMILY[layout]  # the trained artifact tells its layout alone
    trained = registry.load_inference_model(model)
    base = registry.load_inference_model(repo / "artifacts" / "base" / "model")
    experts = (lambda m: list(m.transformer.experts)) if layout == "a14b" else (lambda m: [m.transformer])
    for after, before in zip(experts(trained), experts(base), strict=True):  # every expert trained
        assert any(not torch.equal(p, q) for p, q in zip(after.parameters(), before.parameters(), strict=True))

    # the export stage's folder: stock WanPipeline loads it (both experts, the model_index's boundary) and samples
    # what our euler sampler samples from the artifact
    export = tmp_path / "export"
    export.mkdir()
    assemble_export(repo / "artifacts" / "base" / "model", model, export)
    pipe = WanPipeline.from_pretrained(str(export), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if layout == "a14b":
        assert pipe.config.boundary_ratio == A14B_BOUNDARY_RATIO and pipe.transformer_2 is not None
        assert all(torch.equal(p, q) for p, q in zip(pipe.transformer_2.parameters(),
                                                     trained.transformer.transformer_2.parameters(), strict=True))
    else:
        assert pipe.config.expand_timesteps and pipe.vae.config.z_dim == TI2V_Z_DIM
    channels, scale = pipe.transformer.config.in_channels, pipe.vae_scale_factor_spatial
    shape = (channels, 5, 32 // scale, 32 // scale)
    noise = GeneratorNoise(torch.Generator().manual_seed(3)).randn((1, *shape), "cpu")
    expected = pipe(["a red circle moving left"], negative_prompt="", num_frames=17, height=32, width=32,
                    num_inference_steps=8, guidance_scale=3.0, max_sequence_length=32, latents=noise.clone(),
                    output_type="latent").frames
    enc = BaseEncoders(repo / "artifacts" / "base" / "model")
    rows = enc.encode_prompts(["a red circle moving left", ""])
    padded = torch.stack([torch.cat([r, r.new_zeros(enc.max_sequence_length - r.shape[0], r.shape[1])]) for r in rows])
    ours = build_sampler({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000}).sample(
        trained, Conditioning(padded[:1], padded[1:]), shape, torch.Generator().manual_seed(3), num_steps=8,
        guidance_scale=3.0, initial=noise)
    assert (ours - expected).abs().max().item() <= 1e-5

    # the trained artifact as a few-step student (its layout as training recorded it): the export stage's check accepts
    # it, its folder names its own pipeline, and that pipeline (both experts; per-token timesteps) samples our few-step
    # sampler's latents from the artifact bit for bit
    from diffusers import DiffusionPipeline

    from distillery.export.code import check_own_pipeline_samples

    few = tmp_path / "few-step"
    shutil.copytree(model, few / "model")
    contract = {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 880.0, 600.0]}
    (few / "model" / "sampling.json").write_text(json.dumps(contract))
    check_own_pipeline_samples("distill", few / "model")
    (few / "export").mkdir()
    assemble_export(repo / "artifacts" / "base" / "model", few / "model", few / "export")
    own = DiffusionPipeline.from_pretrained(str(few / "export"), trust_remote_code=True)
    assert type(own).__name__ == "DistilledWanPipeline" and (own.transformer_2 is not None) == (layout == "a14b")
    student = registry.load_inference_model(few / "model", shift=3.0)
    expected = build_sampler(contract).sample(student, Conditioning(padded[:1]), shape, torch.Generator().manual_seed(4))
    got = own(prompt_embeds=padded[:1], generator=torch.Generator().manual_seed(4), output_type="latent", num_frames=17,
              height=32, width=32).frames
    assert torch.equal(got, expected), (got - expected).abs().max()

    if layout == "a14b":  # a base with one expert missing: the teacher stage stops in one line before training
        broken = copy_workspace(killed, tmp_path / "broken")
        shutil.rmtree(broken / "artifacts" / "base" / "model" / "transformer_2")
        shutil.rmtree(broken / "runs" / "teacher")
        shutil.rmtree(broken / "artifacts" / "teacher")
        failed = stage(broken, "teacher")
        assert failed.returncode == 2, failed.stderr[-2000:]
        last = failed.stderr.strip().splitlines()[-1]
        assert "names a second expert (transformer_2)" in last and "Traceback" not in failed.stderr
        assert not (broken / "runs" / "teacher").exists() or not list((broken / "runs" / "teacher").glob("checkpoint-*"))


def test_the_base_stage_refuses_a_wan22_folder_with_one_expert_missing_before_copying(tmp_path):
    folder = make_tiny_wan22(tmp_path / "tiny-wan22-a14b", "a14b")
    shutil.rmtree(folder / "transformer_2")
    repo = make_workspace(tmp_path / "ws", {"base.path": str(folder)})
    failed = stage(repo, "base")
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert "Traceback" not in failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert "names a second expert (transformer_2)" in last and "needs both experts" in last
    assert not (repo / "artifacts" / "base").exists() and not list((repo / "artifacts").glob("base*"))
