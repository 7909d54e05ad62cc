"""Phased DMD through ``dvc repro`` on the tiny Wan 2.2 A14B (issue 63, item 2): ``base.path`` a two-expert folder,
the teacher the base itself (``teacher.source: base``) and the student given as that folder (``pretrain.source:
given``, as LightX2V starts its Phased DMD student from the base), ``distill.method: phased_dmd`` with the two guidance
scales (``distill.guidance_scale`` the high-noise expert's, ``distill.guidance_scale_2`` the low-noise one's).

- the teacher and pretrain artifacts keep both experts (``transformer_2`` inside ``transformer/``, byte for byte the
  folder's) and the boundary (issue 58 item 1's layout, still held through the recipes' stages);
- ``dvc repro distill`` trains both experts of the student and of the critic, the phases alternating by update block
  (high, then low), and publishes a two-expert artifact whose ``sampling.json`` is the ``few_step_x0`` ladder it
  trained (Euler between its steps, ``renoise: ode``) with a step on each side of the boundary;
- the export's folder of that artifact (the export stage's assembly) names its own pipeline, which loads both experts
  and samples validate's latents from the artifact bit for bit;
- the same DAG with a student of one expert given stops the distill stage in one line, exit 2, before any training.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import read_log
from workspace import make_workspace, set_params, sh, stage

from distillery.models import registry
from distillery.tinybase.wan22 import A14B_BOUNDARY_RATIO, make_tiny_wan22

pytestmark = pytest.mark.slow
BOUNDARY = A14B_BOUNDARY_RATIO * 1000


def _same_files(a, b) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return bool(files) and all((b / f).read_bytes() == (a / f).read_bytes() for f in files)


def test_phased_dmd_distils_a_two_expert_base_through_dvc_and_exports(tmp_path):
    from diffusers import DiffusionPipeline

    from distillery.data.encoders import BaseEncoders
    from distillery.models.base import Conditioning
    from distillery.sampling import build_sampler
    from stages.export import assemble_export

    a14b = make_tiny_wan22(tmp_path / "tiny-a14b", "a14b")
    repo = make_workspace(tmp_path / "ws", {
        "base.path": str(a14b), "teacher.source": "base", "pretrain.source": "given", "pretrain.path": str(a14b),
        "distill.method": "phased_dmd", "distill.steps": 4, "distill.batch_size": 2, "distill.save_every": 2,
        "distill.generator_update_interval": 1, "distill.guidance_scale": 4.0, "distill.guidance_scale_2": 3.0})
    sh(["dvc", "repro", "distill"], repo)

    for name in ("teacher", "pretrain"):  # the given folder's two experts and boundary, kept
        model = repo / "artifacts" / name / "model"
        config = json.loads((model / "transformer" / "config.json").read_text())
        assert config["_wan_layout"] == {"boundary_ratio": A14B_BOUNDARY_RATIO}, (name, config.get("_wan_layout"))
        assert _same_files(a14b / "transformer_2", model / "transformer" / "transformer_2"), name
        assert registry.family_of(model).name == "wan2.2-a14b"

    run = repo / "runs" / "distill"
    rows = read_log(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["phase"] for r in rows] == [0.0, 1.0, 0.0, 1.0]  # high, low, high, low (interval 1)
    run_yaml = (run / "run.yaml").read_text()
    assert "PhasedDMDMethod" in run_yaml and "real_score_guidance_scale_2: 3.0" in run_yaml

    model = repo / "artifacts" / "distill" / "model"
    assert registry.family_of(model).name == "wan2.2-a14b"
    contract = json.loads((model / "sampling.json").read_text())
    assert contract["sampler"] == "few_step_x0" and contract["renoise"] == "ode"
    ladder = contract["timesteps"]
    assert any(t >= BOUNDARY for t in ladder) and any(t < BOUNDARY for t in ladder), ladder
    student = registry.load_inference_model(model, shift=contract["shift"])
    before = registry.load_inference_model(a14b)
    for after, init in zip(student.transformer.experts, before.transformer.experts, strict=True):  # both experts trained
        assert any(not torch.equal(p, q) for p, q in zip(after.parameters(), init.parameters(), strict=True))
    lineage = json.loads((repo / "artifacts" / "distill" / "lineage.json").read_text())
    assert {i["role"]: i["path"] for i in lineage["inputs"]}["teacher_init"] == "artifacts/teacher"

    # the export stage's folder: its own pipeline (both experts) samples validate's latents from the artifact
    export = tmp_path / "export"
    export.mkdir()
    assemble_export(repo / "artifacts" / "base" / "model", model, export)
    own = DiffusionPipeline.from_pretrained(str(export), trust_remote_code=True)
    assert type(own).__name__ == "DistilledWanPipeline" and own.transformer_2 is not None
    enc = BaseEncoders(repo / "artifacts" / "base" / "model")
    rows = enc.encode_prompts(["a red circle moving left"])
    text = torch.cat([rows[0], rows[0].new_zeros(enc.max_sequence_length - rows[0].shape[0], rows[0].shape[1])])[None]
    side = 32 // own.vae_scale_factor_spatial
    shape = (own.transformer.config.in_channels, 5, side, side)
    expected = build_sampler(contract).sample(student, Conditioning(text), shape, torch.Generator().manual_seed(4))
    got = own(prompt_embeds=text, generator=torch.Generator().manual_seed(4), output_type="latent", num_frames=17,
              height=32, width=32).frames
    assert torch.equal(got, expected), (got - expected).abs().max()

    # a student of one expert (a Wan 2.1 folder given): the distill stage's line, exit 2, before anything is launched
    from distillery.tinybase.tiny import make_tiny_base

    set_params(repo, {"pretrain.path": str(make_tiny_base(tmp_path / "tiny-wan", seed=0))})
    stage(repo, "pretrain", check=True)
    checkpoints = sorted(p.name for p in run.glob("checkpoint-*"))
    failed = stage(repo, "distill")
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert "Traceback" not in failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert "models.student: Phased DMD distils each expert on its own phase" in last and "one expert" in last, last
    assert sorted(p.name for p in run.glob("checkpoint-*")) == checkpoints  # nothing trained, nothing discarded
