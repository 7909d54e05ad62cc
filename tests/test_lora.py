"""LoRA on a trainable role (``models.<role>.lora``, distillery.models.lora): only the adapter trains, checkpoints
hold it alone, the export is base + adapter merged or a diffusers LoRA file stock ``load_lora_weights`` reads, and a
bad LoRA config is one line, exit 2, before any model loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import dcp_tensors, fit_in_process, run_config, tiny_raw_batch, train_in_process, write_config

LORA = {"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj"]}


def _lora_config(base: Path, data: Path, out: Path, steps: int = 3, **lora) -> dict:
    cfg = run_config(base, data, out, steps=steps, lr=1e-2)
    cfg["models"]["student"]["lora"] = {**LORA, **lora}
    return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_base, latent_set):
    root = tmp_path_factory.mktemp("lora")
    result, trainer = fit_in_process(_lora_config(tiny_base, latent_set, root / "run"))
    return {"root": root, "result": result, "model": trainer.run.models["student"], "base": tiny_base}


def _forward(transformer: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    raw = tiny_raw_batch(2, seed)
    with torch.no_grad():
        return transformer(hidden_states=raw["latents"], timestep=torch.tensor([300.0, 800.0]),
                           encoder_hidden_states=raw["text_embeds"], return_dict=False)[0]


def test_only_the_adapter_trains(trained):
    from diffusers import WanTransformer3DModel

    from distillery.models.lora import adapter_names

    base = WanTransformer3DModel.from_pretrained(trained["base"] / "transformer").state_dict()
    transformer = trained["model"].transformer
    adapters = adapter_names(transformer)
    assert adapters and all(p.requires_grad == (n in adapters) for n, p in transformer.named_parameters())
    moved = 0
    for name, value in transformer.state_dict().items():
        if name in adapters:
            moved += int("lora_B" in name and bool(value.abs().sum() > 0))  # B starts at zeros: it trained
            continue
        assert torch.equal(value, base[name.replace(".base_layer.", ".")]), name  # the base: bitwise as loaded
    assert moved == len(adapters) // 2
    assert len(base) == len(transformer.state_dict()) - len(adapters)


def test_checkpoint_holds_the_adapter_only(trained):
    from distillery.components.checkpoint.dcp_io import read_dcp_metadata

    ckpt = trained["result"].checkpoint
    keys = set(read_dcp_metadata(ckpt / "dcp").state_dict_metadata)
    weights = {k for k in keys if k.startswith("roles.student.")}
    moments = {k for k in keys if k.startswith("optimizers.student.")}
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert moments and all(".lora_A." in k or ".lora_B." in k for k in moments)
    assert len(moments) == 3 * len(weights)  # step, exp_avg, exp_avg_sq: of the adapter's parameters only
    dcp_bytes = sum(p.stat().st_size for p in (ckpt / "dcp").iterdir())
    base_bytes = sum(p.stat().st_size for p in (trained["base"] / "transformer").glob("*.safetensors"))
    assert dcp_bytes < base_bytes / 4, (dcp_bytes, base_bytes)
    meta = json.loads((ckpt / "metadata.json").read_text())
    record = meta["lora"]["student"]
    assert record["rank"] == 4 and record["alpha"] == 8.0 and record["base"]["path"].endswith("transformer")
    assert len(record["base"]["sha256"]) == 64


def test_merged_export_is_base_plus_adapter(trained, tmp_path):
    from diffusers import WanTransformer3DModel

    from distillery.export.weights import export_weights, load_base_with_adapter, load_role_weights

    ckpt = trained["result"].checkpoint
    meta = json.loads((ckpt / "metadata.json").read_text())
    config = json.loads((ckpt / "roles" / "student" / "config.json").read_text())
    adapted = load_base_with_adapter(meta["lora"]["student"], config, "test")
    load_role_weights(ckpt, "student", adapted, adapters_only=True)
    out = export_weights(ckpt, "student", tmp_path / "merged", lora="merged")
    assert not (tmp_path / "merged" / "lora").exists()
    merged = WanTransformer3DModel.from_pretrained(out)
    assert not any("lora" in n for n in merged.state_dict())
    torch.testing.assert_close(_forward(merged), _forward(adapted), atol=1e-5, rtol=1e-5)
    # the adapter moved the output away from the base's (so the comparison above sees it)
    base = WanTransformer3DModel.from_pretrained(trained["base"] / "transformer")
    assert (_forward(base) - _forward(merged)).abs().max() > 1e-3


def test_adapter_file_loads_in_a_stock_wan_pipeline(trained, tmp_path):
    from diffusers import WanPipeline, WanTransformer3DModel

    from distillery.export.weights import export_weights

    ckpt = trained["result"].checkpoint
    lora_dir = export_weights(ckpt, "student", tmp_path / "adapter", lora="adapter")
    assert lora_dir == tmp_path / "adapter" / "lora" and not (tmp_path / "adapter" / "transformer").exists()
    assert sorted(p.name for p in lora_dir.iterdir()) == ["base.json", "pytorch_lora_weights.safetensors"]
    base_info = json.loads((lora_dir / "base.json").read_text())
    assert base_info["base"]["path"] == str(trained["base"] / "transformer") and base_info["rank"] == 4
    pipe = WanPipeline.from_pretrained(trained["base"])  # stock diffusers, the base the adapter says it needs
    pipe.load_lora_weights(lora_dir)
    merged = WanTransformer3DModel.from_pretrained(export_weights(ckpt, "student", tmp_path / "merged", lora="merged"))
    for seed in (0, 1):
        torch.testing.assert_close(_forward(pipe.transformer, seed), _forward(merged, seed), atol=1e-5, rtol=1e-5)


def test_export_refuses_a_changed_base_and_adapter_of_full_weights(trained, tmp_path, tiny_base, latent_set):
    import shutil

    from distillery.common.errors import UserError
    from distillery.export.weights import export_weights

    result = train_in_process(run_config(tiny_base, latent_set, tmp_path / "full", steps=1))
    with pytest.raises(UserError, match="trained its full weights, not a LoRA adapter"):
        export_weights(result.checkpoint, "student", tmp_path / "x", lora="adapter")
    # an adapter whose base moved: one line naming it, nothing written
    base_copy = tmp_path / "base"
    shutil.copytree(trained["base"], base_copy)
    moved = fit_in_process(_lora_config(base_copy, latent_set, tmp_path / "moved", steps=1))[0]
    shutil.rmtree(base_copy)
    with pytest.raises(UserError, match="which is not here") as info:
        export_weights(moved.checkpoint, "student", tmp_path / "y")
    assert "\n" not in str(info.value) and not (tmp_path / "y" / "transformer").exists()


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distillery.cli.main", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.process
@pytest.mark.parametrize("where, lora, expected", [
    ("teacher", dict(LORA), "models.teacher.lora: the teacher is frozen (trainable: false)"),
    ("student", {"rank": 4, "target_modules": ["to_qq"]}, "models.student.lora.target_modules: 'to_qq' names no Linear layer"),
    ("student", {"rank": 0}, "models.student.lora.rank: 0: must be"),
    ("student", {"rank": 4096}, "models.student.lora.rank: 4096: must be"),
    ("student", {"rank": 256}, "models.student.lora.rank: 256 is wider than the narrowest targeted layer (128)"),
    ("student", {"rank": 4, "target_modules": []}, "models.student.lora.target_modules: []: must name at least one"),
])
def test_bad_lora_configs_are_one_line_before_any_work(tmp_path, tiny_base, latent_set, where, lora, expected):
    cfg = run_config(tiny_base, latent_set, tmp_path / "run", method="distillery.methods.dmd2.DMD2Method")
    for role, trainable in (("teacher", False), ("critic", True)):
        cfg["models"][role] = {"_target_": "distillery.models.wan.WanModel", "init_from": str(tiny_base), "trainable": trainable}
    cfg["models"][where]["lora"] = lora
    out = _cli("train", "--config", str(write_config(tmp_path / "run.yaml", cfg)), cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
    assert expected in out.stderr, out.stderr
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_lora_config_round_trips_and_overrides(tiny_base, latent_set, tmp_path):
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.config.loader import dump_run_config

    cfg = _lora_config(tiny_base, latent_set, tmp_path / "run")
    config = load_run_config(raw=cfg, prefixes=allowed_prefixes(), overrides=[("models.student.lora.rank", "8")])
    assert config.models["student"].lora.rank == 8 and config.models["student"].lora.alpha == 8.0
    assert "lora:" in dump_run_config(config)
    cfg["models"]["student"]["lora"] = None  # null: no adapter
    assert load_run_config(raw=cfg, prefixes=allowed_prefixes()).models["student"].lora is None


@pytest.mark.slow
def test_lora_under_compile_and_activation_checkpointing_matches_eager(tmp_path, tiny_base, latent_set):
    """The engine's compile (regional, per block) and activation checkpointing (a share of the blocks) over the
    PEFT layers: the adapter trains as it does eagerly (CPU fp32; Inductor's kernels differ in the last bits)."""
    eager = fit_in_process(_lora_config(tiny_base, latent_set, tmp_path / "eager", steps=2))[0]
    cfg = _lora_config(tiny_base, latent_set, tmp_path / "compiled", steps=2)
    cfg["training"]["model"] = {"compile": True, "activation_checkpointing": True, "activation_checkpointing_fraction": 0.5}
    compiled = fit_in_process(cfg)[0]
    a = dcp_tensors(eager.checkpoint, ("roles.student.",))
    b = dcp_tensors(compiled.checkpoint, ("roles.student.",))
    assert a.keys() == b.keys() and a
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-4, rtol=1e-3)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)


@pytest.mark.process
def test_export_weights_cli_takes_the_lora_form(trained, tmp_path):
    ckpt = trained["result"].checkpoint
    out = _cli("export-weights", str(ckpt), "--out", str(tmp_path / "x"), "--lora", "adapter", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "x" / "lora" / "pytorch_lora_weights.safetensors").is_file() and not (tmp_path / "x" / "transformer").exists()
    both = _cli("export-weights", str(ckpt), "--out", str(tmp_path / "y"), cwd=tmp_path)  # default: both
    assert both.returncode == 0 and (tmp_path / "y" / "lora").is_dir() and (tmp_path / "y" / "transformer").is_dir()


def test_ema_of_the_adapter_exports_as_base_plus_shadow(tmp_path, tiny_base, latent_set):
    from diffusers import WanTransformer3DModel

    from distillery.export.weights import export_weights

    cfg = _lora_config(tiny_base, latent_set, tmp_path / "run", steps=3)
    cfg["callbacks"] = {"ema": {"_target_": "distillery.callbacks.ema.EMACallback", "decay": 0.5}}
    ckpt = train_in_process(cfg).checkpoint
    shadow = dcp_tensors(ckpt, ("callbacks.ema.",))
    assert shadow and all(".lora_" in k for k in shadow)  # the EMA averages the adapter only
    ema = WanTransformer3DModel.from_pretrained(export_weights(ckpt, "student", tmp_path / "ema", ema="ema", lora="merged"))
    raw = WanTransformer3DModel.from_pretrained(export_weights(ckpt, "student", tmp_path / "raw", lora="merged"))
    assert not torch.allclose(_forward(ema), _forward(raw), atol=1e-6)
    # the shadow's own adapter, loaded onto the base by stock diffusers, is the EMA export's forward
    from diffusers import WanPipeline

    lora_dir = export_weights(ckpt, "student", tmp_path / "ema-adapter", ema="ema", lora="adapter")
    pipe = WanPipeline.from_pretrained(tiny_base)
    pipe.load_lora_weights(lora_dir)
    torch.testing.assert_close(_forward(pipe.transformer), _forward(ema), atol=1e-5, rtol=1e-5)


def test_lora_under_the_bf16_compute_copy(tmp_path, tiny_base, latent_set):
    """One rank, bf16 compute (the GPU's default placement, run here on the CPU): the bf16 copy carries the adapter,
    its gradients reach the fp32 master adapter, and after each step the copy holds the master's adapter again; the
    base stays as loaded in both."""
    from diffusers import WanTransformer3DModel

    cfg = _lora_config(tiny_base, latent_set, tmp_path / "run", steps=2)
    cfg["training"]["distributed"] = {"mixed_precision": "bf16"}
    model = fit_in_process(cfg)[1].run.models["student"]
    assert model.compute_copy is not None and model.compute_dtype == torch.bfloat16
    master, copy = dict(model.transformer.named_parameters()), dict(model.forward_module.named_parameters())
    base = WanTransformer3DModel.from_pretrained(tiny_base / "transformer").state_dict()
    trained = [n for n in master if "lora_B" in n and master[n].abs().sum() > 0]
    assert trained and all(master[n].dtype == torch.float32 for n in trained)
    for name, param in master.items():
        assert torch.equal(copy[name], param.to(torch.bfloat16)), name
        if ".lora_" not in name:
            assert not param.requires_grad and torch.equal(param, base[name.replace(".base_layer.", ".")]), name
