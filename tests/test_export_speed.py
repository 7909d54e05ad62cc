"""The export's GPU path (``distilled_fast.py``, shipped in every export folder) on the CPU: what it plans where
nothing of it can run (everything stock, said in one line), what it refuses, and that its attention wiring — the
FA4 processors' projections, norms, rotary and output — computes what diffusers' processor computes, checked with
SDPA standing in for the FA4 kernel (the kernel itself needs the GPU: ``bench/export_latency.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from distillery.export.standalone import distilled_causal, distilled_fast
from distillery.export.standalone.distilled_fast import SpeedPlan, SpeedSettings, plan_speed
from distillery.tinybase.shipped import shipped_tiny_base

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def vae() -> AutoencoderKLWan:
    return AutoencoderKLWan.from_pretrained(shipped_tiny_base() / "vae").eval()


def test_on_the_cpu_every_part_is_stock_and_the_line_says_why(vae):
    plan = plan_speed(SpeedSettings(), CPU, torch.float32, vae)
    assert plan.stock and (plan.attention, plan.compiled, plan.decode, plan.fp8) == ("sdpa", False, "stock", False)
    assert set(plan.reasons) == {"attention", "compile", "decode"}
    line = plan.describe()
    assert line.startswith("distilled Wan pipeline: stock path") and "\n" not in line
    assert "SDPA" in line and "needs CUDA" in line and "frame by frame" in line
    assert distilled_fast.decode_chunk_frames(plan, vae, (1, 16, 21, 60, 104)) == 1  # diffusers' own loop


def test_a_fast_plan_describes_what_runs():
    plan = SpeedPlan(attention="fa4", compiled=True, compile_mode="max-autotune-no-cudagraphs", decode="fused",
                     decode_chunk_frames=10)
    line = plan.describe()
    assert not plan.stock and "fast path" in line and "FlashAttention-4" in line
    assert "compiled (max-autotune-no-cudagraphs)" in line and "10 latent frames a call" in line and "fp8 GEMMs off" in line


@pytest.mark.parametrize("switches, says", [
    ({"attention": "fa4"}, "needs CUDA"),
    ({"compile": "blocks"}, "needs CUDA"),
    ({"decode": "fused"}, "needs the VAE on CUDA"),
    ({"fp8": "on"}, "needs CUDA"),
])
def test_a_fast_part_asked_for_where_it_cannot_run_is_refused_saying_why(vae, switches, says):
    with pytest.raises(ValueError, match=says):
        plan_speed(SpeedSettings(**switches), CPU, torch.float32, vae)


@pytest.mark.parametrize("switches", [{"attention": "flash"}, {"compile": True}, {"decode": "chunked"}, {"fp8": True},
                                      {"compile_mode": "max"}, {"decode_chunk_frames": 0}, {"decode_chunk_frames": 10**6}])
def test_a_wrong_switch_is_refused_naming_it(switches):
    with pytest.raises(ValueError, match=next(iter(switches))):
        SpeedSettings(**switches)


def test_cuda_graphs_are_refused_saying_what_was_seen():
    """``reduce-overhead`` broke over regionally compiled Wan blocks on an H200 (BENCHMARKS.md): refused in one line."""
    with pytest.raises(ValueError, match="compile_mode='reduce-overhead': CUDA graphs .* overwrote"):
        SpeedSettings(compile_mode="reduce-overhead")
    assert SpeedSettings(compile_mode="max-autotune-no-cudagraphs").compile_mode == "max-autotune-no-cudagraphs"


def test_fa4_is_refused_in_fp32_and_without_cuda_before_anything_else_is_asked():
    assert "needs CUDA" in distilled_fast.fa4_problem(CPU, torch.bfloat16)
    if torch.cuda.is_available():
        assert "bf16/fp16" in distilled_fast.fa4_problem(torch.device("cuda"), torch.float32)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain attention in the FA4 op's layout ``[B, L, heads, d]``: the stand-in for the kernel."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


@pytest.fixture()
def transformer() -> WanTransformer3DModel:
    return WanTransformer3DModel.from_pretrained(shipped_tiny_base() / "transformer").eval().requires_grad_(False)


def _inputs(transformer: WanTransformer3DModel, frames: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    cfg = transformer.config
    return {"hidden_states": torch.randn(1, cfg.in_channels, frames, 4, 4, generator=gen),
            "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": torch.randn(1, 8, cfg.text_dim, generator=gen), "return_dict": False}


def test_the_fa4_processors_compute_diffusers_attention(transformer, monkeypatch):
    """With SDPA in the kernel's place and the device check passed, a transformer whose self-attention runs
    through the FA4 processors returns what it returns with diffusers' processors (the same operations)."""
    inputs = _inputs(transformer)
    expected = transformer(**inputs)[0]
    monkeypatch.setattr(distilled_fast, "_define_fa4_op", lambda: None)
    monkeypatch.setattr(distilled_fast, "fa4_can_run", lambda x: True)
    calls = []
    monkeypatch.setattr(distilled_fast, "fa4_attention", lambda q, k, v: calls.append(q.shape) or _sdpa(q, k, v))
    distilled_fast.install_fa4(transformer)
    assert all(isinstance(b.attn1.processor, distilled_fast.FA4SelfAttnProcessor) for b in transformer.blocks)
    assert all(isinstance(b.attn2.processor, WanAttnProcessor) for b in transformer.blocks)  # text keys: diffusers'
    got = transformer(**inputs)[0]
    assert len(calls) == len(transformer.blocks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_causal_processor_switched_to_fa4_attends_each_chunk_s_prefix(transformer, monkeypatch):
    """A block-causal student: ``install_fa4`` switches its processors over (not replaces them), and each planned
    call's chunks go to the kernel over their key prefix — the same latents as the SDPA path."""
    x = _inputs(transformer, frames=5)
    model = distilled_causal.CausalWanDenoiser(transformer, 3.0, chunk_size=2)
    from distillery.export.standalone.distilled_wan import Conditioning

    cond = Conditioning(x["encoder_hidden_states"])
    expected = model.velocity(x["hidden_states"], x["timestep"], cond)
    monkeypatch.setattr(distilled_fast, "_define_fa4_op", lambda: None)
    monkeypatch.setattr(distilled_fast, "fa4_can_run", lambda x: True)
    monkeypatch.setattr(distilled_causal, "fa4_can_run", lambda x: True)
    groups = []
    monkeypatch.setattr(distilled_causal, "fa4_attention", lambda q, k, v: groups.append((q.shape[1], k.shape[1])) or _sdpa(q, k, v))
    distilled_fast.install_fa4(transformer)
    assert all(isinstance(b.attn1.processor, distilled_causal.CausalAttnProcessor) and b.attn1.processor.fa4
               for b in transformer.blocks)
    got = model.velocity(x["hidden_states"], x["timestep"], cond)
    per_frame = (4 // transformer.config.patch_size[1]) * (4 // transformer.config.patch_size[2])
    # 5 frames in chunks of 2: queries of frames [0,2), [2,4), [4,5) over keys up to 2, 4, 5 frames — per block
    assert groups == [(2 * per_frame, 2 * per_frame), (2 * per_frame, 4 * per_frame), (per_frame, 5 * per_frame)] * len(transformer.blocks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_an_export_loaded_in_bf16_samples(tmp_path):
    """The card's GPU load (``torch_dtype=torch.bfloat16``) on the CPU: diffusers keeps some of Wan's modules in fp32,
    so the denoiser must feed the transformer in its input layer's dtype, not its first parameter's (it failed)."""
    import json
    import shutil

    from diffusers import DiffusionPipeline

    from distillery.export.code import write_export_code

    folder = tmp_path / "export"
    shutil.copytree(shipped_tiny_base(), folder)
    (folder / "sampling.json").write_text(json.dumps({"sampler": "few_step_x0", "shift": 3.0, "timesteps": [1000.0, 500.0]}))
    write_export_code(folder)
    pipe = DiffusionPipeline.from_pretrained(folder, custom_pipeline=str(folder), trust_remote_code=True,
                                             torch_dtype=torch.bfloat16)
    assert pipe.transformer.patch_embedding.weight.dtype == torch.bfloat16
    assert next(pipe.transformer.parameters()).dtype == torch.float32  # what the denoiser used to read
    out = pipe("a red ball", num_frames=5, height=32, width=32, max_sequence_length=16, output_type="latent",
               generator=torch.Generator().manual_seed(0)).frames
    assert out.dtype == torch.float32 and out.shape[:3] == (1, pipe.vae.config.z_dim, 2) and torch.isfinite(out).all()
    assert pipe.speed_plan.stock
