"""LoRA on a role of two experts (Wan 2.2 A14B, issue 63 item 2): one adapter spec adapts both experts, each expert's
adapter trains on the samples of its timesteps, checkpoints hold both (and the base of each: ``base.second``), and the
export is base + adapters merged (both experts) or two diffusers LoRA files — the high-noise expert's loaded by stock
``load_lora_weights``, the low-noise one's with ``load_into_transformer_2=True`` — that give the merged model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import fit_in_process, run_config, tiny_raw_batch

from distillery.common.errors import UserError
from distillery.tinybase.wan22 import A14B_BOUNDARY_RATIO

LORA = {"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj"]}


def lora_config(base: Path, data: Path, out: Path, steps: int = 3) -> dict:
    cfg = run_config(base, data, out, steps=steps, lr=1e-2, batch_size=4)
    cfg["models"]["student"]["lora"] = dict(LORA)
    return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory, a14b, latent_set):
    root = tmp_path_factory.mktemp("a14b-lora")
    result, trainer = fit_in_process(lora_config(a14b, latent_set, root / "run"))
    return {"root": root, "result": result, "model": trainer.run.models["student"]}


def _forward(transformer: torch.nn.Module, t: float, seed: int = 0) -> torch.Tensor:
    raw = tiny_raw_batch(2, seed)
    with torch.no_grad():
        return transformer(hidden_states=raw["latents"], timestep=torch.full((2,), t),
                           encoder_hidden_states=raw["text_embeds"], return_dict=False)[0]


def test_both_experts_train_their_adapters_only(trained, a14b):
    from diffusers import WanTransformer3DModel

    from distillery.models.lora import adapter_names

    module = trained["model"].transformer
    adapters = adapter_names(module)
    assert {n.split(".")[0] for n in adapters} == {"transformer", "transformer_2"}
    assert all(p.requires_grad == (n in adapters) for n, p in module.named_parameters())
    for name, expert in (("transformer", module.transformer), ("transformer_2", module.transformer_2)):
        base = WanTransformer3DModel.from_pretrained(a14b / name).state_dict()
        own = adapter_names(expert)
        assert any("lora_B" in n and bool(v.abs().sum() > 0) for n, v in expert.state_dict().items() if n in own), name
        for key, value in expert.state_dict().items():
            if key not in own:
                assert torch.equal(value, base[key.replace(".base_layer.", ".")]), (name, key)
    record = json.loads((trained["result"].checkpoint / "metadata.json").read_text())["lora"]["student"]
    assert record["base"]["path"] == str(a14b / "transformer") and record["base"]["second"]["path"] == str(a14b / "transformer_2")


def test_merged_and_adapter_exports_are_the_trained_model_in_stock_diffusers(trained, a14b, tmp_path):
    from diffusers import WanPipeline, WanTransformer3DModel

    from distillery.export.weights import export_weights
    from distillery.models import registry
    from distillery.models.lora import LORA_WEIGHTS_FILE, LORA_WEIGHTS_FILE_2

    ckpt = trained["result"].checkpoint
    merged_dir = export_weights(ckpt, "student", tmp_path / "merged", lora="merged")
    assert (merged_dir / "transformer_2" / "config.json").is_file()
    shutil.copytree(a14b / "scheduler", tmp_path / "merged" / "scheduler")
    assert registry.family_of(tmp_path / "merged").name == "wan2.2-a14b"
    merged = [WanTransformer3DModel.from_pretrained(merged_dir), WanTransformer3DModel.from_pretrained(merged_dir / "transformer_2")]
    lora_dir = export_weights(ckpt, "student", tmp_path / "adapter", lora="adapter")
    assert sorted(p.name for p in lora_dir.iterdir()) == ["base.json", LORA_WEIGHTS_FILE, LORA_WEIGHTS_FILE_2]
    info = json.loads((lora_dir / "base.json").read_text())
    assert info["weights_2"] == LORA_WEIGHTS_FILE_2 and info["base"]["second"]["path"] == str(a14b / "transformer_2")
    pipe = WanPipeline.from_pretrained(a14b)  # stock diffusers, the base the adapter says it needs
    pipe.load_lora_weights(lora_dir)
    pipe.load_lora_weights(lora_dir, weight_name=LORA_WEIGHTS_FILE_2, load_into_transformer_2=True)
    base = WanPipeline.from_pretrained(a14b)
    for stock, ours, plain, t in ((pipe.transformer, merged[0], base.transformer, 950.0),
                                  (pipe.transformer_2, merged[1], base.transformer_2, 300.0)):
        for seed in (0, 1):
            torch.testing.assert_close(_forward(stock, t, seed), _forward(ours, t, seed), atol=1e-5, rtol=1e-5)
        assert (_forward(plain, t) - _forward(ours, t)).abs().max() > 1e-3  # the adapter moved it


def test_a_changed_second_expert_is_refused_at_export_and_resume(trained, a14b, latent_set, tmp_path):
    from distillery.export.weights import export_weights

    base = Path(shutil.copytree(a14b, tmp_path / "base"))
    result, _ = fit_in_process(lora_config(base, latent_set, tmp_path / "run", steps=1))
    with torch.no_grad():  # the second expert's weights change on disk
        from diffusers import WanTransformer3DModel

        low = WanTransformer3DModel.from_pretrained(base / "transformer_2")
        low.proj_out.bias.add_(1.0)
        low.save_pretrained(base / "transformer_2", safe_serialization=True)
    with pytest.raises(UserError, match=r"its second expert\) was trained on .*transformer_2 with sha256"):
        export_weights(result.checkpoint, "student", tmp_path / "x", lora="merged")
    again = lora_config(base, latent_set, tmp_path / "run", steps=2)
    with pytest.raises(UserError, match="LoRA base changed since this checkpoint was saved"):
        fit_in_process(again)


def test_the_adapter_card_loads_both_experts(trained, a14b, tmp_path):
    from distillery.export.lora_card import adapter_model_card
    from distillery.export.weights import export_weights

    lora_dir = export_weights(trained["result"].checkpoint, "student", tmp_path / "adapter", lora="adapter")
    card = adapter_model_card("teacher", json.loads((lora_dir / "base.json").read_text()),
                              {"sampler": "euler", "shift": 3.0}, folder="export", model_folder=str(a14b))
    assert "Wan 2.2 A14B text-to-video model's two experts" in card
    assert 'load_into_transformer_2=True' in card and f'"{a14b / "transformer_2"}"' in card
    assert A14B_BOUNDARY_RATIO  # the layout the snippet's pipeline reads from the base's model_index.json
