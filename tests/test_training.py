"""Single-process training on the tiny Wan: SFT/DFSFT learn, resume is bitwise, export matches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import read_log, role_state, run_config, train_in_process

from distillery.common.errors import UserError

CALLBACKS = {
    "grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0},
    "ema": {"_target_": "distillery.callbacks.ema.EMACallback", "decay": 0.9},
}


def _mean(rows, key="total_loss"):
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.parametrize(
    "method, knobs",
    [("distillery.methods.sft.SFTMethod", {}), ("distillery.methods.dfsft.DFSFTMethod", {"chunk_size": 2})],  # 3 latent frames: 2 chunks
)
def test_loss_falls_within_50_steps(tmp_path, tiny_base, latent_set, method, knobs):
    cfg = run_config(tiny_base, latent_set, tmp_path / "run", method=method, method_knobs=knobs, steps=50, lr=1e-3)
    train_in_process(cfg)
    rows = read_log(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 51))
    first, last = _mean(rows[:8]), _mean(rows[-8:])
    assert last < 0.6 * first, (first, last)


def test_stopped_and_resumed_run_is_bitwise_equal(tmp_path, tiny_base, latent_set):
    steps = 8
    full = run_config(tiny_base, latent_set, tmp_path / "full", steps=steps, callbacks=CALLBACKS)
    full["training"]["optimizer"].update(lr_scheduler="cosine", warmup_steps=2)
    train_in_process(full)
    split = json.loads(json.dumps(full))
    split["training"]["checkpoint"]["output_dir"] = str(tmp_path / "split")
    split["training"]["loop"]["stop_at_step"] = steps // 2
    first = train_in_process(split)
    assert first.final_step == steps // 2
    split["training"]["loop"]["stop_at_step"] = None
    second = train_in_process(split)  # the same command again: resumes from checkpoint-4
    assert second.final_step == steps and second.history[0]["step"] == steps // 2 + 1
    a, b = tmp_path / "full" / f"checkpoint-{steps}", tmp_path / "split" / f"checkpoint-{steps}"
    for ema in (None, "ema"):
        sa, sb = role_state(a, ema=ema), role_state(b, ema=ema)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (ema, k)
    assert read_log(tmp_path / "full") == [
        {**r, "step_time_s": f["step_time_s"], "samples_per_s": f["samples_per_s"]}
        for r, f in zip(read_log(tmp_path / "split"), read_log(tmp_path / "full"))
    ]
    assert not role_state(a, ema="ema")["proj_out.weight"].equal(role_state(a)["proj_out.weight"])


def test_rerun_of_a_finished_run_trains_nothing(tmp_path, tiny_base, latent_set):
    cfg = run_config(tiny_base, latent_set, tmp_path / "run", steps=3)
    train_in_process(cfg)
    again = train_in_process(cfg)
    assert again.history == [] and again.final_step == 3
    assert again.checkpoint == tmp_path / "run" / "checkpoint-3"


def test_keep_last_prunes_old_checkpoints(tmp_path, tiny_base, latent_set):
    cfg = run_config(tiny_base, latent_set, tmp_path / "run", steps=6, save_every=2)
    cfg["training"]["checkpoint"]["keep_last"] = 2
    train_in_process(cfg)
    names = sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_dir())
    assert names == ["checkpoint-4", "checkpoint-6"]


def test_checkpoint_holds_no_pickled_objects_and_verifies(tmp_path, tiny_base, latent_set):
    """Every piece of training state is a DCP tensor under the method's conventional keys (no
    pickled item in the shards: BytesStorageMetadata would mean one), RNGs are JSON + safetensors,
    every file is in checksums.json, the DCP metadata reads with the restricted unpickler, the
    package source never asks torch.load for pickles, and a checkpoint named by path in the run's
    own folder resumes without a grant."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    import distillery
    from distillery.components.checkpoint.checksums import verify_checkpoint
    from distillery.components.checkpoint.dcp_io import read_dcp_metadata

    cfg = run_config(tiny_base, latent_set, tmp_path / "run", steps=2, save_every=1, callbacks=CALLBACKS)
    cfg["training"]["optimizer"].update(lr_scheduler="cosine", warmup_steps=1)
    train_in_process(cfg)
    ckpt = tmp_path / "run" / "checkpoint-1"
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert files == ["checksums.json", "dcp/.metadata", "dcp/__0_0.distcp", "metadata.json", "rng/rank-0.json",
                     "rng/rank-0.safetensors", "roles/student/config.json"]
    listed = json.loads((ckpt / "checksums.json").read_text())["files"]
    assert sorted(listed) == [f for f in files if f not in ("checksums.json", "metadata.json")]
    assert verify_checkpoint(ckpt) is None
    items = read_dcp_metadata(ckpt / "dcp").state_dict_metadata
    assert not [k for k, v in items.items() if isinstance(v, BytesStorageMetadata)]
    assert all(isinstance(v, TensorStorageMetadata) for v in items.values())
    heads = {k.split(".")[0] + "." + k.split(".")[1] for k in items}
    assert heads == {"roles.student", "optimizers.student", "schedulers.student", "method.rng", "trainer.step",
                     "trainer.data_epoch", "trainer.data_batches_in_epoch", "trainer.data_seed",
                     "trainer.data_num_samples", "callbacks.ema"}, heads
    assert any(k.startswith("roles.student.transformer.") for k in items)
    source = "\n".join(p.read_text() for p in Path(distillery.__file__).parent.rglob("*.py"))
    assert "weights_only=False" not in source and "weights_only = False" not in source
    final = role_state(tmp_path / "run" / "checkpoint-2")
    cfg["training"]["checkpoint"]["resume"] = str(ckpt)
    again = train_in_process(cfg)
    assert again.history[0]["step"] == 2
    redone = role_state(tmp_path / "run" / "checkpoint-2")
    assert all(torch.equal(v, redone[k]) for k, v in final.items())


def test_a_large_state_is_written_as_several_files_and_resumes_the_same(tmp_path, tiny_base, latent_set, monkeypatch):
    """Above ``SPLIT_BYTES`` a rank's DCP state goes to one file per writer thread (written and hashed in
    parallel: a 1.3B role's 17 GB took 29–51 s as one file); every file is checksummed and the resume is
    the same as from one file."""
    from distillery.components.checkpoint import manager
    from distillery.components.checkpoint.checksums import verify_checkpoint

    cfg = run_config(tiny_base, latent_set, tmp_path / "one", steps=2, save_every=1)
    train_in_process(cfg)
    monkeypatch.setattr(manager, "SPLIT_BYTES", 0)
    monkeypatch.setattr(manager.os, "cpu_count", lambda: 4)
    split = run_config(tiny_base, latent_set, tmp_path / "split", steps=2, save_every=1)
    train_in_process(split)
    ckpt = tmp_path / "split" / "checkpoint-1"
    shards = sorted(p.name for p in (ckpt / "dcp").glob("*.distcp"))
    assert len(shards) > 1 and shards[0] == "__0_0.distcp", shards
    assert set(json.loads((ckpt / "checksums.json").read_text())["files"]) >= {f"dcp/{s}" for s in shards}
    assert verify_checkpoint(ckpt) is None
    final = role_state(tmp_path / "one" / "checkpoint-2")
    split_final = role_state(tmp_path / "split" / "checkpoint-2")  # read once, not once per tensor
    assert final.keys() == split_final.keys() and all(torch.equal(v, split_final[k]) for k, v in final.items())
    split["training"]["checkpoint"]["resume"] = str(ckpt)
    again = train_in_process(split)
    assert again.history[0]["step"] == 2
    resumed = role_state(tmp_path / "split" / "checkpoint-2")
    assert final.keys() == resumed.keys() and all(torch.equal(v, resumed[k]) for k, v in final.items())


def test_checkpoint_from_another_model_is_refused(tmp_path, tiny_base, latent_set):
    from distillery.tinybase.tiny import TinyBaseConfig, TinyTransformerConfig, make_tiny_base

    cfg = run_config(tiny_base, latent_set, tmp_path / "run", steps=2)
    train_in_process(cfg)
    other = make_tiny_base(tmp_path / "other", TinyBaseConfig(transformer=TinyTransformerConfig(num_layers=2)))
    cfg["models"]["student"]["init_from"] = str(other)
    cfg["training"]["loop"]["max_train_steps"] = 4
    with pytest.raises(UserError, match="checkpoint is from a different model for role student: num_layers=4 there, 2 here"):
        train_in_process(cfg)


def test_mlflow_run_has_metrics_params_and_config(tmp_path, tiny_base, latent_set):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = run_config(tiny_base, latent_set, tmp_path / "run", steps=4, tracker="mlflow", tracking_uri=uri, callbacks=CALLBACKS)
    result = train_in_process(cfg)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["training.loop.max_train_steps"] == "4"
    assert run.data.params["method._target_"] == "distillery.methods.sft.SFTMethod"
    for key in ("total_loss", "grad_norm/student", "lr/student", "step_time_s", "samples_per_s"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [1, 2, 3, 4], key
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml"}
    local = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
    assert "distillery.models.wan.WanModel" in local.read_text()
    assert str(tmp_path) in run.info.artifact_uri  # a local store, next to the database
    timing = json.loads((tmp_path / "run" / "run_summary.json").read_text())["timing"]
    logged = [json.loads(line)["step_time_s"] for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert timing["steps_timed"] == 2 and timing["warmup_steps_dropped"] == 2  # steps 1-2 (warm-up) dropped
    assert timing["step_time_s"]["median"] == pytest.approx(sorted(logged[2:])[0] / 2 + sorted(logged[2:])[1] / 2, abs=1e-6)
    assert "gpu_step_time_s" not in timing  # CPU: no CUDA events


def test_step_time_summary_drops_warm_up():
    from distillery.components.timing import summarize_step_times

    rows = [{"step_time_s": 20.0, "gpu_step_time_s": 19.0}, {"step_time_s": 1.5, "gpu_step_time_s": 1.9}] + \
           [{"step_time_s": t, "gpu_step_time_s": t} for t in (1.9, 2.0, 1.8)]
    summary = summarize_step_times(rows)
    assert summary == {"steps_timed": 3, "warmup_steps_dropped": 2, "step_time_s": {"median": 1.9, "min": 1.8, "max": 2.0},
                       "gpu_step_time_s": {"median": 1.9, "min": 1.8, "max": 2.0}}
    assert summarize_step_times(rows[:2]) is None


@pytest.mark.process
def test_exported_transformer_reproduces_the_trained_module(tmp_path, tiny_base, latent_set):
    from diffusers import WanTransformer3DModel
    from direct_weights_check import assert_direct_export_is_save_pretrained

    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.assemble import build_trainer
    from distillery.export.weights import export_weights

    config = load_run_config(raw=run_config(tiny_base, latent_set, tmp_path / "run", steps=5), prefixes=allowed_prefixes())
    env = init_distributed(config.training.distributed)
    try:
        trainer = build_trainer(config, env)
        result = trainer.fit()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 8, 3, 8, 8, generator=g)
        text = torch.randn(2, 8, 32, generator=g)
        t = torch.tensor([250.0, 900.0])
        with torch.no_grad():
            trained = trainer.run.models["student"].transformer(x, t, text, return_dict=False)[0]
    finally:
        shutdown()
    out = export_weights(result.checkpoint, "student", tmp_path / "export")
    assert out == tmp_path / "export" / "transformer"
    assert_direct_export_is_save_pretrained(result.checkpoint, "student", tmp_path / "direct")  # Wan 2.1, full weights
    # a training stage's publish of a full-weight role (its warm-up, the export, the plot) imports no diffusers
    probe = (f"import sys; from stages.training import PublishImports; p = PublishImports({str(tiny_base)!r}, diffusers=False); "
             "p._run(); from distillery.export.weights import export_weights; "
             f"export_weights({str(result.checkpoint)!r}, 'student', {str(tmp_path / 'probe')!r}); "
             "from distillery.models.registry import locate_transformer; locate_transformer("
             f"{str(tiny_base)!r}); print(sorted(m for m in sys.modules if m.split('.')[0] == 'diffusers'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    loaded = WanTransformer3DModel.from_pretrained(out)
    with torch.no_grad():
        exported = loaded(x, t, text, return_dict=False)[0]
    torch.testing.assert_close(exported, trained, rtol=0, atol=1e-6)
    base = WanTransformer3DModel.from_pretrained(tiny_base / "transformer")
    with torch.no_grad():
        assert (base(x, t, text, return_dict=False)[0] - trained).abs().max() > 1e-3  # it did train


def test_export_errors_are_user_errors(tmp_path, tiny_base, latent_set):
    from distillery.export.weights import export_weights

    result = train_in_process(run_config(tiny_base, latent_set, tmp_path / "run", steps=1))
    with pytest.raises(UserError, match="no trainable role 'critic'; it holds student"):
        export_weights(result.checkpoint, "critic", tmp_path / "out")
    with pytest.raises(UserError, match="not a complete checkpoint"):
        export_weights(tmp_path, "student", tmp_path / "out")
    with pytest.raises(UserError, match="cannot load EMA callback 'ema'"):
        export_weights(result.checkpoint, "student", tmp_path / "out", ema="ema")


@pytest.mark.parametrize("shard_single_rank", [False, True])
def test_bf16_mixed_precision_trains_with_fp32_master_weights(tmp_path, tiny_base, latent_set, shard_single_rank):
    cfg = run_config(tiny_base, latent_set, tmp_path / "run", steps=30, lr=1e-3)
    cfg["training"]["distributed"] = {"mixed_precision": "bf16", "shard_single_rank": shard_single_rank}
    train_in_process(cfg)
    rows = read_log(tmp_path / "run")
    assert _mean(rows[-5:]) < 0.7 * _mean(rows[:5])
    state = role_state(tmp_path / "run" / "checkpoint-30")
    assert all(t.dtype == torch.float32 for t in state.values())  # master weights stay fp32


def test_bf16_compute_copy_resume_is_bitwise_equal(tmp_path, tiny_base, latent_set):
    """One rank without FSDP, bf16 compute: stop + resume (masters reloaded, the copy refreshed from
    them) ends bitwise equal to the uninterrupted run."""
    full = run_config(tiny_base, latent_set, tmp_path / "full", steps=6, callbacks=CALLBACKS)
    full["training"]["distributed"] = {"mixed_precision": "bf16", "shard_single_rank": False}
    full["training"]["loop"]["grad_accum_steps"] = 2
    train_in_process(full)
    split = json.loads(json.dumps(full))
    split["training"]["checkpoint"]["output_dir"] = str(tmp_path / "split")
    split["training"]["loop"]["stop_at_step"] = 3
    train_in_process(split)
    split["training"]["loop"]["stop_at_step"] = None
    train_in_process(split)
    for ema in (None, "ema"):
        sa, sb = role_state(tmp_path / "full" / "checkpoint-6", ema=ema), role_state(tmp_path / "split" / "checkpoint-6", ema=ema)
        assert all(torch.equal(sa[k], sb[k]) for k in sa), ema
    assert [r["total_loss"] for r in read_log(tmp_path / "full")] == [r["total_loss"] for r in read_log(tmp_path / "split")]


def test_compute_copy_accumulates_grads_in_fp32_and_keeps_buffers():
    from diffusers import WanTransformer3DModel

    from distillery.components.precision import ComputeCopy

    torch.manual_seed(0)
    master = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                   out_channels=4, text_dim=16, freq_dim=16, ffn_dim=16, num_layers=1, rope_max_seq_len=32)
    twin = ComputeCopy(master, torch.bfloat16, torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in twin.module.parameters())
    assert [b.dtype for b in twin.module.buffers()] == [b.dtype for b in master.buffers()]  # RoPE tables not cast
    x, t, text = torch.randn(1, 4, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 3, 16)
    grads = []
    for scale in (1.0, 3.0):
        twin.module(x.bfloat16(), t, (scale * text).bfloat16(), return_dict=False)[0].float().square().mean().backward()
        grads.append({n: p.grad.float().clone() for n, p in twin.module.named_parameters()})
        twin.collect_grads()
        assert all(p.grad is None for p in twin.module.parameters())
    for n, p in master.named_parameters():
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, grads[0][n] + grads[1][n], rtol=0, atol=0)
    # an update far below bf16 resolution is kept by the fp32 master, and reaches the copy once it adds up
    weight = master.proj_out.weight
    with torch.no_grad():
        weight.fill_(1.0)
        twin.refresh()
        for _ in range(3):
            weight.add_(1e-3)  # bf16 spacing at 1.0 is 2**-7 ≈ 7.8e-3
            twin.refresh()
    assert torch.equal(twin.module.proj_out.weight, torch.ones_like(weight, dtype=torch.bfloat16))
    assert weight[0, 0].item() == pytest.approx(1.003)
    with torch.no_grad():
        for _ in range(5):
            weight.add_(1e-3)
        twin.refresh()
    assert twin.module.proj_out.weight[0, 0].item() == pytest.approx(1.0078125)


def test_runtime_choices_resolve_per_device(tmp_path, tiny_base, latent_set):
    from distillery.components.distributed import DistEnv
    from distillery.config.schema import ModelRuntimeConfig
    from distillery.engine.builder import resolve_compile

    def env(device: str, dtype: torch.dtype) -> DistEnv:
        return DistEnv(0, 1, 0, torch.device(device), "gloo", None, dtype)

    assert resolve_compile(ModelRuntimeConfig(), env("cuda", torch.bfloat16)) is True  # null: compiled on GPU
    assert resolve_compile(ModelRuntimeConfig(), env("cpu", torch.float32)) is False
    assert resolve_compile(ModelRuntimeConfig(compile=False), env("cuda", torch.bfloat16)) is False
    cfg = run_config(tiny_base, latent_set, tmp_path / "run", steps=1)
    cfg["training"]["model"] = {"attention_backend": "cudnn"}
    cfg["training"]["distributed"] = {"device": "cpu"}  # a CPU run, also on a host with a GPU
    with pytest.raises(UserError, match="attention_backend: cudnn needs a CUDA device; use native"):
        train_in_process(cfg)
