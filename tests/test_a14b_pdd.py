"""PDD students of two experts (Wan 2.2 A14B, issue 63 item 2): a head bank per expert (``ExpertHeadBanks``), each
block start's forward through the expert of its timestep and projected by that expert's heads; PDD trains both
experts and both banks; the bank's file holds both; the export's shipped sampler samples it as the package does and
the 1-NFE fused transformer is the high-noise expert's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import nudge_weights, run_config, train_in_process

from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.pdd import PDDConfig, PDDMethod
from distillery.models import registry
from distillery.models.base import Conditioning, HeadGroup
from distillery.models.wan import WanModel, WanModelConfig
from distillery.models.wan.pdd import HEADS_FILE, ExpertHeadBanks, PDDWanModel, PDDWanModelConfig, read_head_bank
from distillery.sampling import build_sampler
from distillery.tinybase.wan22 import A14B_BOUNDARY_RATIO

BOUNDARY = A14B_BOUNDARY_RATIO * 1000
P = 4  # fine-grid intervals: at shift 3 the nodes are 1000, 900, 750, 500, 0 — two above the boundary, two below


def student(folder: Path, trainable: bool = True) -> PDDWanModel:
    model = PDDWanModel(PDDWanModelConfig(init_from=str(folder), trainable=trainable, pdd_steps=P), "student")
    model.bind_device(torch.device("cpu"))
    with torch.no_grad():  # every head of both banks its own
        for j, w in enumerate([*model.head_bank.weight, *model.head_bank.second.weight]):
            w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(j)))
    return model


def test_each_row_is_projected_by_its_experts_heads(a14b):
    model = student(a14b, trainable=False)
    assert isinstance(model.head_bank, ExpertHeadBanks) and model.boundary_timestep == BOUNDARY
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(2, 8, 3, 8, 8, generator=g), torch.randn(2, 6, 32, generator=g)
    t = torch.tensor([1000.0, 500.0])  # row 0 the high-noise expert's, row 1 the low-noise one's
    with torch.no_grad():
        out = model.predict_head_groups(x, t, Conditioning(text), [HeadGroup([0, 2])])[0]
    reference = WanModel(WanModelConfig(init_from=str(a14b), trainable=False), "ref")
    for row, (expert, bank) in enumerate(((0, model.head_bank), (1, model.head_bank.second))):
        module = reference.transformer.experts[expert]
        for col, k in enumerate((0, 2)):
            with torch.no_grad():
                module.proj_out.weight.copy_(bank.weight[k])
                module.proj_out.bias.copy_(bank.bias[k])
                want = module(hidden_states=x[row:row + 1], timestep=t[row:row + 1], encoder_hidden_states=text[row:row + 1],
                              return_dict=False)[0]
            torch.testing.assert_close(out[row:row + 1, col], want.float(), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def training(a14b, latent_set):
    return load_run_config(raw=run_config(a14b, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def test_a_pdd_step_trains_both_experts_and_their_heads(a14b, training):
    teacher = WanModel(WanModelConfig(init_from=str(a14b), trainable=False), "teacher")
    teacher.bind_device(torch.device("cpu"))
    nudge_weights(teacher.transformer)
    model = student(a14b)
    method = PDDMethod(PDDConfig(block_size_max=2, teacher_guidance_scale=3.0, teacher_guidance_scale_2=1.5),
                       {"student": model, "teacher": teacher}, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    draws = iter([[0.1, 0.9], [0.6, 0.6]])  # row 0 starts at node 0 (t = 1000), row 1 at node 3 (t = 500)
    method.global_uniforms = lambda rows: next(draws)
    g = torch.Generator().manual_seed(0)
    batch = {"latents": torch.randn(2, 8, 3, 8, 8, generator=g), "text_embeds": torch.randn(2, 8, 32, generator=g),
             "empty_text_embeds": torch.randn(8, 32, generator=g)}
    out = method.single_train_step(batch, step=1)
    out.losses["total_loss"].backward()
    bank = model.head_bank
    # row 0 supervised head 1 through the high expert's bank, row 1 head 3 through the low expert's
    assert bank.weight[1].grad is not None and bank.weight[1].grad.abs().sum() > 0
    assert bank.second.weight[3].grad is not None and bank.second.weight[3].grad.abs().sum() > 0
    assert bank.second.weight[1].grad is None or bank.second.weight[1].grad.abs().sum() == 0
    for expert in model.transformer.experts:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in expert.blocks.parameters())


def _model_dir(a14b: Path, out: Path, model: PDDWanModel, contract: dict) -> Path:
    from distillery.models.wan.pdd import save_head_bank

    model.transformer.save_pretrained(out / "transformer", safe_serialization=True)
    save_head_bank(out / "transformer" / HEADS_FILE, model.head_bank)
    shutil.copytree(a14b / "scheduler", out / "scheduler")
    (out / "sampling.json").write_text(json.dumps(contract))
    return out


def test_the_bank_file_holds_both_experts_and_the_shipped_sampler_samples_as_the_package(a14b, tmp_path):
    from helpers import shipped_denoiser

    from distillery.export.standalone import distilled_samplers, distilled_wan

    model = student(a14b, trainable=False)
    contract = {"sampler": "pdd_fused", "shift": 3.0, "num_train_timesteps": 1000, "pdd_steps": P, "block_size_max": 2,
                "num_steps": 2}
    folder = _model_dir(a14b, tmp_path / "model", model, contract)
    for expert, bank in enumerate((model.head_bank, model.head_bank.second)):
        weight, _ = read_head_bank(folder / "transformer" / HEADS_FILE, expert)
        assert torch.equal(weight[2], bank.weight[2].detach())
    loaded = registry.load_inference_model(folder, shift=3.0, pdd_steps=P)
    assert torch.equal(loaded.head_bank.second.weight[3], model.head_bank.second.weight[3].detach())
    gen = torch.Generator().manual_seed(4)
    text, negative = torch.randn(2, 6, 32, generator=gen), torch.randn(2, 6, 32, generator=gen)
    expected = build_sampler(contract).sample(loaded, Conditioning(text, negative), (8, 3, 4, 4),
                                              torch.Generator().manual_seed(5), guidance_scale=3.0, guidance_scale_2=2.0)
    shipped = distilled_samplers.build_sampler(contract)
    got = shipped.sample(shipped_denoiser(folder, shipped.model_kind()), distilled_wan.Conditioning(text, negative),
                         (8, 3, 4, 4), torch.Generator().manual_seed(5), guidance_scale=3.0, guidance_scale_2=2.0)
    assert torch.equal(got, expected)


def test_the_one_nfe_fused_transformer_is_the_high_noise_experts(a14b):
    """The whole grid in one block starts at t = 1000: the high-noise expert's heads fused into its ``proj_out`` give
    stock one-step Euler over the two experts the 1-NFE fused sample (the low-noise expert never runs)."""
    model = student(a14b, trainable=False)
    cond = Conditioning(torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(2)))
    fused = build_sampler({"sampler": "pdd_fused", "shift": 3.0, "pdd_steps": P}).sample(
        model, cond, (8, 3, 4, 4), torch.Generator().manual_seed(0), num_steps=1)
    plain = WanModel(WanModelConfig(init_from=str(a14b), trainable=False), "plain")
    model.fuse_into_projection(plain.transformer, 0, P)
    euler = build_sampler({"sampler": "euler", "shift": 3.0}).sample(plain, cond, (8, 3, 4, 4),
                                                                     torch.Generator().manual_seed(0), num_steps=1)
    torch.testing.assert_close(euler, fused, rtol=0, atol=1e-5)


def test_pdd_trains_two_experts_through_the_trainer_and_exports_both_banks(a14b, latent_set, tmp_path):
    from distillery.export.weights import export_weights

    cfg = run_config(a14b, latent_set, tmp_path / "run", method="distillery.methods.pdd.PDDMethod", steps=2, batch_size=4,
                     save_every=2, method_knobs={"rollout": "simulate", "block_size_max": 2, "sampling_steps": 2})
    cfg["models"]["student"] = {"_target_": "distillery.models.wan.PDDWanModel", "init_from": str(a14b), "pdd_steps": P}
    cfg["models"]["teacher"] = {"_target_": "distillery.models.wan.WanModel", "init_from": str(a14b), "trainable": False}
    result = train_in_process(cfg)
    out = export_weights(result.checkpoint, "student", tmp_path / "model")
    shutil.copytree(a14b / "scheduler", tmp_path / "model" / "scheduler")
    assert (out / "transformer_2" / "config.json").is_file() and (out / HEADS_FILE).is_file()
    plugin = registry.load_inference_model(tmp_path / "model", pdd_steps=P)
    start = student(a14b)
    moved = [any(not torch.equal(a, b) for a, b in zip(after.weight, before.weight))
             for after, before in ((plugin.head_bank, start.head_bank), (plugin.head_bank.second, start.head_bank.second))]
    assert moved == [True, True]
