"""Image-to-video (Wan 2.1 I2V, issue 45 item 2): the tiny I2V base, recognising an I2V folder, the first frame's
condition and image embeddings stored by the latents, the plugin's 36-channel input, SFT on it, the one-line refusals."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import shipped_denoiser  # noqa: E402

from distillery.clips.synthetic import ClipSetConfig, make_clip_set  # noqa: E402
from distillery.common.errors import UserError  # noqa: E402
from distillery.data import LatentDataset  # noqa: E402
from distillery.data.dataset import collate_latents  # noqa: E402
from distillery.data.encoders import BaseEncoders  # noqa: E402
from distillery.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from distillery.models import registry  # noqa: E402
from distillery.tinybase.shipped import shipped_tiny_base  # noqa: E402
from distillery.tinybase.tiny_i2v import make_tiny_i2v_base  # noqa: E402

CFG = PreprocessConfig(num_frames=9, height=32, width=32, fps=8.0, rows_per_shard=4, batch_size=4)


@pytest.fixture(scope="module")
def i2v_base(tmp_path_factory) -> Path:
    return make_tiny_i2v_base(tmp_path_factory.mktemp("i2v") / "base", seed=0,
                              captions=["a red circle moving left on a black background"])


@pytest.fixture(scope="module")
def i2v_latents(tmp_path_factory, i2v_base) -> Path:
    clips = make_clip_set(tmp_path_factory.mktemp("clips") / "clips", ClipSetConfig(num_train=6, num_validation=2, num_frames=9))
    out = tmp_path_factory.mktemp("lat") / "data"
    preprocess(i2v_base, clips, out, CFG)
    return out


def test_the_tiny_i2v_base_is_recognised_and_accepted_as_a_base(i2v_base):
    from distillery.pipeline.publish.base_folder import check_model_index

    index = json.loads((i2v_base / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    config = json.loads((i2v_base / "transformer" / "config.json").read_text())
    assert (config["in_channels"], config["out_channels"], config["image_dim"]) == (20, 8, 32)
    spec = registry.image_conditioning(i2v_base)
    assert (spec.latent_channels, spec.mask_channels, spec.image_dim, spec.condition_channels) == (8, 4, 32, 12)
    assert registry.family_of(i2v_base).loaders().input_widths(config) == (8, 32)  # the latents' channels, not 20
    assert registry.image_conditioning(shipped_tiny_base()) is None  # a text-to-video base
    check_model_index(i2v_base, "base")  # a WanImageToVideoPipeline of library classes is a base
    bad = dict(index, _class_name="WanVACEPipeline")
    from distillery.pipeline.publish.base_folder import model_index_problems

    assert "expected one of WanPipeline, WanImageToVideoPipeline, Cosmos2_5_PredictBasePipeline" in model_index_problems(bad)[0]


def test_stock_pipeline_runs_the_tiny_i2v_base(i2v_base):
    """Stock diffusers samples the folder (prompt embeddings given: diffusers' I2V prompt cleaning needs ftfy)."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    pipe = WanImageToVideoPipeline.from_pretrained(str(i2v_base))
    text = torch.randn(1, 512, 32)
    video = pipe(image=Image.fromarray(np.zeros((32, 32, 3), np.uint8)), prompt_embeds=text,
                 negative_prompt_embeds=torch.zeros_like(text), num_frames=9, height=32, width=32,
                 num_inference_steps=1, output_type="np").frames[0]
    assert video.shape == (9, 32, 32, 3) and np.isfinite(video).all()


def test_the_first_frame_condition_is_the_pipelines(i2v_base):
    """What the latents store is what WanImageToVideoPipeline builds from the same frame (float rounding apart)."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    frames = np.random.default_rng(0).integers(0, 256, (2, 9, 32, 32, 3), dtype=np.uint8)
    enc = BaseEncoders(i2v_base)
    assert enc.image_to_video and enc.max_sequence_length == 512
    cond, images = enc.encode_first_frames(frames), enc.encode_images(frames)
    assert cond.shape == (2, 12, 3, 8, 8) and images.shape == (2, 17, 32)
    pipe = WanImageToVideoPipeline.from_pretrained(str(i2v_base))
    for b in range(2):
        image = Image.fromarray(frames[b, 0])
        pixels = pipe.video_processor.preprocess(image, height=32, width=32).float()
        _, expected = pipe.prepare_latents(pixels, 1, 8, 32, 32, 9, torch.float32, torch.device("cpu"), None)
        torch.testing.assert_close(cond[b], expected[0], atol=1e-5, rtol=0)
        assert torch.equal(cond[b, :4], expected[0, :4])  # the mask exactly
        torch.testing.assert_close(images[b], pipe.encode_image(image, torch.device("cpu"))[0], atol=1e-5, rtol=0)
    assert BaseEncoders(shipped_tiny_base()).image_to_video is False


def test_the_latents_store_first_frames_and_image_embeddings(i2v_latents):
    manifest = json.loads((i2v_latents / "preprocess.json").read_text())
    assert manifest["image_conditioning"] == {"first_frame_shape": [12, 3, 8, 8], "image_embedding_shape": [17, 32]}
    data = LatentDataset(i2v_latents, "train")
    item = data[0]
    assert item["first_frame"].shape == (12, 3, 8, 8) and item["image_embedding"].shape == (17, 32)
    assert torch.all(item["first_frame"][:4, 0] == 1) and torch.all(item["first_frame"][:4, 1:] == 0)
    batch = collate_latents([data[0], data[1]], text_max_length=512)
    assert batch["first_frame"].shape == (2, 12, 3, 8, 8) and batch["image_embeds"].shape == (2, 17, 32)


def _model(i2v_base: Path):
    from distillery.models.wan import WanModel, WanModelConfig

    return WanModel(WanModelConfig(init_from=str(i2v_base), trainable=False), role="student")


def test_the_plugin_builds_the_pipelines_transformer_input(i2v_base, i2v_latents):
    """predict_noise = the transformer on concat(noisy latent, mask, first-frame latent) with the image embeddings and
    the prompt padded to 512 tokens: what WanImageToVideoPipeline's denoising loop calls."""
    from distillery.components.rng import BatchRNG

    model = _model(i2v_base)
    data = LatentDataset(i2v_latents, "train")
    raw = collate_latents([data[0], data[1]], text_max_length=32)
    batch = model.prepare_batch(raw, BatchRNG(0))
    assert batch.first_frame.shape == (2, 12, 3, 8, 8) and batch.image_embeds.shape == (2, 17, 32)
    with torch.no_grad():
        got = model.predict_noise(batch.noisy_latents, batch.timesteps, batch)
        text = torch.nn.functional.pad(batch.text_embeds, (0, 0, 0, 512 - 32))
        expected = model.transformer(hidden_states=torch.cat([batch.noisy_latents, batch.first_frame], 1),
                                     timestep=batch.timesteps, encoder_hidden_states=text,
                                     encoder_hidden_states_image=batch.image_embeds, return_dict=False)[0]
    assert got.shape == batch.noisy_latents.shape
    assert torch.equal(got, expected)
    other = batch.first_frame.clone()
    other[:, 4:] += 1.0
    batch.first_frame = other
    with torch.no_grad():
        assert not torch.equal(model.predict_noise(batch.noisy_latents, batch.timesteps, batch), got)  # the frame counts


def test_an_i2v_model_refuses_batches_without_first_frames(i2v_base):
    from distillery.models.base import Conditioning

    model = _model(i2v_base)
    with pytest.raises(UserError, match="image-to-video model; its batches need the first frame"):
        model.predict_noise(torch.zeros(1, 8, 3, 8, 8), torch.tensor([500.0]), Conditioning(torch.zeros(1, 8, 32)))
    cond = Conditioning(torch.zeros(1, 8, 32), first_frame=torch.zeros(1, 12, 3, 8, 8))
    with pytest.raises(UserError, match="takes image-encoder embeddings"):
        model.predict_noise(torch.zeros(1, 8, 3, 8, 8), torch.tensor([500.0]), cond)


def test_sft_trains_the_i2v_model_on_the_frame(tmp_path, i2v_base, i2v_latents):
    """SFT through the trainer on the I2V set: the loss is finite, the weights move (the image embedder too: the frame
    reaches the gradient)."""
    from tests.helpers import read_log, role_state, run_config, train_in_process

    raw = run_config(i2v_base, i2v_latents, tmp_path / "run", steps=2, batch_size=2, save_every=2)
    raw["training"]["data"]["text_max_length"] = 512
    result = train_in_process(raw)
    assert result is not None
    losses = [r["total_loss"] for r in read_log(tmp_path / "run")]
    assert len(losses) == 2 and all(np.isfinite(losses))
    state = role_state(next((tmp_path / "run").glob("checkpoint-*")))
    from safetensors.torch import load_file

    before = load_file(str(next((i2v_base / "transformer").glob("*.safetensors"))))
    moved = [k for k in before if "image_embedder" in k and not torch.equal(before[k], state[k].to(before[k].dtype))]
    assert moved, "the image embedder got no update: the frame's embeddings do not reach the loss"
    from tests.direct_weights_check import assert_direct_export_is_save_pretrained

    checkpoint = next((tmp_path / "run").glob("checkpoint-*"))  # an image-to-video trunk, written without diffusers
    assert_direct_export_is_save_pretrained(checkpoint, "student", tmp_path / "direct")


def test_an_i2v_stage_refuses_latents_without_first_frames(tmp_path, i2v_base):
    from distillery.models.wan import image_conditioning
    from distillery.pipeline.launch.run_config import check_image_conditioning

    spec = image_conditioning(json.loads((i2v_base / "transformer" / "config.json").read_text()))
    with pytest.raises(UserError, match="is image-to-video, but the latents in .* have no first frames"):
        check_image_conditioning("teacher", i2v_base / "transformer", spec, {"latent_channels": 8, "text_dim": 32}, tmp_path)
    short = {"image_conditioning": {"first_frame_shape": [12, 3, 8, 8], "image_embedding_shape": None}}
    with pytest.raises(UserError, match="takes image embeddings of width 32, the latents in .* have none"):
        check_image_conditioning("teacher", i2v_base / "transformer", spec, short, tmp_path)
    check_image_conditioning("teacher", i2v_base / "transformer", None, {}, tmp_path)  # text-to-video: nothing asked
    from distillery.pipeline.launch.run_config import check_given_frame_layout

    with pytest.raises(UserError, match="stage pretrain: 5 latent frames do not fit a causal image-to-video student's "
                                        "layout: the given first frame, then chunks of 3 .*change clips.num_frames"):
        check_given_frame_layout("pretrain", spec, 3, {"latent_shape": [8, 5, 4, 4]})
    check_given_frame_layout("pretrain", spec, 2, {"latent_shape": [8, 5, 4, 4]})  # 1 + 2·2
    check_given_frame_layout("pretrain", None, 3, {"latent_shape": [8, 5, 4, 4]})  # text-to-video: chunks from frame 0
    check_given_frame_layout("pretrain", spec, None, {"latent_shape": [8, 5, 4, 4]})  # bidirectional: no chunks


def test_validate_samples_with_the_stored_first_frames(tmp_path, i2v_base, i2v_latents):
    """validate gives every candidate the first frame the latents stored for its prompt: the samples are the sampler's
    over the plugin with that frame, and another frame gives other samples; an I2V base without frames is one line."""
    from safetensors.torch import load_file

    from distillery.data import read_empty_prompt_embedding
    from distillery.evaluation.candidates import Candidate
    from distillery.evaluation.sampling_context import PromptEmbeddings
    from distillery.evaluation.validate import run_validation
    from distillery.evaluation.validation_config import ValidationConfig

    data = LatentDataset(i2v_latents, "validation", with_latents=False)
    rows = [data[0]]
    stored = PromptEmbeddings(texts=[r["text_embedding"] for r in rows], negative=read_empty_prompt_embedding(i2v_latents),
                              first_frames=[r["first_frame"] for r in rows], image_embeds=[r["image_embedding"] for r in rows])
    cfg = ValidationConfig(num_frames=9, num_seeds=1, progress_bar=False, grid_formats=[])
    cand = [Candidate("teacher", i2v_base, 2, 1.0)]
    prompts = [r["caption"] for r in rows]
    run_validation(i2v_base, cand, prompts, tmp_path / "a", cfg, prompt_embeddings=stored)
    first = load_file(tmp_path / "a" / "samples" / "teacher" / "latents.safetensors")
    other = PromptEmbeddings(texts=stored.texts, negative=stored.negative, image_embeds=stored.image_embeds,
                             first_frames=[torch.cat([f[:4], torch.randn_like(f[4:])]) for f in stored.first_frames])
    run_validation(i2v_base, cand, prompts, tmp_path / "b", cfg, prompt_embeddings=other)
    second = load_file(tmp_path / "b" / "samples" / "teacher" / "latents.safetensors")
    assert first.keys() == second.keys() and all(not torch.equal(first[k], second[k]) for k in first)
    with pytest.raises(UserError, match="is an image-to-video base: every prompt needs its first frame"):
        run_validation(i2v_base, cand, prompts, tmp_path / "c", cfg,
                       prompt_embeddings=PromptEmbeddings(texts=stored.texts, negative=stored.negative))


def test_dmd2_distills_the_i2v_model_with_the_frame(tmp_path, i2v_base, i2v_latents):
    """DMD2 through the trainer on the I2V set: the student's rollout, the teacher's and the critic's scores all take
    the batch's first frame (a forward without it is a UserError: the run would fail), the student and critic move."""
    from tests.helpers import read_log, role_state, run_config, train_in_process

    raw = run_config(i2v_base, i2v_latents, tmp_path / "run", method="distillery.methods.dmd2.DMD2Method",
                     method_knobs={"num_student_steps": 2, "generator_update_interval": 2, "real_score_guidance_scale": 2.0},
                     steps=2, batch_size=2, save_every=2)
    raw["models"]["teacher"] = {"_target_": "distillery.models.wan.WanModel", "init_from": str(i2v_base), "trainable": False}
    raw["models"]["critic"] = {"_target_": "distillery.models.wan.WanModel", "init_from": str(i2v_base)}
    raw["training"]["data"]["text_max_length"] = 512
    train_in_process(raw)
    rows = read_log(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["critic_loss"]) for r in rows if "critic_loss" in r)
    checkpoint = next((tmp_path / "run").glob("checkpoint-*"))
    from safetensors.torch import load_file

    before = load_file(str(next((i2v_base / "transformer").glob("*.safetensors"))))
    for role in ("student", "critic"):
        state = role_state(checkpoint, role)
        assert any(not torch.equal(before[k], state[k].to(before[k].dtype)) for k in before if "image_embedder" in k), role


def test_a_causal_i2v_model_streams_each_chunk_with_its_frames_condition(i2v_base, i2v_latents):
    """A block-causal I2V student (DFSFT, Self-Forcing) takes the first-frame condition per latent frame: chunk-by-chunk
    streaming through the KV cache gives what one block-causal forward over the whole video gives."""
    from distillery.components.rng import BatchRNG
    from distillery.models.wan import CausalWanModel, CausalWanModelConfig

    model = CausalWanModel(CausalWanModelConfig(init_from=str(i2v_base), trainable=False, chunk_size=1), role="student")
    data = LatentDataset(i2v_latents, "train")
    batch = model.prepare_batch(collate_latents([data[0]], text_max_length=32), BatchRNG(0))
    x, t = batch.noisy_latents, batch.timesteps
    with torch.no_grad():
        whole = model.predict_noise(x, t, batch)
        chunks = [model.predict_noise_streaming(x[:, :, f:f + 1], t, batch, cache_tag="c", store_kv=True, cur_start_frame=f)
                  for f in range(x.shape[2])]
    torch.testing.assert_close(torch.cat(chunks, dim=2), whole, atol=1e-5, rtol=1e-5)


def test_export_of_an_i2v_base_is_stock_or_its_own_pipeline(i2v_base, tmp_path):
    """A model of an I2V base exports as a stock WanImageToVideoPipeline folder where stock code samples its contract
    (the teacher's Euler), else with distillery's own pipeline, which takes the first frame; the own pipeline routes a
    text-to-video two-expert (Wan 2.2 A14B) student of every contract, while an image-to-video one of two experts is
    one line before any work (the export's one check of what its own pipeline samples, for every base)."""
    import shutil

    from distillery.export.code import check_own_pipeline_samples
    from distillery.export.i2v_card import is_i2v_folder
    from distillery.tinybase.wan22 import make_tiny_wan22

    assert is_i2v_folder(i2v_base) and not is_i2v_folder(shipped_tiny_base())
    one = Path(shutil.copytree(i2v_base, tmp_path / "i2v"))
    two = make_tiny_wan22(tmp_path / "a14b", "a14b")

    def check(folder: Path, student: str, contract: dict) -> None:
        (folder / "sampling.json").write_text(json.dumps(contract))
        check_own_pipeline_samples(student, folder)

    for folder in (one, two):
        check(folder, "teacher", {"sampler": "euler", "shift": 3.0})
    for causal in ({"sampler": "causal_streaming", "chunk_size": 1}, {"sampler": "euler", "chunk_size": 1}):
        with pytest.raises(UserError, match="causal image-to-video model whose sampling.json lacks given_first_frame"):
            check(one, "distill", causal)  # a causal I2V student trained before its frame 0 was the given frame
    contracts = ({"sampler": "few_step_x0", "timesteps": [1000.0, 500.0]},
                 {"sampler": "causal_streaming", "chunk_size": 1, "given_first_frame": True},
                 {"sampler": "pdd_fused", "pdd_steps": 4}, {"sampler": "euler", "chunk_size": 1, "given_first_frame": True})
    for contract in contracts:
        check(one, "distill", contract)
        # the own pipeline routes two text-to-video experts, every contract (tests/test_wan22.py: few-step;
        # tests/test_a14b_causal.py: a cache per expert; tests/test_a14b_pdd.py: a head bank per expert)
        check(two, "distill", contract)
    # a two-expert image-to-video student (Wan 2.2 I2V-A14B): its first frame through two experts is not shown sampled
    # as validate samples it — refused, every own-pipeline contract
    config = json.loads((two / "transformer" / "config.json").read_text())
    config["in_channels"] = 2 * config["out_channels"] + 4
    (two / "transformer" / "config.json").write_text(json.dumps(config))
    for contract in contracts:
        with pytest.raises(UserError, match=f"two experts\\) with the '{contract['sampler']}' sampling contract; the "
                                            "exported pipeline.py does not sample an image-to-video student of two "
                                            "experts.*export.student: teacher"):
            check(two, "distill", contract)


I2V_CONTRACTS = {  # (contract, call steps, call guidance): every kind of student the own pipeline samples
    "dmd2_few_step": ({"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000,
                       "timesteps": [1000.0, 750.0, 500.0]}, None, None),
    "dfsft_block_causal_euler_cfg": ({"sampler": "euler", "shift": 3.0, "num_train_timesteps": 1000, "chunk_size": 1,
                                      "given_first_frame": True}, 2, 3.0),
    "self_forcing_streaming": ({"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000,
                                "timesteps": [1000.0, 800.0, 400.0], "chunk_size": 1, "context_noise": 50.0,
                                "renoise": "sde", "given_first_frame": True}, None, None),
    "self_forcing_streaming_ode_cfg": ({"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000,
                                        "chunk_size": 2, "renoise": "ode", "given_first_frame": True}, 2, 2.5),
    "pdd_fused": ({"sampler": "pdd_fused", "shift": 3.0, "num_train_timesteps": 1000, "pdd_steps": 4,
                   "block_size_max": 4, "num_steps": 2, "guidance_scale": 1.0}, None, None),
}


def _with_heads(root: Path, i2v_base: Path) -> Path:
    """``root``: the I2V base's transformer and scheduler with a PDD bank of 4 heads (``proj_out`` + noise each)."""
    import shutil

    from safetensors.torch import load_file, save_file

    for part in ("transformer", "scheduler"):
        shutil.copytree(i2v_base / part, root / part)
    weights = load_file(str(next((root / "transformer").glob("*.safetensors"))))
    w, b = weights["proj_out.weight"].float(), weights["proj_out.bias"].float()
    gen = torch.Generator().manual_seed(3)
    save_file({"weight": torch.stack([w + 0.05 * torch.randn(w.shape, generator=gen) for _ in range(4)]),
               "bias": torch.stack([b + 0.05 * torch.randn(b.shape, generator=gen) for _ in range(4)])},
              str(root / "transformer" / "pdd_heads.safetensors"))
    return root


@pytest.mark.parametrize("kind", list(I2V_CONTRACTS))
def test_the_shipped_samplers_reproduce_the_package_s_i2v_latents(tmp_path, i2v_base, i2v_latents, kind):
    """The exported pipeline's samplers and denoisers (no distillery) give the package's latents bit for bit on the CPU
    for an I2V student of every kind, with the stored first frame and image embeddings; another frame, other latents."""

    from distillery.export.standalone import distilled_samplers, distilled_wan
    from distillery.models.base import Conditioning
    from distillery.models.registry import load_inference_model
    from distillery.sampling import build_sampler

    folder = _with_heads(tmp_path / "model", i2v_base)
    contract, steps, guidance = I2V_CONTRACTS[kind]
    row = LatentDataset(i2v_latents, "validation", with_latents=False)[0]
    first, images = row["first_frame"][None].float(), row["image_embedding"][None].float()
    gen = torch.Generator().manual_seed(11)
    text, negative = torch.randn(1, 512, 32, generator=gen), torch.randn(1, 512, 32, generator=gen)
    shape = tuple(first.shape[2:])
    shape = (8, *shape)  # 3 latent frames: a causal student's given frame, then 2 chunks of 1 or 1 chunk of 2

    package = build_sampler(contract)
    plugin = load_inference_model(folder, shift=package.shift, role="validate", **package.model_options())
    expected = package.sample(plugin, Conditioning(text, negative, first_frame=first, image_embeds=images), shape,
                              torch.Generator().manual_seed(5), num_steps=steps, guidance_scale=guidance)

    shipped = distilled_samplers.build_sampler(contract)
    model = shipped_denoiser(folder, shipped.model_kind())

    def sample(frame: torch.Tensor) -> torch.Tensor:
        cond = distilled_wan.Conditioning(text, negative, first_frame=frame, image_embeds=images)
        return shipped.sample(model, cond, shape, torch.Generator().manual_seed(5), num_steps=steps, guidance_scale=guidance)

    got = sample(first)
    assert got.shape == expected.shape == (1, *shape)
    assert torch.equal(got, expected), (got - expected).abs().max()
    if contract.get("given_first_frame"):  # the causal I2V student's frame 0 is the given frame's latent, exactly
        assert torch.equal(got[:, :, :1], first[:, 4:, :1])
    assert not torch.equal(sample(torch.cat([first[:, :4], torch.randn_like(first[:, 4:])], dim=1)), got)
    with pytest.raises(ValueError, match="image-to-video transformer samples from a first frame"):
        shipped.sample(model, distilled_wan.Conditioning(text, negative), shape, torch.Generator().manual_seed(5),
                       num_steps=steps, guidance_scale=guidance)


def test_a_pdd_i2v_student_takes_the_frame(i2v_base, i2v_latents):
    """The PDD trunk of an I2V base gets the same 20-channel input and image embeddings: one head of a fresh bank (a
    copy of proj_out) is the plain model's velocity, and the frame changes it."""
    from distillery.components.rng import BatchRNG
    from distillery.models.base import HeadGroup
    from distillery.models.wan import PDDWanModel, PDDWanModelConfig

    pdd = PDDWanModel(PDDWanModelConfig(init_from=str(i2v_base), trainable=False, pdd_steps=2), role="student")
    plain = _model(i2v_base)
    data = LatentDataset(i2v_latents, "train")
    batch = plain.prepare_batch(collate_latents([data[0]], text_max_length=32), BatchRNG(0))
    with torch.no_grad():
        (head,) = pdd.predict_head_groups(batch.noisy_latents, batch.timesteps, batch, [HeadGroup([0])])
        reference = plain.predict_noise(batch.noisy_latents, batch.timesteps, batch)
        torch.testing.assert_close(head[:, 0], reference, atol=1e-5, rtol=1e-5)
        batch.first_frame = torch.zeros_like(batch.first_frame)
        (other,) = pdd.predict_head_groups(batch.noisy_latents, batch.timesteps, batch, [HeadGroup([0])])
    assert not torch.equal(other, head)


def test_in_training_validation_samples_with_the_sets_first_frames(i2v_base, i2v_latents):
    """The validation callback reads each prompt's first frame (and image embeddings) with it and gives them to the
    sampler: an I2V student samples in training (without them its forward would refuse)."""
    from distillery.callbacks.validation import ValidationPrompts

    prompts = ValidationPrompts.read(i2v_latents, None, 2, 512)
    cond = prompts.conditioning()
    assert cond.first_frame.shape == (2, 12, 3, 8, 8) and cond.image_embeds.shape == (2, 17, 32)
    from distillery.sampling import build_sampler

    model = _model(i2v_base)
    sampler = build_sampler({"sampler": "euler", "shift": 3.0, "num_steps": 1})
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    with torch.no_grad():
        latents = sampler.sample(model, cond, prompts.latent_shape, generators, num_steps=1, guidance_scale=1.0)
    assert latents.shape == (2, *prompts.latent_shape) and torch.isfinite(latents).all()


def test_an_exported_i2v_dmd2_student_samples_validates_latents_from_the_first_frame(tmp_path, i2v_base, i2v_latents):
    """The export of a DMD2 student of an I2V base: the folder names its own pipeline, ships the base's image encoder and
    processor, passes ``lineage --verify``; loaded by diffusers (``trust_remote_code``) it samples, from the stored
    first-frame condition and image embeddings, bit for bit the latents validate sampled for that student; from a
    PIL frame it builds the condition the latents stage builds (float rounding apart) and decodes a video; without a
    frame it refuses. Its card calls the own pipeline with ``image=``."""
    import shutil

    from diffusers import DiffusionPipeline
    from PIL import Image
    from safetensors.torch import load_file, save_file

    from distillery.data import read_empty_prompt_embedding
    from distillery.data.encoders import read_max_sequence_length
    from distillery.evaluation.candidates import Candidate
    from distillery.evaluation.sampling_context import PromptEmbeddings
    from distillery.evaluation.validate import run_validation
    from distillery.evaluation.validation_config import ValidationConfig
    from distillery.export.code import CODE_RECORD_KEY, OWN_PIPELINE
    from distillery.export.i2v_card import i2v_model_card
    from distillery.lineage.manifest import write_lineage
    from distillery.lineage.verify import verify_lineage
    from stages.export import assemble_export

    student = tmp_path / "artifacts" / "dmd2"  # the base's transformer, moved off it (the export must ship this one)
    shutil.copytree(i2v_base / "transformer", student / "model" / "transformer")
    weights_file = next((student / "model" / "transformer").glob("*.safetensors"))
    gen = torch.Generator().manual_seed(7)
    weights = {k: v + 0.02 * torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in load_file(str(weights_file)).items()}
    save_file(weights, str(weights_file))
    (student / "model" / "sampling.json").write_text(json.dumps(I2V_CONTRACTS["dmd2_few_step"][0]))
    write_lineage(student, kind="model", stage="dmd2", config={}, method="dmd2")

    data = LatentDataset(i2v_latents, "validation", with_latents=False)
    rows = [data[0]]
    stored = PromptEmbeddings(texts=[r["text_embedding"] for r in rows], negative=read_empty_prompt_embedding(i2v_latents),
                              first_frames=[r["first_frame"] for r in rows], image_embeds=[r["image_embedding"] for r in rows])
    cfg = ValidationConfig(num_frames=9, num_seeds=1, progress_bar=False, grid_formats=[], bootstrap_resamples=0)
    validate = tmp_path / "artifacts" / "validate"
    run_validation(i2v_base, [Candidate.from_artifact("dmd2_3", student / "model")], [r["caption"] for r in rows],
                   validate / "report", cfg, prompt_embeddings=stored)
    saved = load_file(str(validate / "report" / "samples" / "dmd2_3" / "latents.safetensors"))["0"]
    report = json.loads((validate / "report" / "report.json").read_text())

    folder = tmp_path / "export"
    folder.mkdir()
    code, _ = assemble_export(i2v_base, student / "model", folder)
    card = i2v_model_card("dmd2", student, validate, read_max_sequence_length(i2v_base), folder=str(folder))
    (folder / "README.md").write_text(card)
    write_lineage(folder, kind="export", stage="export", config={CODE_RECORD_KEY: code})
    assert verify_lineage(folder).ok, verify_lineage(folder).problems
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == list(OWN_PIPELINE) and index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    assert "custom_pipeline=" in card and "pipe(image=image" in card and "WanImageToVideoPipeline.from_pretrained" not in card

    pipe = DiffusionPipeline.from_pretrained(str(folder), custom_pipeline=str(folder), trust_remote_code=True)
    assert type(pipe).__name__ == "DistilledWanPipeline" and pipe.image_encoder is not None
    text = torch.zeros(1, 512, 32)
    text[0, :rows[0]["text_embedding"].shape[0]] = rows[0]["text_embedding"].float()
    size = dict(num_frames=9, height=32, width=32)

    def sample(**kw):
        return pipe(prompt_embeds=text, generator=torch.Generator().manual_seed(report["seeds"][0]), output_type="latent",
                    **size, **kw).frames

    got = sample(first_frame=rows[0]["first_frame"][None], image_embeds=rows[0]["image_embedding"][None])
    assert got.shape == (1, *saved.shape) and torch.equal(got[0], saved), (got[0] - saved).abs().max()
    with pytest.raises(ValueError, match="image-to-video model: pass the first frame"):
        sample()
    with pytest.raises(ValueError, match="pass prompt= .* or prompt_embeds="):
        pipe(first_frame=rows[0]["first_frame"][None], image_embeds=rows[0]["image_embedding"][None], **size)

    frames = np.random.default_rng(1).integers(0, 256, (1, 9, 32, 32, 3), dtype=np.uint8)
    enc = BaseEncoders(i2v_base)
    image = Image.fromarray(frames[0, 0])
    torch.testing.assert_close(pipe.encode_first_frame(image, **size), enc.encode_first_frames(frames), atol=1e-5, rtol=0)
    torch.testing.assert_close(pipe.encode_image_embeds(image), enc.encode_images(frames), atol=1e-5, rtol=0)
    video = pipe(prompt_embeds=text, image=image, generator=torch.Generator().manual_seed(0), **size).frames[0]
    assert video.shape == (9, 32, 32, 3) and np.isfinite(video).all()


# --- a causal I2V student's first chunk is the given frame (issue 45 item 2) ---------------------------------------

@pytest.fixture(scope="module")
def i2v_training(i2v_base, i2v_latents):
    from helpers import run_config

    from distillery.config import allowed_prefixes, load_run_config

    return load_run_config(raw=run_config(i2v_base, i2v_latents, Path("unused")), prefixes=allowed_prefixes()).training


def _causal_i2v(i2v_base: Path, chunk_size: int, trainable: bool = True):
    from distillery.models.wan import CausalWanModel, CausalWanModelConfig

    return CausalWanModel(CausalWanModelConfig(init_from=str(i2v_base), trainable=trainable, chunk_size=chunk_size), "student")


@pytest.mark.parametrize("contract", [
    {"sampler": "causal_streaming", "timesteps": [1000.0, 500.0], "chunk_size": 1, "context_noise": 100.0,
     "given_first_frame": True, "guidance_scale": 2.0},
    {"sampler": "euler", "num_steps": 3, "chunk_size": 2, "given_first_frame": True, "guidance_scale": 2.0},
], ids=["causal_streaming", "block_causal_euler"])
def test_a_causal_i2v_sample_starts_with_the_given_frame_s_latent(i2v_base, i2v_latents, contract):
    """Latent frame 0 of a causal I2V student's sample is the given frame's clean latent (the condition's latent frame
    0) exactly, and the frames after it are generated against it; the layout is in the contract: without
    given_first_frame the student is refused, and a length that is not 1 + k·chunk_size is one line."""
    from distillery.models.base import Conditioning
    from distillery.sampling import build_sampler

    model = _causal_i2v(i2v_base, contract["chunk_size"], trainable=False)
    assert model.given_first_frame
    row = LatentDataset(i2v_latents, "validation", with_latents=False)[0]
    first, images = row["first_frame"][None].float(), row["image_embedding"][None].float()
    gen = torch.Generator().manual_seed(2)
    text, negative = torch.randn(2, 512, 32, generator=gen), torch.randn(2, 512, 32, generator=gen)
    cond = Conditioning(text, negative, first_frame=first.expand(2, -1, -1, -1, -1), image_embeds=images.expand(2, -1, -1))
    shape = (8, *first.shape[2:])  # 3 latent frames: the given frame + 2
    sampler = build_sampler(contract)
    out = sampler.sample(model, cond, shape, torch.Generator().manual_seed(4))
    assert out.shape == (2, *shape) and torch.isfinite(out).all()
    assert torch.equal(out[:, :, :1], first[:, 4:, :1].expand(2, -1, -1, -1, -1))  # the given frame, not generated
    other = Conditioning(text, negative, image_embeds=images.expand(2, -1, -1),
                         first_frame=torch.cat([first[:, :4], first[:, 4:] + 1.0], dim=1).expand(2, -1, -1, -1, -1))
    moved = sampler.sample(model, other, shape, torch.Generator().manual_seed(4))
    assert torch.equal(moved[:, :, :1], out[:, :, :1] + 1.0) and not torch.equal(moved[:, :, 1:], out[:, :, 1:])
    with pytest.raises(UserError, match="causal image-to-video student .* lacks given_first_frame: true"):
        build_sampler({k: v for k, v in contract.items() if k != "given_first_frame"}).sample(
            model, cond, shape, torch.Generator().manual_seed(4))
    with pytest.raises(UserError, match="4 latent frames do not fit a causal image-to-video student's layout"):
        sampler.sample(model, cond, (8, 4, *shape[2:]), torch.Generator().manual_seed(4)) if contract["chunk_size"] == 2 \
            else build_sampler({**contract, "chunk_size": 2}).sample(_causal_i2v(i2v_base, 2, trainable=False), cond,
                                                                      (8, 4, *shape[2:]), torch.Generator().manual_seed(4))


def _captured_step(method, batch: dict, seed: int = 0):
    """``method.single_train_step`` on a fresh random stream; returns its output and the transformer's inputs."""
    from distillery.components.rng import BatchRNG

    calls = []

    def hook(_module, _args, kwargs, output):
        calls.append({"x": kwargs["hidden_states"].detach().clone(), "t": kwargs["timestep"].detach().clone()})

    method.rng = BatchRNG(seed)
    handle = method.student.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        out = method.single_train_step(batch, step=1)
    finally:
        handle.remove()
    return out, calls


def test_dfsft_of_a_causal_i2v_student_gives_frame_0_and_leaves_it_out_of_the_loss(i2v_base, i2v_latents, i2v_training):
    """DFSFT of a causal I2V student: frame 0's input is the given frame's clean latent at t = 0 (not the clip's
    latent, not noised), its contract says given_first_frame; the loss does not see frame 0 — the clip's frame 0
    changed leaves it bit for bit, frame 1 changed moves it (it would move for frame 0 too were frame 0 in the loss) —
    and a clip of other than 1 + k·chunk_size latent frames is one line."""
    from distillery.methods.dfsft import DFSFTConfig, DFSFTMethod

    method = DFSFTMethod(DFSFTConfig(chunk_size=1), {"student": _causal_i2v(i2v_base, 1)}, i2v_training)
    assert method.sampling_contract()["given_first_frame"] is True and method.sampling_contract()["chunk_size"] == 1
    data = LatentDataset(i2v_latents, "train")
    batch = collate_latents([data[0], data[1]], text_max_length=512)
    out, calls = _captured_step(method, batch)
    assert len(calls) == 1
    x, t = calls[0]["x"], calls[0]["t"].reshape(2, 3, -1)
    assert torch.equal(x[:, :8, :1], batch["first_frame"][:, 4:, :1].float())  # the given latent, clean
    assert (t[:, 0] == 0).all() and (t[:, 1:] > 0).all()
    changed = {**batch, "latents": batch["latents"].clone()}
    changed["latents"][:, :, 0] += 5.0
    assert torch.equal(_captured_step(method, changed)[0].losses["total_loss"], out.losses["total_loss"])
    changed = {**batch, "latents": batch["latents"].clone()}
    changed["latents"][:, :, 1] += 5.0
    assert not torch.equal(_captured_step(method, changed)[0].losses["total_loss"], out.losses["total_loss"])
    three = DFSFTMethod(DFSFTConfig(chunk_size=3), {"student": _causal_i2v(i2v_base, 3)}, i2v_training)
    with pytest.raises(UserError, match="3 latent frames do not fit a causal image-to-video student's layout"):
        three.single_train_step(batch, step=1)


def test_self_forcing_rolls_a_causal_i2v_student_out_from_the_given_frame(i2v_base, i2v_latents, i2v_training):
    """Self-Forcing's rollout of a causal I2V student: frame 0 of x̂0 is the given frame's latent, one exit draw per
    generated chunk (frames 1, 2), and with last_step_only it is the artifact's causal_streaming sampler exactly; the
    generator and critic losses leave frame 0 out: the generator loss's gradient on a frame 0 that could move is zero
    (the DMD gradient there is not: with frame 0 in the loss it would be), and both losses differ from the whole
    video's."""
    from distillery.components.rng import BatchRNG
    from distillery.methods.self_forcing import SelfForcingConfig, SelfForcingMethod
    from distillery.models.base import Conditioning
    from distillery.models.wan import WanModel, WanModelConfig
    from distillery.sampling import build_sampler

    teacher = WanModel(WanModelConfig(init_from=str(i2v_base), trainable=False), "teacher")
    critic = WanModel(WanModelConfig(init_from=str(i2v_base)), "critic")
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():  # a critic apart from the teacher: a non-zero DMD gradient
        for param in critic.transformer.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    method = SelfForcingMethod(SelfForcingConfig(num_student_steps=2, last_step_only=True, rollout="simulate",
                                                 real_score_guidance_scale=1.0),
                               {"student": _causal_i2v(i2v_base, 1), "teacher": teacher, "critic": critic}, i2v_training)
    contract = method.sampling_contract()
    assert contract["given_first_frame"] is True
    data = LatentDataset(i2v_latents, "train")
    batch = collate_latents([data[0]], text_max_length=512)
    exit_step = method.draw_exit_step(batch)
    assert exit_step == [1, 1]  # two generated chunks after the given frame
    method.rng = BatchRNG(0)
    with torch.no_grad():
        x0, tb = method.rollout(batch, exit_step, with_grad=False)
    assert torch.equal(x0[:, :, :1], batch["first_frame"][:, 4:, :1].float())
    rng = BatchRNG(0)
    rng.randn(tuple(batch["latents"].shape))  # the rollout's initial-noise draw (prepare_batch), the sampler's too
    cond = Conditioning(tb.text_embeds, first_frame=tb.first_frame, image_embeds=tb.image_embeds)
    initial = BatchRNG(0).randn(tuple(batch["latents"].shape))
    expected = build_sampler(contract).sample(method.student, cond, tuple(batch["latents"].shape[1:]), rng, initial=initial)
    assert torch.equal(x0, expected)
    from distillery.methods.dmd2 import distribution_matching_loss, fake_score_loss

    method.rng = BatchRNG(7)
    x0g = x0.clone().requires_grad_(True)
    loss, _ = method.generator_loss(x0g, tb)
    loss.backward()
    assert torch.equal(x0g.grad[:, :, 0], torch.zeros_like(x0g.grad[:, :, 0])) and x0g.grad[:, :, 1:].abs().sum() > 0

    def scores(seed: int):
        method.rng = BatchRNG(seed)  # the score-timestep draw and the noise both read the method's stream
        return method.score_models()

    generated, _ = distribution_matching_loss(x0, tb, scores(7), 1.0, skip_frames=1)
    whole, _ = distribution_matching_loss(x0, tb, scores(7), 1.0)
    assert torch.equal(generated, loss.detach()) and not torch.equal(whole, loss.detach())
    method.rng = BatchRNG(8)
    critic = method.critic_loss(x0, tb)[0]
    critic_whole = fake_score_loss(x0, tb, scores(8))[0]
    assert not torch.equal(critic.detach(), critic_whole.detach())


# --- ODE-init (KD) trajectories carry the first frames -----------------------------------------------------------

@pytest.fixture(scope="module")
def i2v_trajectories(tmp_path_factory, i2v_base, i2v_latents) -> Path:
    from distillery.models.registry import load_inference_model
    from distillery.sampling.trajectories import TrajectorySettings, generate_trajectories, source_layout

    teacher = load_inference_model(i2v_base, "cpu", torch.float32, role="teacher")
    shape, length = source_layout(i2v_latents)
    settings = TrajectorySettings(teacher_sha256="tiny-i2v", t_list=(999.0, 500.0, 0.0), teacher_steps=2,
                                  guidance_scale=2.0, seed=0, seeds_per_prompt=1, rows_per_shard=4, batch_size=3,
                                  teacher_shift=float(teacher.schedule.shift), latent_shape=tuple(shape),
                                  text_max_length=length)
    out = tmp_path_factory.mktemp("traj") / "set"
    generate_trajectories(teacher, i2v_latents, out, settings)
    return out


def test_ode_init_trajectories_carry_the_first_frames_the_teacher_integrated_with(i2v_base, i2v_latents, i2v_trajectories):
    """The teacher's trajectories of an I2V latent set: each row carries its source row's first-frame condition and
    image embeddings (the manifest its image_conditioning, which the training stage's check reads), and the recorded
    states are the teacher's ODE with that frame — another frame gives another trajectory."""
    from distillery.models.registry import load_inference_model
    from distillery.sampling.trajectories import ode_grid, row_noise, teacher_trajectory

    source = LatentDataset(i2v_latents, "train")
    traj = LatentDataset(i2v_trajectories, "train")
    assert len(traj) == len(source) == 6
    by_id = {source[i]["id"]: source[i] for i in range(len(source))}
    for i in range(len(traj)):
        row = traj[i]
        src = by_id[row["id"].split("#seed")[0]]
        assert torch.equal(row["first_frame"], src["first_frame"]) and torch.equal(row["image_embedding"], src["image_embedding"])
    manifest = json.loads((i2v_trajectories / "preprocess.json").read_text())
    assert manifest["image_conditioning"] == json.loads((i2v_latents / "preprocess.json").read_text())["image_conditioning"]
    teacher = load_inference_model(i2v_base, "cpu", torch.float32, role="teacher")
    row = traj[0]
    src = by_id[row["id"].split("#seed")[0]]
    c = 8
    grid, record = ode_grid(teacher.schedule.inference_sigmas(2), (999.0, 500.0, 0.0), 1000)
    text = torch.nn.functional.pad(src["text_embedding"].float(), (0, 0, 0, 512 - src["text_embedding"].shape[0]))[None]
    from distillery.data import read_empty_prompt_embedding

    empty = read_empty_prompt_embedding(i2v_latents)
    negative = torch.nn.functional.pad(empty.float(), (0, 0, 0, 512 - empty.shape[0]))[None]
    noise = row_noise(0, src["id"], 0, (c, *row["latents"].shape[1:]))[None]

    def states(first: torch.Tensor) -> torch.Tensor:
        return teacher_trajectory(teacher, text, negative, noise, grid, record, 2.0, first_frame=first[None].float(),
                                  image_embeds=src["image_embedding"][None].float())[0]

    points = row["latents"].float().reshape(3, c, *row["latents"].shape[1:])
    torch.testing.assert_close(states(src["first_frame"]), points, rtol=1e-5, atol=1e-5)
    other = torch.cat([src["first_frame"][:4], src["first_frame"][4:] + 1.0])
    assert not torch.allclose(states(other), points)


def test_kd_trains_a_causal_i2v_student_on_the_trajectories_with_their_frames(i2v_base, i2v_trajectories, i2v_training):
    """KD of a causal I2V student on the trajectories: the student sees the rows' frames (the condition channels in its
    input), frame 0 is the given latent at t = 0 and out of the loss — the trajectory's frame 0 changed leaves the loss
    bit for bit, frame 1 moves it —; rows without first frames are one line for an I2V student."""
    from distillery.methods.kd import KDConfig, KDMethod

    method = KDMethod(KDConfig(t_list=[999.0, 500.0, 0.0], chunk_size=1), {"student": _causal_i2v(i2v_base, 1)}, i2v_training)
    assert method.sampling_contract()["given_first_frame"] is True
    data = LatentDataset(i2v_trajectories, "train")
    batch = collate_latents([data[0], data[1]], text_max_length=512)
    out, calls = _captured_step(method, batch)
    x, t = calls[0]["x"], calls[0]["t"].reshape(2, 3, -1)
    assert torch.equal(x[:, 8:], batch["first_frame"].float())  # the rows' condition, after the latent channels
    assert torch.equal(x[:, :8, :1], batch["first_frame"][:, 4:, :1].float()) and (t[:, 0] == 0).all() and (t[:, 1:] > 0).all()
    assert torch.isfinite(out.losses["total_loss"]) and out.losses["total_loss"].requires_grad
    points = batch["latents"].reshape(2, 3, 8, *batch["latents"].shape[2:])
    for frame, same in ((0, True), (1, False)):
        changed = points.clone()
        changed[:, :, :, frame] += 5.0
        loss = _captured_step(method, {**batch, "latents": changed.reshape(batch["latents"].shape)})[0].losses["total_loss"]
        assert torch.equal(loss, out.losses["total_loss"]) is same, frame
    with pytest.raises(UserError, match="trajectories without first frames for an image-to-video student"):
        method.single_train_step({k: v for k, v in batch.items() if k not in ("first_frame", "image_embeds")}, step=1)
