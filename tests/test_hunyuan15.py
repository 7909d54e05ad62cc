"""The HunyuanVideo 1.5 family (models/hunyuan15/): the plugin's mapping onto our flow convention against stock diffusers'
``HunyuanVideo15Pipeline`` on the same inputs, its two prompt streams, the pipeline's σ grid, a training step, PDD, the
tiny base and its refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from distillery.common.errors import UserError
from distillery.components.prompt_streams import pack_streams, split_streams
from distillery.components.rng import BatchRNG
from distillery.models import registry
from distillery.models.base import Conditioning
from distillery.sampling import build_sampler

PROMPT = 'a red circle moving left with a sign saying "hello"'  # a quoted text: the glyph stream has tokens
SHAPE = (8, 3, 4, 4)  # the tiny HunyuanVideo 1.5's latents of 9 × 64 × 64 frames
TEXT = 24  # its prompt width: Qwen2.5-VL 16 + ByT5 8


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from distillery.tinybase.hunyuan15 import make_tiny_hunyuan15

    return make_tiny_hunyuan15(tmp_path_factory.mktemp("hy15") / "tiny-hunyuan15")


@pytest.fixture(scope="module")
def stock(base):
    from diffusers import HunyuanVideo15Pipeline

    return HunyuanVideo15Pipeline.from_pretrained(base)


@pytest.fixture(scope="module")
def encoded(stock):
    """The stock pipeline's streams ``(embeds, mask, embeds_2, mask_2)`` of the prompt and of the empty one."""
    with torch.no_grad():
        return stock.encode_prompt(PROMPT, device="cpu"), stock.encode_prompt(None, device="cpu", batch_size=1)


def packed(streams) -> torch.Tensor:
    """The stock pipeline's two streams of one prompt, side by side as distillery stores them ``[1, 1000, 24]``."""
    embeds, mask, embeds_2, mask_2 = streams
    one = pack_streams([(embeds[0], mask[0]), (embeds_2[0], mask_2[0])])
    return torch.nn.functional.pad(one, (0, 0, 0, 1000 - one.shape[0]))[None]


def test_prompt_embeddings_are_the_stock_pipelines_own_streams_side_by_side(base, encoded):
    from distillery.data.encoders import BaseEncoders

    encoders = BaseEncoders(base)
    assert encoders.text_dim == TEXT and encoders.z_dim == 8 and (encoders.temporal_factor, encoders.spatial_factor) == (4, 16)
    assert encoders.text_streams == (("Qwen2_5_VLTextModel", 16, 1000), ("T5EncoderModel", 8, 256))
    prompt, empty = encoders.encode_prompts([PROMPT, ""])
    (embeds, mask, embeds_2, mask_2), negative = encoded
    n, n2 = int(mask.sum()), int(mask_2.sum())
    assert n2 > 0 and prompt.shape == (max(n, n2), TEXT)  # trimmed to the longer stream's real tokens
    assert torch.equal(prompt[:n, :16], embeds[0, :n]) and not prompt[n:, :16].any()
    assert torch.equal(prompt[:n2, 16:], embeds_2[0, :n2]) and not prompt[n2:, 16:].any()
    assert torch.equal(empty, packed(negative)[0, :empty.shape[0]]) and not empty[:, 16:].any()  # no quoted text
    (qwen, qwen_mask), (glyph, glyph_mask) = split_streams(packed(encoded[0]), (16, 8), (1000, 256))
    assert torch.equal(qwen_mask, mask.long()) and torch.equal(glyph_mask, mask_2.long())
    assert torch.equal(qwen, embeds * mask[..., None]) and torch.equal(glyph, embeds_2 * mask_2[..., None])


def test_the_sigma_grid_is_the_pipelines_for_any_step_count(stock):
    """``linspace``: ``set_timesteps(sigmas=linspace(1, 0, n + 1)[:-1])`` as HunyuanVideo15Pipeline calls it — and LTX-2's
    ``linspace(1, 1/n, n)``, the same float32 grid."""
    from distillery.models.schedule import FlowMatchSchedule

    scheduler = stock.scheduler
    for steps in (1, 2, 3, 7, 40, 50):
        ours = FlowMatchSchedule(shift=5.0, sigma_grid="linspace")
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], device="cpu")
        assert torch.equal(ours.inference_sigmas(steps), scheduler.sigmas)
        assert torch.equal(ours.inference_timesteps(steps), scheduler.timesteps)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps), device="cpu")
        assert torch.equal(ours.inference_sigmas(steps), scheduler.sigmas)
    assert ours.contract() == {"shift": 5.0, "num_train_timesteps": 1000, "sigma_grid": "linspace"}


@pytest.mark.parametrize("guidance", [1.0, 6.0])
def test_euler_sampling_is_the_stock_pipeline_on_the_same_inputs(base, stock, encoded, guidance):
    """Our euler sampler over the plugin (the pipeline's σ grid, its 65-channel input with zeros, zero image tokens, two
    masked streams) against the stock pipeline with its guider at ``guidance``, the same noise and prompt streams: bit
    for bit (the guider's CFG is ours)."""
    model = registry.load_inference_model(base)
    assert model.schedule.sigma_grid == "linspace" and model.schedule.shift == 5.0
    sampler = build_sampler({"sampler": "euler", **model.schedule.contract()})
    ours = sampler.sample(model, Conditioning(packed(encoded[0]), packed(encoded[1])), SHAPE,
                          torch.Generator().manual_seed(0), num_steps=3, guidance_scale=guidance)
    (embeds, mask, embeds_2, mask_2), (neg, neg_mask, neg_2, neg_mask_2) = encoded
    stock.guider = stock.guider.new(guidance_scale=guidance)
    noise = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(0))
    theirs = stock(prompt_embeds=embeds, prompt_embeds_mask=mask, prompt_embeds_2=embeds_2, prompt_embeds_mask_2=mask_2,
                   negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask, negative_prompt_embeds_2=neg_2,
                   negative_prompt_embeds_mask_2=neg_mask_2, num_frames=9, height=64, width=64, num_inference_steps=3,
                   latents=noise, output_type="latent").frames
    assert ours.abs().mean() > 0.1
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()


def test_the_pipelines_constants_are_the_plugins(stock):
    from distillery.components.prompt_streams import hunyuan15_budgets
    from distillery.models.hunyuan15.common import IMAGE_TOKENS

    assert hunyuan15_budgets() == (stock.tokenizer_max_length, stock.tokenizer_2_max_length)
    assert IMAGE_TOKENS == stock.vision_num_semantic_tokens


def test_per_frame_timesteps_must_agree_across_frames(base):
    model = registry.load_inference_model(base)
    x = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(1))
    cond = Conditioning(torch.randn(2, 8, TEXT, generator=torch.Generator().manual_seed(2)))
    t = torch.tensor([700.0, 250.0])
    with torch.no_grad():
        assert torch.equal(model.predict_noise(x, t, cond), model.predict_noise(x, t[:, None].expand(-1, SHAPE[1]), cond))
        with pytest.raises(ValueError, match="one timestep"):
            model.predict_noise(x, torch.tensor([[700.0, 700.0, 10.0], [250.0] * 3]), cond)


def test_a_training_step_reaches_every_block_of_the_transformer(base):
    from distillery.models.hunyuan15 import HunyuanVideo15Model, HunyuanVideo15ModelConfig

    model = HunyuanVideo15Model(HunyuanVideo15ModelConfig(init_from=str(base)), role="student")
    raw = {"latents": torch.randn(2, *SHAPE), "text_embeds": torch.randn(2, 8, TEXT)}
    batch = model.prepare_batch(raw, BatchRNG(0))
    v = model.predict_noise(batch.noisy_latents, batch.timesteps, batch)
    model.backward(torch.nn.functional.mse_loss(v, batch.noise - batch.latents))
    blocks = model.shardable_blocks()

    def reached(block, skip=()):
        return all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in block.named_parameters()
                   if p.requires_grad and not n.startswith(skip))

    # the last dual-stream block's prompt queries and what follows them feed nothing (diffusers drops that stream)
    assert len(blocks) == 2 and reached(blocks[0]) and reached(blocks[-1], ("ff_context", "attn.to_add_out", "attn.add_q_proj", "attn.norm_added_q"))
    assert registry.family_of(base).loaders().input_widths(model.transformer_config()) == (8, TEXT)
    with pytest.raises(UserError, match="empty prompt") as info:  # an unconditional pass needs the empty prompt's streams
        model.predict_noise(batch.noisy_latents, batch.timesteps, batch, conditional=False)
    assert "\n" not in str(info.value)


def test_a_pdd_student_trains_its_heads_and_the_trunk_and_fuses_into_proj_out(base, tmp_path):
    """The head bank (every family's, models/wan/pdd.py) over the HunyuanVideo 1.5 trunk: heads with a bias as its
    proj_out; each head starts as the plain model (to float rounding); one PDD step reaches the supervised heads and the trunk only; the fused
    block is one stock transformer's output; the saved bank loads back."""
    from helpers import nudge_weights, run_config

    from distillery.config import allowed_prefixes, load_run_config
    from distillery.methods.pdd import PDDConfig, PDDMethod
    from distillery.models.hunyuan15 import (
        HunyuanVideo15Model,
        HunyuanVideo15ModelConfig,
        PDDHunyuanVideo15Model,
        PDDHunyuanVideo15ModelConfig,
    )
    from distillery.models.wan.pdd import HEADS_FILE, save_head_bank

    student = PDDHunyuanVideo15Model(PDDHunyuanVideo15ModelConfig(init_from=str(base), pdd_steps=4), "student")
    teacher = HunyuanVideo15Model(HunyuanVideo15ModelConfig(init_from=str(base), trainable=False), "teacher")
    bank = student.head_bank
    assert bank.has_bias and student.fine_sigmas().tolist() == teacher.schedule.inference_sigmas(4).tolist()
    x = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(4))
    cond = Conditioning(torch.randn(1, 8, TEXT, generator=torch.Generator().manual_seed(5)))
    t = torch.tensor([600.0])
    with torch.no_grad():
        plain = teacher.predict_noise(x, t, cond)
        heads = student.predict_pdd_heads(x, t, cond)
    assert heads.shape == (1, 4, *SHAPE)
    for k in range(4):  # one wider matmul of the 4 heads (and their bias): proj_out's output up to its rounding
        torch.testing.assert_close(heads[:, k], plain, rtol=0, atol=1e-6)

    training = load_run_config(raw=run_config(base, tmp_path / "unused", tmp_path / "unused"), prefixes=allowed_prefixes()).training
    for model in (student, teacher):
        model.bind_device(torch.device("cpu"))
    nudge_weights(teacher.transformer)
    g = torch.Generator().manual_seed(0)
    raw = {"latents": torch.randn(2, *SHAPE, generator=g), "text_embeds": torch.randn(2, 8, TEXT, generator=g),
           "empty_text_embeds": torch.randn(8, TEXT, generator=g)}
    method = PDDMethod(PDDConfig(block_size_max=4), {"student": student, "teacher": teacher}, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    method.backward(method.single_train_step(raw, step=1))
    supervised = [k for k in range(4) if bank.weight[k].grad is not None]
    assert supervised and all(float(bank.weight[k].grad.abs().max()) > 0 for k in supervised)
    assert student.transformer.proj_out.weight.grad is None
    last = f"transformer_blocks.{len(student.shardable_blocks()) - 1}."  # its prompt stream's outputs feed nothing
    assert all(p.grad is not None for n, p in student.transformer.named_parameters()
               if not n.startswith(("proj_out", last + "attn.to_add_out", last + "ff_context")))

    with torch.no_grad():
        for k in range(4):
            bank.weight[k].add_(0.01 * (k + 1))
            bank.bias[k].add_(0.01 * k)
        fused = student.predict_pdd_fused(x, t, cond, 0, 4)
        stock = HunyuanVideo15Model(HunyuanVideo15ModelConfig(init_from=str(base), trainable=False), "stock")
        student.fuse_into_projection(stock.transformer, 0, 4)
        torch.testing.assert_close(stock.predict_noise(x, t, cond), fused, rtol=0, atol=1e-6)
    folder = tmp_path / "pdd"
    shutil.copytree(base, folder)
    save_head_bank(folder / "transformer" / HEADS_FILE, bank)
    loaded = registry.load_inference_model(folder, pdd_steps=4)
    assert type(loaded) is PDDHunyuanVideo15Model
    assert all(torch.equal(loaded.head_bank.weight[k], bank.weight[k]) and torch.equal(loaded.head_bank.bias[k], bank.bias[k])
               for k in range(4))


def test_what_the_family_does_not_train_is_one_line(base, tmp_path):
    """A causal student (the dual-stream blocks), a MeanFlow super-resolution transformer, an image-to-video pipeline's
    folder: each one line."""
    with pytest.raises(UserError, match="causal HunyuanVideo 1.5 student is not built") as info:
        registry.load_inference_model(base, chunk_size=1)
    assert "\n" not in str(info.value)
    meanflow = tmp_path / "meanflow"
    shutil.copytree(base, meanflow)
    config = json.loads((meanflow / "transformer" / "config.json").read_text())
    (meanflow / "transformer" / "config.json").write_text(json.dumps({**config, "use_meanflow": True}))
    with pytest.raises(UserError, match="MeanFlow") as info:
        registry.load_inference_model(meanflow)
    assert "\n" not in str(info.value)
    other = tmp_path / "i2v"
    shutil.copytree(base, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "HunyuanVideo15ImageToVideoPipeline"}))
    with pytest.raises(UserError, match="unknown layout.*HunyuanVideo15ImageToVideoPipeline"):
        registry.family_of(other)


@pytest.mark.process
def test_the_tiny_hunyuan15_maker_command_is_deterministic(base, tmp_path, capsys):
    """``distillery base make-tiny --family hunyuan15`` (its command, in process) writes the same bytes as the maker the
    tests use; the tiny Wan's options with it are one line, exit 2."""
    from distillery.cli.main import main

    made = tmp_path / "tiny-hunyuan15"
    assert main(["base", "make-tiny", "--family", "hunyuan15", "--out", str(made), "--seed", "0"]) == 0
    assert main(["base", "make-tiny", "--family", "hunyuan15", "--fit", "--out", str(tmp_path / "other")]) == 2
    assert "--family hunyuan15" in capsys.readouterr().err and not (tmp_path / "other").exists()
    for part in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                 "text_encoder_2/model.safetensors", "tokenizer/tokenizer.json", "vae/diffusion_pytorch_model.safetensors",
                 "model_index.json", "scheduler/scheduler_config.json", "guider/guider_config.json"):
        assert (made / part).read_bytes() == (base / part).read_bytes(), part


def test_the_tiny_hunyuan15_is_a_base_the_pipeline_takes(base):
    from distillery.pipeline.publish.base_folder import check_model_index

    check_model_index(base, "base")  # library classes of HunyuanVideo15Pipeline (its guider included)


TEACHER = {"sampler": "euler", "shift": 5.0, "num_train_timesteps": 1000, "sigma_grid": "linspace"}
STUDENT = {"sampler": "few_step_x0", "shift": 5.0, "num_train_timesteps": 1000, "sigma_grid": "linspace",
           "timesteps": [1000.0, 750.0, 500.0]}
PDD = {"sampler": "pdd_fused", "shift": 5.0, "num_train_timesteps": 1000, "sigma_grid": "linspace", "pdd_steps": 4,
       "block_size_max": 4, "num_steps": 2, "guidance_scale": 1.0}


def _trained(base, out, contract):
    """A trained HunyuanVideo 1.5 role's ``model/`` as a training stage writes it: the tiny transformer moved off the
    base (seeded noise), the scheduler, ``contract`` as ``sampling.json`` (a PDD one: proj_out + seeded noise per head)."""
    from helpers import nudge_weights

    model = registry.load_inference_model(base)
    nudge_weights(model.transformer)
    model.transformer.save_pretrained(out / "transformer", safe_serialization=True)
    shutil.copytree(base / "scheduler", out / "scheduler")
    (out / "sampling.json").write_text(json.dumps(contract))
    if contract["sampler"] == "pdd_fused":
        from distillery.models.wan.pdd import HEADS_FILE, write_head_bank

        w, b = model.transformer.proj_out.weight.detach().float(), model.transformer.proj_out.bias.detach().float()
        g = torch.Generator().manual_seed(3)
        write_head_bank(out / "transformer" / HEADS_FILE, w + 0.02 * torch.randn(4, *w.shape, generator=g),
                        b + 0.02 * torch.randn(4, *b.shape, generator=g))
    return out


@pytest.mark.process
@pytest.mark.parametrize("stage,contract,guidance", [("teacher", TEACHER, 4.0), ("distill", STUDENT, None), ("pdd", PDD, None)])
def test_an_exported_hunyuan15_model_samples_validates_latents_through_diffusers(base, tmp_path, stage, contract, guidance):
    """Validate samples a trained HunyuanVideo 1.5 role; the export stage's assembly gives a folder that passes
    ``lineage --verify``; the teacher's loads in stock ``HunyuanVideo15Pipeline`` (its guider at validate's guidance)
    and returns validate's latents within 1e-5, a student's names its own pipeline, which diffusers loads with
    ``trust_remote_code`` and which returns them bit for bit; a PDD student's fused transformer is stock's at 1 NFE."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from safetensors.torch import load_file

    from distillery.evaluation.candidates import Candidate
    from distillery.evaluation.validate import run_validation
    from distillery.evaluation.validation_config import ValidationConfig
    from distillery.export.code import CODE_RECORD_KEY, OWN_PIPELINES, check_own_pipeline_samples
    from distillery.export.model_card import export_model_card
    from distillery.lineage.manifest import write_lineage
    from distillery.lineage.verify import verify_lineage
    from stages.export import assemble_export

    artifact = tmp_path / "artifacts" / stage
    _trained(base, artifact / "model", contract)
    write_lineage(artifact, kind="model", stage=stage, config={}, method={"teacher": "sft", "distill": "dmd2"}.get(stage, "pdd"))
    cfg = ValidationConfig(num_frames=9, height=64, width=64, num_seeds=1, progress_bar=False, grid_formats=[],
                           bootstrap_resamples=0)
    report_dir = tmp_path / "artifacts" / "validate" / "report"
    name = f"{stage}_s"
    run_validation(base, [Candidate.from_artifact(name, artifact / "model", num_steps=3 if stage == "teacher" else None,
                                                  guidance_scale=guidance)], [PROMPT], report_dir, cfg)
    saved = load_file(str(report_dir / "samples" / name / "latents.safetensors"))["0"]
    seed = json.loads((report_dir / "report.json").read_text())["seeds"][0]

    check_own_pipeline_samples(stage, artifact / "model")
    folder = tmp_path / "export"
    folder.mkdir()
    code, stock_nfe = assemble_export(base, artifact / "model", folder)
    assert stock_nfe == (1 if stage == "pdd" else None)
    card = export_model_card(stage, artifact, tmp_path / "artifacts" / "validate", None, stock_nfe, folder=str(folder))
    (folder / "README.md").write_text(card)
    write_lineage(folder, kind="export", stage="export", config={CODE_RECORD_KEY: code})
    assert verify_lineage(folder).ok, verify_lineage(folder).problems
    index = json.loads((folder / "model_index.json").read_text())
    call = {"prompt": PROMPT, "negative_prompt": "", "num_frames": 9, "height": 64, "width": 64, "output_type": "latent",
            "generator": torch.Generator().manual_seed(seed)}
    if stage == "teacher":
        assert index["_class_name"] == "HunyuanVideo15Pipeline" and "guidance_scale=4.0" in card
        pipe = HunyuanVideo15Pipeline.from_pretrained(str(folder))
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=contract["shift"])
        pipe.guider = pipe.guider.new(guidance_scale=guidance)
        torch.testing.assert_close(pipe(**call, num_inference_steps=3).frames[0], saved, rtol=0, atol=1e-5)
        return
    assert index["_class_name"] == list(OWN_PIPELINES["HunyuanVideo15Pipeline"])
    pipe = DiffusionPipeline.from_pretrained(str(folder), trust_remote_code=True)
    assert type(pipe).__name__ == "DistilledHunyuanVideo15Pipeline" and "trust_remote_code=True" in card
    got = pipe(**call).frames[0]
    assert torch.equal(got, saved), (got - saved).abs().max()
    if stage == "pdd":  # the whole grid fused into proj_out: stock at 1 step, guidance 1, is the fused sampler at 1 NFE
        fresh = {**call, "generator": torch.Generator().manual_seed(seed)}
        one = pipe(**fresh, num_inference_steps=1).frames[0]
        stock = HunyuanVideo15Pipeline(**pipe.components)
        stock.scheduler = FlowMatchEulerDiscreteScheduler(shift=contract["shift"])
        stock.guider = stock.guider.new(guidance_scale=1.0)
        fresh = {**call, "generator": torch.Generator().manual_seed(seed)}
        torch.testing.assert_close(stock(**fresh, num_inference_steps=1).frames[0], one, rtol=0, atol=1e-5)
        assert "num_inference_steps=1" in card


@pytest.mark.process
def test_hunyuan15_clips_preprocess_and_train_sft_then_dmd2_through_the_trainer(base, tmp_path):
    """The tiny HunyuanVideo 1.5 as a base end to end below the stage layer: synthetic clips → latents by its own VAE
    (scaled) and two-stream prompts (format v2, the streams recorded) → two SFT steps of a teacher through the trainer
    → two DMD2 steps of a student, critic and frozen teacher (the SFT'd one, exported by ``build_transformer``), stopped
    after one and resumed: bitwise the uninterrupted run."""
    import pyarrow.parquet as pq
    from helpers import dcp_tensors, role_state, train_in_process

    from distillery.clips.synthetic import ClipSetConfig, make_clip_set
    from distillery.data.preprocess import PreprocessConfig, preprocess

    clips = make_clip_set(tmp_path / "clips", ClipSetConfig(num_train=4, num_validation=2, num_frames=9, height=64, width=64))
    manifest = preprocess(base, clips, tmp_path / "latents", PreprocessConfig(num_frames=9, height=64, width=64))
    assert manifest["text_dim"] == TEXT and list(manifest["latent_shape"]) == list(SHAPE)
    assert manifest["text_streams"] == [{"encoder": "Qwen2_5_VLTextModel", "width": 16, "tokens": 1000},
                                        {"encoder": "T5EncoderModel", "width": 8, "tokens": 256}]
    assert manifest["normalisation"] == "latents = posterior_mean * vae.scaling_factor"
    shard = next((tmp_path / "latents").rglob("*.parquet"))
    assert pq.read_schema(shard).metadata[b"distillery.format"] == b"latents/v2"
    hunyuan = "distillery.models.hunyuan15.HunyuanVideo15Model"

    def config(out, models, method, stop_at=None):
        return {"models": models, "method": method,
                "training": {"data": {"path": str(tmp_path / "latents"), "batch_size": 2, "text_max_length": 64},
                             "optimizer": {"learning_rate": 1e-3, "weight_decay": 0.0},
                             "loop": {"max_train_steps": 2, "seed": 0, "progress_bar": False, "stop_at_step": stop_at},
                             "checkpoint": {"output_dir": str(out), "save_every": 2, "keep_last": 0},
                             "tracker": {"backend": "none"}}, "callbacks": {}}

    sft = train_in_process(config(tmp_path / "teacher", {"student": {"_target_": hunyuan, "init_from": str(base)}},
                                  {"_target_": "distillery.methods.sft.SFTMethod"}))
    assert len(sft.history) == 2 and all(torch.isfinite(torch.tensor(r["total_loss"])) for r in sft.history)
    checkpoint = next(p for p in sorted((tmp_path / "teacher").glob("checkpoint-*")) if p.is_dir())
    trained = role_state(checkpoint)
    start = registry.load_inference_model(base).transformer.state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # SFT moved the weights

    teacher = tmp_path / "teacher-model"
    shutil.copytree(base / "scheduler", teacher / "scheduler")
    module = registry.family_of(base).loaders().build_transformer(
        json.loads((base / "transformer" / "config.json").read_text()))
    module.load_state_dict(trained)
    module.save_pretrained(teacher / "transformer", safe_serialization=True)
    roles = {"student": {"_target_": hunyuan, "init_from": str(base)}, "critic": {"_target_": hunyuan, "init_from": str(base)},
             "teacher": {"_target_": hunyuan, "init_from": str(teacher), "trainable": False}}
    method = {"_target_": "distillery.methods.dmd2.DMD2Method", "generator_update_interval": 1, "num_student_steps": 2,
              "real_score_guidance_scale": 2.5}
    dmd2 = train_in_process(config(tmp_path / "distill", roles, method))
    assert len(dmd2.history) == 2 and all(torch.isfinite(torch.tensor(r["total_loss"])) for r in dmd2.history)
    # stopped after step 1 and resumed: bitwise the uninterrupted run (every tensor of its last checkpoint, every loss)
    train_in_process(config(tmp_path / "resumed", roles, method, stop_at=1))
    resumed = train_in_process(config(tmp_path / "resumed", roles, method))
    prefixes = ("roles.", "optimizers.", "schedulers.", "method.")
    full, again = (dcp_tensors(folder / "checkpoint-2", prefixes) for folder in (tmp_path / "distill", tmp_path / "resumed"))
    assert full.keys() == again.keys() and any(k.startswith("roles.critic.") for k in full)
    assert not [k for k in full if not torch.equal(full[k], again[k])]
    assert [r["total_loss"] for r in resumed.history] == [r["total_loss"] for r in dmd2.history][-len(resumed.history):]


def test_a_latent_set_of_two_streams_records_them_and_a_reader_refuses_what_it_cannot_read(tmp_path):
    """A shard of a two-stream base is ``latents/v2`` and records its streams; a shard of a later format, or whose
    streams are not the ones its set's manifest records, is one line; a stream whose mask is not a prefix cannot be
    packed."""
    import pyarrow.parquet as pq

    from distillery.data import LatentDataset, LatentRecord
    from distillery.data.dataset import MANIFEST_FILE
    from distillery.data.latent_format import stream_records, text_streams_of
    from distillery.data.writer import write_shard

    streams = (("Qwen2_5_VLTextModel", 16, 1000), ("T5EncoderModel", 8, 256))
    g = torch.Generator().manual_seed(0)
    records = [LatentRecord(id=f"r{i}", caption="c", latent=torch.randn(*SHAPE, generator=g),
                            text_embedding=torch.randn(5, TEXT, generator=g), num_frames=9, height=64, width=64, fps=8.0,
                            source="s") for i in range(2)]
    shard = write_shard(records, tmp_path / "set" / "train" / "shard-00000.parquet", streams)
    schema = pq.read_schema(shard)
    assert schema.metadata[b"distillery.format"] == b"latents/v2" and text_streams_of(schema) == stream_records(streams)
    assert len(LatentDataset(tmp_path / "set")) == 2  # no manifest: the shard's own record
    manifest = {"latent_shape": list(SHAPE), "text_dim": TEXT, "text_streams": stream_records(streams[:1] + streams[:1])}
    (tmp_path / "set" / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="prompt streams") as info:
        LatentDataset(tmp_path / "set")
    assert "\n" not in str(info.value)
    (tmp_path / "set" / MANIFEST_FILE).unlink()
    table = pq.read_table(shard)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"distillery.format": b"latents/v3"}), shard)
    with pytest.raises(UserError, match="later format") as info:
        LatentDataset(tmp_path / "set")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="not a prefix"):
        pack_streams([(torch.ones(3, 2), torch.tensor([1, 0, 1]))])
