"""Wan 2.2 A14B's second guidance scale (issue 63, item 2): ``guidance_scale`` for the high-noise expert's steps
(``t >= boundary_ratio · num_train_timesteps``), ``guidance_scale_2`` for the low-noise expert's, as diffusers'
``WanPipeline`` applies them — in our samplers, the export's shipped samplers, the teacher's real score (DMD2,
Self-Forcing), PDD's targets and the ODE-init trajectories; refused in one line where it has no meaning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from distillery.common.errors import UserError
from distillery.models import registry
from distillery.models.base import Conditioning
from distillery.tinybase.wan22 import A14B_BOUNDARY_RATIO

BOUNDARY = A14B_BOUNDARY_RATIO * 1000


def _stock_and_ours(folder: Path, guidance: float, guidance_2: float | None, steps: int = 10):
    from diffusers import WanPipeline

    from distillery.data.encoders import BaseEncoders
    from distillery.sampling import GeneratorNoise, build_sampler

    pipe = WanPipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    shape = (8, 5, 32 // pipe.vae_scale_factor_spatial, 32 // pipe.vae_scale_factor_spatial)
    prompts = ["a red circle moving left", "a blue square moving up"]
    noise = GeneratorNoise(torch.Generator().manual_seed(7)).randn((2, *shape), "cpu")
    expected = pipe(prompts, negative_prompt="", num_frames=17, height=32, width=32, num_inference_steps=steps,
                    guidance_scale=guidance, guidance_scale_2=guidance_2, max_sequence_length=32,
                    latents=noise.clone(), output_type="latent").frames
    enc = BaseEncoders(folder)
    rows = enc.encode_prompts([*prompts, "", ""])
    padded = torch.stack([torch.cat([r, r.new_zeros(enc.max_sequence_length - r.shape[0], r.shape[1])]) for r in rows])
    model = registry.load_inference_model(folder)
    contract = {"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000}
    if guidance_2 is not None:
        contract["guidance_scale_2"] = guidance_2
    ours = build_sampler(contract).sample(model, Conditioning(padded[:2], padded[2:]), shape, torch.Generator(),
                                          num_steps=steps, guidance_scale=guidance, initial=noise)
    return expected, ours, (model, padded, shape, noise)


@pytest.mark.parametrize("guidance,guidance_2", [(4.0, 3.0), (4.0, 1.0), (2.0, 6.0)])
def test_per_expert_guidance_is_stock_wanpipeline_with_guidance_scale_2(a14b, guidance, guidance_2):
    """The same folder, prompts and noise: our Euler sampler with ``guidance_scale_2`` in its contract gives stock
    ``WanPipeline(..., guidance_scale=w, guidance_scale_2=w2)``'s latents (10 steps of shift 3 cross the boundary;
    w2 = 1 still runs CFG at the low-noise steps, as the pipeline does when w > 1)."""
    expected, ours, (model, padded, shape, noise) = _stock_and_ours(a14b, guidance, guidance_2)
    assert (ours - expected).abs().max().item() <= 1e-5
    # the second scale took part: one scale for both experts gives other latents
    from distillery.sampling import build_sampler

    one = build_sampler({"sampler": "euler", "shift": 3.0}).sample(model, Conditioning(padded[:2], padded[2:]), shape,
                                                                   torch.Generator(), num_steps=10, guidance_scale=guidance,
                                                                   initial=noise)
    assert (one - expected).abs().max().item() > 1e-4


def test_the_call_overrides_the_contracts_second_scale_and_each_step_takes_its_experts(a14b):
    """``guidance_scale_2`` of a call beats the contract's; each step's scale is its expert's (a hook records the
    step's timestep; the scale follows ``t >= boundary``)."""
    from distillery.sampling import build_sampler
    from distillery.sampling.base import expert_guidance

    model = registry.load_inference_model(a14b)
    guidance = expert_guidance(model, 4.0, 3.0, "euler")
    assert guidance.enabled and guidance.scale_at(BOUNDARY) == 4.0 and guidance.scale_at(BOUNDARY - 0.5) == 3.0
    sampler = build_sampler({"sampler": "few_step_x0", "shift": 3.0, "timesteps": [1000.0, 875.0, 500.0],
                             "guidance_scale": 4.0, "guidance_scale_2": 1.5})
    cond = Conditioning(torch.randn(1, 6, 32), torch.randn(1, 6, 32))
    noise = torch.randn(1, 8, 3, 4, 4)
    by_contract = sampler.sample(model, cond, (8, 3, 4, 4), torch.Generator().manual_seed(0), initial=noise)
    by_call = sampler.sample(model, cond, (8, 3, 4, 4), torch.Generator().manual_seed(0), initial=noise, guidance_scale_2=1.5)
    other = sampler.sample(model, cond, (8, 3, 4, 4), torch.Generator().manual_seed(0), initial=noise, guidance_scale_2=2.5)
    assert torch.equal(by_contract, by_call) and not torch.equal(by_contract, other)


def test_a_second_scale_where_it_means_nothing_is_one_line(a14b, tiny_base):
    from distillery.sampling import build_sampler

    one = registry.load_inference_model(tiny_base)
    sampler = build_sampler({"sampler": "euler", "shift": 3.0, "guidance_scale_2": 3.0})
    cond = Conditioning(torch.randn(1, 6, 32), torch.randn(1, 6, 32))
    with pytest.raises(UserError, match="guidance_scale_2 is the low-noise expert's CFG scale; WanModel is a model of one"):
        sampler.sample(one, cond, (8, 3, 4, 4), torch.Generator(), num_steps=2, guidance_scale=4.0)
    two = registry.load_inference_model(a14b)
    with pytest.raises(UserError, match=r"guidance_scale_2 3 with guidance_scale 1: CFG runs only when guidance_scale > 1"):
        sampler.sample(two, cond, (8, 3, 4, 4), torch.Generator(), num_steps=2, guidance_scale=1.0)
    with pytest.raises(UserError, match="guidance_scale_2 must be >= 0"):
        build_sampler({"sampler": "euler", "guidance_scale_2": -1.0})


def test_the_shipped_samplers_apply_the_second_scale_as_the_package_does(a14b, tmp_path):
    """The export's own samplers over the folder's two experts give the package's latents bit for bit with a
    ``guidance_scale_2`` (Euler with CFG, and a few-step ladder crossing the boundary)."""
    from helpers import shipped_denoiser

    from distillery.export.standalone import distilled_samplers, distilled_wan
    from distillery.sampling import build_sampler

    model_dir = tmp_path / "model"
    shutil.copytree(a14b / "transformer", model_dir / "transformer")
    shutil.copytree(a14b / "transformer_2", model_dir / "transformer" / "transformer_2")
    cfg = json.loads((model_dir / "transformer" / "config.json").read_text())
    cfg["_wan_layout"] = {"boundary_ratio": A14B_BOUNDARY_RATIO}
    (model_dir / "transformer" / "config.json").write_text(json.dumps(cfg))
    shutil.copytree(a14b / "scheduler", model_dir / "scheduler")
    gen = torch.Generator().manual_seed(3)
    text, negative = torch.randn(2, 6, 32, generator=gen), torch.randn(2, 6, 32, generator=gen)
    for contract, steps in (({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000, "guidance_scale": 4.0,
                              "guidance_scale_2": 3.0}, 6),
                            ({"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "renoise": "ode",
                              "timesteps": [1000.0, 900.0, 875.0, 500.0], "guidance_scale": 4.0, "guidance_scale_2": 2.0},
                             None)):
        (model_dir / "sampling.json").write_text(json.dumps(contract))
        package = build_sampler(contract)
        plugin = registry.load_inference_model(model_dir, shift=package.shift)
        expected = package.sample(plugin, Conditioning(text, negative), (8, 5, 4, 4), torch.Generator().manual_seed(5),
                                  num_steps=steps)
        shipped = distilled_samplers.build_sampler(contract)
        got = shipped.sample(shipped_denoiser(model_dir, shipped.model_kind()), distilled_wan.Conditioning(text, negative),
                             (8, 5, 4, 4), torch.Generator().manual_seed(5), num_steps=steps)
        assert torch.equal(got, expected), contract["sampler"]


def test_the_teachers_real_score_takes_each_samples_experts_scale(a14b):
    """DMD2's real score (and so Self-Forcing's, DM-PDD's) and PDD's target: a sample whose τ is the low-noise expert's
    is guided by the second scale, the others by the first — the same as guiding each sample alone with its scale."""
    from distillery.methods.base import guided_by_scales, teacher_scales

    teacher = registry.load_inference_model(a14b)
    g = torch.Generator().manual_seed(1)
    x, text, neg = torch.randn(3, 8, 3, 4, 4, generator=g), torch.randn(3, 6, 32, generator=g), torch.randn(3, 6, 32, generator=g)
    t = torch.tensor([950.0, BOUNDARY - 1.0, 300.0])
    cond = Conditioning(text, neg)
    scales = teacher_scales(teacher, t, 4.0, 3.0)
    assert scales.tolist() == [4.0, 3.0, 3.0]
    got = guided_by_scales(lambda c: teacher.predict_x0(x, t, cond, conditional=c), scales)
    for i, w in enumerate((4.0, 3.0, 3.0)):
        c = teacher.predict_x0(x[i:i + 1], t[i:i + 1], Conditioning(text[i:i + 1], neg[i:i + 1]))
        u = teacher.predict_x0(x[i:i + 1], t[i:i + 1], Conditioning(text[i:i + 1], neg[i:i + 1]), conditional=False)
        torch.testing.assert_close(got[i:i + 1], u + w * (c - u), rtol=0, atol=1e-5)  # batch-size rounding only
    assert teacher_scales(teacher, t, 4.0, None) == 4.0  # one scale: the float, the code path of before


@pytest.mark.parametrize("method,key", [("distillery.methods.dmd2.DMD2Method", "real_score_guidance_scale_2"),
                                        ("distillery.methods.pdd.PDDMethod", "teacher_guidance_scale_2")])
def test_a_second_scale_for_a_one_expert_teacher_is_one_line(tiny_base, latent_set, tmp_path, method, key):
    from helpers import run_config, train_in_process

    cfg = run_config(tiny_base, latent_set, tmp_path / "run", method=method, method_knobs={key: 3.0}, steps=1)
    wan = "distillery.models.wan.WanModel"
    cfg["models"]["teacher"] = {"_target_": wan, "init_from": str(tiny_base), "trainable": False}
    if method.endswith("DMD2Method"):
        cfg["models"]["critic"] = {"_target_": wan, "init_from": str(tiny_base)}
    else:
        cfg["models"]["student"] = {"_target_": "distillery.models.wan.PDDWanModel", "init_from": str(tiny_base), "pdd_steps": 4}
        cfg["method"]["block_size_max"] = 4
    with pytest.raises(UserError, match=f"method.{key}: the low-noise expert's guidance scale; models.teacher is a model of one"):
        train_in_process(cfg)
