"""The Cosmos Predict 2.5 family (models/cosmos/): the plugin's mapping onto our flow convention against stock diffusers'
``Cosmos2_5_PredictBasePipeline`` on the same inputs, its prompt encoding, a training step, the tiny base and its
refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from distillery.common.errors import UserError
from distillery.components.rng import BatchRNG
from distillery.data.encoders import BaseEncoders
from distillery.models import registry
from distillery.models.base import Conditioning
from distillery.sampling import build_sampler
from distillery.tinybase.shipped import shipped_tiny_cosmos

PROMPT = "a red circle moving left"
SHAPE = (8, 3, 8, 8)  # the tiny Cosmos' latents of 9 × 32 × 32 frames


class PassThroughChecker:
    """The safety checker the stock pipeline insists on (NVIDIA's guardrail fetches its own models): passes all."""

    def to(self, *args, **kwargs):
        return self

    def check_text_safety(self, prompt):
        return True


@pytest.fixture(scope="module")
def stock():
    from diffusers import Cosmos2_5_PredictBasePipeline

    return Cosmos2_5_PredictBasePipeline.from_pretrained(shipped_tiny_cosmos(), safety_checker=PassThroughChecker())


@pytest.fixture(scope="module")
def embeds(stock):
    return stock.encode_prompt(PROMPT, negative_prompt="", do_classifier_free_guidance=True, max_sequence_length=48,
                               device="cpu")


def test_prompt_embeddings_are_the_stock_pipelines_own(embeds):
    encoders = BaseEncoders(shipped_tiny_cosmos())
    assert encoders.max_sequence_length == 48 and encoders.text_dim == 32 and encoders.z_dim == 8
    ours = encoders.encode_prompts([PROMPT, ""])
    assert [tuple(e.shape) for e in ours] == [(48, 32), (48, 32)]  # untrimmed: the pipeline passes its pad tokens too
    assert torch.equal(ours[0], embeds[0][0]) and torch.equal(ours[1], embeds[1][0])


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_euler_sampling_is_the_stock_pipeline_on_the_same_inputs(stock, embeds, guidance):
    """Our euler sampler over the plugin (t / 1000 as σ per frame, a zero condition mask, our guidance u + w (c − u))
    against the stock pipeline with its Euler scheduler, the same noise and embeddings: bitwise without guidance; with
    it, the stock form c + (w − 1)(c − u) rounds otherwise."""
    model = registry.load_inference_model(shipped_tiny_cosmos())
    positive, negative = embeds
    sampler = build_sampler({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000})
    ours = sampler.sample(model, Conditioning(positive, negative), SHAPE, torch.Generator().manual_seed(0), num_steps=3,
                          guidance_scale=guidance)
    noise = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(0))
    theirs = stock(prompt_embeds=positive, negative_prompt_embeds=negative, num_frames=9, height=32, width=32,
                   num_inference_steps=3, guidance_scale=guidance - 1 if guidance > 1 else 1.0, latents=noise,
                   output_type="latent").frames
    assert ours.abs().mean() > 0.1
    if guidance == 1.0:
        assert torch.equal(ours, theirs)
    else:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_per_frame_timesteps_are_the_per_sample_ones_broadcast():
    model = registry.load_inference_model(shipped_tiny_cosmos())
    x = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(1))
    cond = Conditioning(torch.randn(2, 48, 32, generator=torch.Generator().manual_seed(2)))
    t = torch.tensor([700.0, 250.0])
    with torch.no_grad():
        per_sample = model.predict_noise(x, t, cond)
        per_frame = model.predict_noise(x, t[:, None].expand(-1, SHAPE[1]), cond)
        mixed = model.predict_noise(x, torch.tensor([[700.0, 700.0, 10.0], [250.0, 250.0, 250.0]]), cond)
    assert torch.equal(per_sample, per_frame)
    assert torch.equal(mixed[1], per_sample[1]) and not torch.equal(mixed[0], per_sample[0])


def test_a_training_step_reaches_every_block_of_the_transformer():
    from distillery.models.cosmos import CosmosModel, CosmosModelConfig

    model = CosmosModel(CosmosModelConfig(init_from=str(shipped_tiny_cosmos())), role="student")
    raw = {"latents": torch.randn(2, *SHAPE), "text_embeds": torch.randn(2, 48, 32)}
    batch = model.prepare_batch(raw, BatchRNG(0))
    assert batch.timesteps.shape == (2,) and bool(((batch.timesteps > 0) & (batch.timesteps < 1000)).all())
    v = model.predict_noise(batch.noisy_latents, batch.timesteps, batch)
    loss = torch.nn.functional.mse_loss(v, batch.noise - batch.latents)
    model.backward(loss)
    blocks = model.shardable_blocks()
    assert len(blocks) == 2 and all(p.grad is not None and p.grad.abs().sum() > 0 for b in blocks for p in b.parameters()
                                    if p.requires_grad)
    assert registry.family_of(shipped_tiny_cosmos()).loaders().input_widths(model.transformer_config()) == (8, 32)


def test_a_pdd_folder_without_heads_is_one_line():
    with pytest.raises(UserError, match="pdd_heads.safetensors") as info:
        registry.load_inference_model(shipped_tiny_cosmos(), pdd_steps=4)
    assert "\n" not in str(info.value)


def _stream(model, video, t, cond, sizes, tag="pos"):
    """``video`` chunk by chunk (``sizes`` latent frames each) through the KV cache, storing every chunk."""
    outs, start = [], 0
    model.clear_caches()
    for size in sizes:
        outs.append(model.predict_noise_streaming(video[:, :, start:start + size], t[:, start:start + size], cond,
                                                  cache_tag=tag, store_kv=True, cur_start_frame=start))
        start += size
    model.clear_caches()
    return torch.cat(outs, dim=2)


def test_a_causal_cosmos_student_attends_block_causally_and_streams_what_its_full_forward_gives():
    """The block-causal half (Wan's module, every family's) over the Cosmos trunk: one chunk is the bidirectional
    model bit for bit; frames never see later chunks; chunk-by-chunk streaming through the KV cache (the rotary
    positions shifted to each chunk) gives the full block-causal forward; plain folders load causal by contract."""
    from distillery.models.base import CausalModelBase
    from distillery.models.cosmos import CausalCosmosModel

    base = shipped_tiny_cosmos()
    plain = registry.load_inference_model(base)
    causal = registry.load_inference_model(base, chunk_size=2)
    assert type(causal) is CausalCosmosModel and isinstance(causal, CausalModelBase) and causal.chunk_size == 2
    g = torch.Generator().manual_seed(6)
    video = torch.randn(2, 8, 6, 8, 8, generator=g)
    cond = Conditioning(torch.randn(2, 48, 32, generator=g), torch.randn(2, 48, 32, generator=g))
    t = torch.tensor([[0.0, 0.0, 250.0, 600.0, 800.0, 950.0], [10.0, 20.0, 400.0, 700.0, 900.0, 1000.0]])
    with torch.no_grad():
        one_chunk = registry.load_inference_model(base, chunk_size=6)
        assert torch.equal(one_chunk.predict_noise(video, t, cond), plain.predict_noise(video, t, cond))
        full = causal.predict_noise(video, t, cond)
        later = video.clone()
        later[:, :, 4:] += 1.0  # the last chunk changed: the first two chunks' outputs are not
        moved = causal.predict_noise(later, t, cond)
        assert torch.equal(moved[:, :, :4], full[:, :, :4]) and not torch.equal(moved[:, :, 4:], full[:, :, 4:])
        for sizes in ([2, 2, 2], [4, 2], [2, 4]):
            torch.testing.assert_close(_stream(causal, video, t, cond, sizes), full, rtol=0, atol=1e-5)
        unconditional = causal.predict_noise(video, t, cond, conditional=False)
        causal.clear_caches()
        first = causal.predict_noise_streaming(video[:, :, :2], t[:, :2], cond, cache_tag="neg", store_kv=True,
                                               cur_start_frame=0, conditional=False)
        with pytest.raises(ValueError, match="holds 2 frames"):
            causal.predict_noise_streaming(video[:, :, 4:], t[:, 4:], cond, cache_tag="neg", store_kv=False, cur_start_frame=4)
        torch.testing.assert_close(first, unconditional[:, :, :2], rtol=0, atol=1e-5)


def test_a_self_forcing_step_trains_a_causal_cosmos_student():
    """Self-Forcing (its rollout streams the causal student chunk by chunk) over Cosmos roles: the student's blocks get
    gradients, the frozen teacher none."""
    from helpers import nudge_weights, run_config
    from helpers import tiny_raw_batch as raw_batch

    from distillery.config import allowed_prefixes, load_run_config
    from distillery.methods.self_forcing import SelfForcingConfig, SelfForcingMethod
    from distillery.models.cosmos import CausalCosmosModel, CausalCosmosModelConfig, CosmosModel, CosmosModelConfig

    base = str(shipped_tiny_cosmos())
    roles = {"student": CausalCosmosModel(CausalCosmosModelConfig(init_from=base, chunk_size=1), "student"),
             "critic": CosmosModel(CosmosModelConfig(init_from=base), "critic"),
             "teacher": CosmosModel(CosmosModelConfig(init_from=base, trainable=False), "teacher")}
    for model in roles.values():
        model.bind_device(torch.device("cpu"))
    nudge_weights(roles["teacher"].transformer)
    training = load_run_config(raw=run_config(shipped_tiny_cosmos(), Path("unused"), Path("unused")),
                               prefixes=allowed_prefixes()).training
    method = SelfForcingMethod(SelfForcingConfig(generator_update_interval=1), roles, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    method.backward(method.single_train_step(raw_batch(), step=1))
    student = roles["student"].transformer
    assert all(p.grad is not None for b in roles["student"].shardable_blocks() for p in b.parameters() if p.requires_grad)
    assert all(p.grad is None for p in roles["teacher"].transformer.parameters())
    assert any(float(p.grad.abs().max()) > 0 for p in student.parameters() if p.grad is not None)


def test_a_pdd_cosmos_student_trains_its_heads_and_the_trunk_and_fuses_into_proj_out(tmp_path):
    """The head bank (every family's, models/wan/pdd.py) over the Cosmos trunk: bias-less heads as its proj_out; each
    head starts as the plain model; one PDD step reaches the supervised heads and the trunk only; the fused block is one
    stock transformer's output; the saved bank loads back (and a bank with a bias is refused)."""
    from helpers import nudge_weights, run_config
    from helpers import tiny_raw_batch as raw_batch

    from distillery.config import allowed_prefixes, load_run_config
    from distillery.methods.pdd import PDDConfig, PDDMethod
    from distillery.models.cosmos import CosmosModel, CosmosModelConfig, PDDCosmosModel, PDDCosmosModelConfig
    from distillery.models.wan.pdd import HEADS_FILE, save_head_bank, write_head_bank

    base = shipped_tiny_cosmos()
    student = PDDCosmosModel(PDDCosmosModelConfig(init_from=str(base), pdd_steps=4), "student")
    teacher = CosmosModel(CosmosModelConfig(init_from=str(base), trainable=False), "teacher")
    bank = student.head_bank
    assert not bank.has_bias and len(bank.bias) == 0 and student.transformer.proj_out.bias is None
    x = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(4))
    cond = Conditioning(torch.randn(1, 48, 32, generator=torch.Generator().manual_seed(5)))
    t = torch.tensor([600.0])
    with torch.no_grad():
        plain = teacher.predict_noise(x, t, cond)
        heads = student.predict_pdd_heads(x, t, cond)
    assert heads.shape == (1, 4, *SHAPE) and all(torch.equal(heads[:, k], plain) for k in range(4))

    training = load_run_config(raw=run_config(base, tmp_path / "unused", tmp_path / "unused"), prefixes=allowed_prefixes()).training
    for model in (student, teacher):
        model.bind_device(torch.device("cpu"))
    nudge_weights(teacher.transformer)
    method = PDDMethod(PDDConfig(block_size_max=4), {"student": student, "teacher": teacher}, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    method.backward(method.single_train_step(raw_batch(), step=1))  # the tiny Wan's batch: the same widths
    supervised = [k for k in range(4) if bank.weight[k].grad is not None]
    assert supervised and all(float(bank.weight[k].grad.abs().max()) > 0 for k in supervised)
    assert student.transformer.proj_out.weight.grad is None
    assert all(p.grad is not None for n, p in student.transformer.named_parameters() if not n.startswith("proj_out"))

    with torch.no_grad():
        for k in range(4):
            bank.weight[k].add_(0.01 * (k + 1))
        fused = student.predict_pdd_fused(x, t, cond, 0, 4)
        stock = CosmosModel(CosmosModelConfig(init_from=str(base), trainable=False), "stock")
        student.fuse_into_projection(stock.transformer, 0, 4)
        torch.testing.assert_close(stock.predict_noise(x, t, cond), fused, rtol=0, atol=1e-6)
    folder = tmp_path / "pdd"
    shutil.copytree(base, folder)
    save_head_bank(folder / "transformer" / HEADS_FILE, bank)
    loaded = registry.load_inference_model(folder, pdd_steps=4)
    assert type(loaded) is PDDCosmosModel and all(torch.equal(loaded.head_bank.weight[k], bank.weight[k]) for k in range(4))
    weight, _ = bank.weights(list(range(4)))
    write_head_bank(folder / "transformer" / HEADS_FILE, weight, torch.ones(4, weight.shape[1]))
    with pytest.raises(UserError, match="bias"):
        registry.load_inference_model(folder, pdd_steps=4)


def test_a_cosmos_folder_of_another_pipeline_or_with_a_padding_mask_it_cannot_resize_is_one_line(tmp_path):
    other = tmp_path / "predict2"
    shutil.copytree(shipped_tiny_cosmos(), other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "Cosmos2VideoToWorldPipeline"}))
    with pytest.raises(UserError, match="unknown layout.*Cosmos2VideoToWorldPipeline"):
        registry.family_of(other)
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return  # where torchvision imports, diffusers resizes the mask itself
    padded = tmp_path / "padded"
    shutil.copytree(shipped_tiny_cosmos(), padded)
    config = json.loads((padded / "transformer" / "config.json").read_text())
    (padded / "transformer" / "config.json").write_text(json.dumps({**config, "concat_padding_mask": True}))
    with pytest.raises(UserError, match="torchvision") as info:
        registry.load_inference_model(padded)
    assert "\n" not in str(info.value)


def test_the_shipped_tiny_cosmos_is_what_its_maker_makes(tmp_path, capsys):
    """``distillery base make-tiny --family cosmos`` (its command, in process) makes the shipped folder's bytes; the
    tiny Wan's own options with it are one line, exit 2."""
    from distillery.cli.main import main

    made = tmp_path / "tiny-cosmos"
    assert main(["base", "make-tiny", "--family", "cosmos", "--out", str(made), "--seed", "0"]) == 0
    assert main(["base", "make-tiny", "--family", "cosmos", "--fit", "--out", str(tmp_path / "other")]) == 2
    assert "--family cosmos" in capsys.readouterr().err and not (tmp_path / "other").exists()
    for part in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors", "tokenizer/tokenizer.json",
                 "vae/diffusion_pytorch_model.safetensors", "model_index.json", "scheduler/scheduler_config.json"):
        assert (made / part).read_bytes() == (shipped_tiny_cosmos() / part).read_bytes(), part


def test_the_tiny_cosmos_is_a_base_the_pipeline_takes():
    from distillery.pipeline.publish.base_folder import check_model_index, model_index_problems

    check_model_index(shipped_tiny_cosmos(), "base")  # library classes of Cosmos2_5_PredictBasePipeline, no checker
    index = json.loads((shipped_tiny_cosmos() / "model_index.json").read_text())
    assert model_index_problems({**index, "safety_checker": ["evil", "Checker"]})[0].startswith("safety_checker")


TEACHER = {"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000}
STUDENT = {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 750.0, 500.0]}
STREAMING = {"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 600.0],
             "chunk_size": 1, "context_noise": 50.0, "renoise": "sde"}
PDD = {"sampler": "pdd_fused", "shift": 3.0, "num_train_timesteps": 1000, "pdd_steps": 4, "block_size_max": 4, "num_steps": 2,
       "guidance_scale": 1.0}


def _trained(out, contract):
    """A trained Cosmos role's ``model/`` as a training stage writes it: the tiny transformer moved off the base
    (seeded noise), the scheduler, ``contract`` as ``sampling.json``."""
    from helpers import nudge_weights

    model = registry.load_inference_model(shipped_tiny_cosmos())
    nudge_weights(model.transformer)
    model.transformer.save_pretrained(out / "transformer", safe_serialization=True)
    shutil.copytree(shipped_tiny_cosmos() / "scheduler", out / "scheduler")
    (out / "sampling.json").write_text(json.dumps(contract))
    if contract["sampler"] == "pdd_fused":  # a head bank: proj_out + seeded noise per head (bias-less as proj_out)
        from distillery.models.wan.pdd import HEADS_FILE, write_head_bank

        w = model.transformer.proj_out.weight.detach().float()
        noise = 0.02 * torch.randn(4, *w.shape, generator=torch.Generator().manual_seed(3))
        write_head_bank(out / "transformer" / HEADS_FILE, w + noise, torch.zeros(4, w.shape[0]))
    return out


@pytest.mark.parametrize("stage,contract,guidance", [("teacher", TEACHER, 4.0), ("distill", STUDENT, None), ("pdd", PDD, None),
                                                          ("self_forcing", STREAMING, None)])
def test_an_exported_cosmos_model_samples_validates_latents_through_diffusers(tmp_path, stage, contract, guidance):
    """Validate samples a trained Cosmos role; the export stage's assembly gives a folder that passes
    ``lineage --verify``; the teacher's loads in stock ``Cosmos2_5_PredictBasePipeline`` (guidance w − 1) and
    returns validate's latents within 1e-5, the student's names its own pipeline, which diffusers loads with
    ``trust_remote_code`` and which returns them bit for bit."""
    from diffusers import Cosmos2_5_PredictBasePipeline, DiffusionPipeline
    from safetensors.torch import load_file

    from distillery.data.encoders import read_max_sequence_length
    from distillery.evaluation.candidates import Candidate
    from distillery.evaluation.validate import run_validation
    from distillery.evaluation.validation_config import ValidationConfig
    from distillery.export.code import CODE_RECORD_KEY, OWN_PIPELINES, check_own_pipeline_samples
    from distillery.export.model_card import export_model_card
    from distillery.lineage.manifest import write_lineage
    from distillery.lineage.verify import verify_lineage
    from stages.export import assemble_export

    base = shipped_tiny_cosmos()
    artifact = tmp_path / "artifacts" / stage
    _trained(artifact / "model", contract)
    write_lineage(artifact, kind="model", stage=stage, config={}, method={"teacher": "sft", "distill": "dmd2", "pdd": "pdd"}.get(stage, "self_forcing"))
    cfg = ValidationConfig(num_frames=9, num_seeds=1, progress_bar=False, grid_formats=[], bootstrap_resamples=0)
    report_dir = tmp_path / "artifacts" / "validate" / "report"
    name = f"{stage}_s"
    steps = 3 if stage == "teacher" else None
    run_validation(base, [Candidate.from_artifact(name, artifact / "model", num_steps=steps, guidance_scale=guidance)],
                   [PROMPT], report_dir, cfg)
    saved = load_file(str(report_dir / "samples" / name / "latents.safetensors"))["0"]
    seed = json.loads((report_dir / "report.json").read_text())["seeds"][0]

    check_own_pipeline_samples(stage, artifact / "model")
    folder = tmp_path / "export"
    folder.mkdir()
    code, stock_nfe = assemble_export(base, artifact / "model", folder)
    assert stock_nfe == (1 if stage == "pdd" else None)  # a PDD student's whole grid fused into its proj_out too
    card = export_model_card(stage, artifact, tmp_path / "artifacts" / "validate", read_max_sequence_length(base),
                             stock_nfe, folder=str(folder))
    (folder / "README.md").write_text(card)
    write_lineage(folder, kind="export", stage="export", config={CODE_RECORD_KEY: code})
    assert verify_lineage(folder).ok, verify_lineage(folder).problems
    index = json.loads((folder / "model_index.json").read_text())
    call = {"prompt": PROMPT, "negative_prompt": "", "num_frames": 9, "height": 32, "width": 32, "max_sequence_length": 48,
            "output_type": "latent", "generator": torch.Generator().manual_seed(seed)}
    if stage == "teacher":
        assert index["_class_name"] == "Cosmos2_5_PredictBasePipeline" and "guidance_scale=3.0" in card
        pipe = Cosmos2_5_PredictBasePipeline.from_pretrained(str(folder), safety_checker=PassThroughChecker())
        got = pipe(**call, num_inference_steps=3, guidance_scale=guidance - 1).frames
        torch.testing.assert_close(got[0], saved, rtol=0, atol=1e-5)
    else:
        assert index["_class_name"] == list(OWN_PIPELINES["Cosmos2_5_PredictBasePipeline"])
        pipe = DiffusionPipeline.from_pretrained(str(folder), trust_remote_code=True, safety_checker=PassThroughChecker())
        assert type(pipe).__name__ == "DistilledCosmosPipeline" and "safety_checker=checker" in card
        got = pipe(**call).frames
        assert torch.equal(got[0], saved), (got[0] - saved).abs().max()


def test_cosmos_clips_preprocess_and_train_sft_then_dmd2_through_the_trainer(tmp_path):
    """The tiny Cosmos as a base end to end below the stage layer: synthetic clips → latents by its own VAE and
    Qwen2.5-VL prompts (untrimmed rows) → two SFT steps of a Cosmos teacher through the trainer → two DMD2 steps of a
    Cosmos student, critic and frozen teacher (the SFT'd one, exported by ``export_weights``)."""
    from helpers import role_state, train_in_process

    from distillery.clips.synthetic import ClipSetConfig, make_clip_set
    from distillery.data.preprocess import PreprocessConfig, preprocess

    base = shipped_tiny_cosmos()
    clips = make_clip_set(tmp_path / "clips", ClipSetConfig(num_train=4, num_validation=2, num_frames=9))
    manifest = preprocess(base, clips, tmp_path / "latents", PreprocessConfig(num_frames=9))
    assert manifest["text_dim"] == 32 and list(manifest["latent_shape"]) == [8, 3, 8, 8]
    cosmos = "distillery.models.cosmos.CosmosModel"

    def config(out, models, method):
        return {"models": models, "method": method,
                "training": {"data": {"path": str(tmp_path / "latents"), "batch_size": 2, "text_max_length": 48},
                             "optimizer": {"learning_rate": 1e-3, "weight_decay": 0.0},
                             "loop": {"max_train_steps": 2, "seed": 0, "progress_bar": False},
                             "checkpoint": {"output_dir": str(out), "save_every": 2, "keep_last": 0},
                             "tracker": {"backend": "none"}}, "callbacks": {}}

    sft = train_in_process(config(tmp_path / "teacher", {"student": {"_target_": cosmos, "init_from": str(base)}},
                                  {"_target_": "distillery.methods.sft.SFTMethod"}))
    assert len(sft.history) == 2 and all(torch.isfinite(torch.tensor(r["total_loss"])) for r in sft.history)
    checkpoint = next(p for p in sorted((tmp_path / "teacher").glob("checkpoint-*")) if p.is_dir())
    trained = role_state(checkpoint)
    start = registry.load_inference_model(base).transformer.state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # SFT moved the Cosmos weights

    teacher = tmp_path / "teacher-model"
    shutil.copytree(base / "scheduler", teacher / "scheduler")
    module = registry.family_of(base).loaders().build_transformer(
        json.loads((base / "transformer" / "config.json").read_text()))
    module.load_state_dict(trained)
    module.save_pretrained(teacher / "transformer", safe_serialization=True)
    dmd2 = train_in_process(config(tmp_path / "distill", {
        "student": {"_target_": cosmos, "init_from": str(base)},
        "critic": {"_target_": cosmos, "init_from": str(base)},
        "teacher": {"_target_": cosmos, "init_from": str(teacher), "trainable": False}},
        {"_target_": "distillery.methods.dmd2.DMD2Method", "generator_update_interval": 1, "num_student_steps": 2,
         "real_score_guidance_scale": 2.5}))
    assert len(dmd2.history) == 2 and all(torch.isfinite(torch.tensor(r["total_loss"])) for r in dmd2.history)


def test_the_prompt_width_reads_from_the_text_encoders_config_as_released_and_as_saved_here(tmp_path):
    """Qwen2.5-VL-7B's released config has its sizes at the top (28 layers × 3584 = the 2B transformer's 100,352-wide
    projection input); transformers 5 saves them under ``text_config``; a class no row knows is one line."""
    from distillery.data.encoders import text_width

    folder = tmp_path / "released"
    (folder / "text_encoder").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"]}))
    (folder / "text_encoder" / "config.json").write_text(json.dumps({"hidden_size": 3584, "num_hidden_layers": 28}))
    assert text_width(folder) == 100352 and text_width(shipped_tiny_cosmos()) == 32
    (folder / "model_index.json").write_text(json.dumps({"text_encoder": ["transformers", "Gemma3ForConditionalGeneration"]}))
    with pytest.raises(UserError, match="Gemma3ForConditionalGeneration") as info:
        text_width(folder)
    assert "\n" not in str(info.value)
