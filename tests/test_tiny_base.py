"""The tiny Wan 2.1 base model: a diffusers folder stock WanPipeline loads offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from distillery.common.errors import UserError  # noqa: E402
from distillery.tinybase.tiny import TinyBaseConfig, make_tiny_base  # noqa: E402
from distillery.tinybase.tokenizer import BUILTIN_VOCABULARY  # noqa: E402

CAPTIONS = ["a red circle moving left on a black background", "a Zebra-striped blob drifting, slowly"]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base") / "tiny-wan"
    assert make_tiny_base(out, seed=0, captions=CAPTIONS) == out
    return out


def test_folder_layout(tiny_base: Path) -> None:
    names = {p.name for p in tiny_base.iterdir()}
    assert names == {"model_index.json", "README.md", "transformer", "vae", "text_encoder", "tokenizer", "scheduler"}
    index = json.loads((tiny_base / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert index.get("transformer_2") in (None, [None, None])
    scheduler = json.loads((tiny_base / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler" and scheduler["shift"] == 3.0
    vae = json.loads((tiny_base / "vae" / "config.json").read_text())
    assert vae["latents_mean"] == [0.0] * 8 and vae["latents_std"] == [1.0] * 8
    assert (vae["scale_factor_spatial"], vae["scale_factor_temporal"]) == (4, 4)
    card = (tiny_base / "README.md").read_text()
    assert "random" in card and "distillery base make-tiny" in card and "max_sequence_length: 32" in card
    assert not [p for p in tiny_base.parent.iterdir() if p.name.startswith(".")], "staging folder left behind"


def _rebuilt(part: str, seed: int = 0):
    """The part ("vae" or "transformer") built again in memory the way make_tiny_base seeds it."""
    import torch

    from distillery.tinybase import tiny

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + tiny._SEED_OFFSETS[part])
        return {"vae": tiny.build_vae, "transformer": tiny.build_transformer}[part](TinyBaseConfig())


@pytest.mark.parametrize(
    "guidance_scale, negative_prompt", [(1.0, None), (3.0, "a blurry static green square")]
)
def test_stock_pipeline_generates(tiny_base: Path, guidance_scale: float, negative_prompt: str | None) -> None:
    import torch
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_base)
    pipe.set_progress_bar_config(disable=True)

    def generate(seed: int, guidance: float) -> np.ndarray:
        return pipe("a red circle moving left on a black background", negative_prompt=negative_prompt, num_frames=9,
                    height=32, width=32, num_inference_steps=2, guidance_scale=guidance,
                    max_sequence_length=TinyBaseConfig().max_sequence_length, generator=torch.Generator().manual_seed(seed),
                    output_type="np").frames

    frames = generate(0, guidance_scale)
    assert frames.shape == (1, 9, 32, 32, 3) and frames.min() >= 0.0 and frames.max() <= 1.0
    assert np.array_equal(generate(0, guidance_scale), frames)  # same seed, same video
    assert np.abs(generate(1, guidance_scale) - frames).max() > 1e-3  # the seed matters
    if guidance_scale > 1.0:  # and CFG against the negative prompt changes the result
        assert np.abs(generate(0, 1.0) - frames).max() > 1e-4


def test_saved_vae_is_the_seeded_one(tiny_base: Path) -> None:
    import torch
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(tiny_base / "vae")
    again = _rebuilt("vae")
    assert vae.state_dict().keys() == again.state_dict().keys()
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in vae.state_dict().items())
    video = torch.rand(1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        latent = vae.encode(video).latent_dist.mode()
        decoded = vae.decode(latent).sample
        torch.testing.assert_close(decoded, again.decode(again.encode(video).latent_dist.mode()).sample, rtol=0, atol=0)
    assert latent.shape == (1, 8, 3, 8, 8)  # 1 + (9 − 1)/4 frames, 32/4 pixels
    assert decoded.shape == video.shape and decoded.abs().max() <= 1.0


def test_transformer_loads_alone(tiny_base: Path) -> None:
    import torch
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(tiny_base / "transformer")
    assert model.config.in_channels == 8 and model.config.text_dim == 32
    again = _rebuilt("transformer")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 8, 3, 8, 8, generator=g), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 32, 32, generator=g), return_dict=False)
    with torch.no_grad():
        out = model(**inputs)[0]
        torch.testing.assert_close(out, again(**inputs)[0], rtol=0, atol=0)
    assert out.shape == (1, 8, 3, 8, 8) and out.abs().max() > 0


def test_same_seed_same_bytes(tiny_base: Path, tmp_path: Path) -> None:
    again = make_tiny_base(tmp_path / "again", seed=0, captions=list(reversed(CAPTIONS)))
    for part in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors", "tokenizer/tokenizer.json"):  # fmt: skip
        assert (again / part).read_bytes() == (tiny_base / part).read_bytes(), part
    other = make_tiny_base(tmp_path / "other", seed=1, captions=CAPTIONS)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (other / weights).read_bytes() != (tiny_base / weights).read_bytes()


def test_refuses_non_empty_destination(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        make_tiny_base(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]

    make_tiny_base(out, overwrite=True)
    assert (out / "model_index.json").exists() and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert (make_tiny_base(empty) / "model_index.json").exists()


def test_tokenizer_round_trip(tiny_base: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base / "tokenizer")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert "zebra" in tok.get_vocab() and "circle" in tok.get_vocab()
    assert len(tok) >= len(BUILTIN_VOCABULARY) + 3

    ids = tok("A Red circle moving LEFT")["input_ids"]
    assert len(ids) == 6 and ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "a red circle moving left"
    assert tok("a qwxyz circle")["input_ids"] == [tok.convert_tokens_to_ids("a"), 2,
                                                  tok.convert_tokens_to_ids("circle"), 1]  # fmt: skip

    batch = tok(["a red circle, moving left on a black background and up and down", ""], padding="max_length",
                max_length=8, truncation=True, add_special_tokens=True, return_attention_mask=True,
                return_tensors="pt")  # fmt: skip
    assert batch.input_ids.shape == (2, 8)
    assert batch.input_ids[0, -1].item() == 1 and batch.attention_mask[0].tolist() == [1] * 8
    assert batch.input_ids[1].tolist() == [1] + [0] * 7 and batch.attention_mask[1].tolist() == [1] + [0] * 7
