"""Benchmark: HunyuanVideo 1.5 (8.3B, 480p text-to-video) at its native shape with random weights in the real layout —
one SFT step's time and peak memory through our trainer, and one video end to end from its exported 4-NFE student
(issue 63).

The shape is the released one (diffusers' ``HunyuanVideo15Transformer3DModel`` defaults, the 480p T2V folder's config:
16 heads × 128 = 2048 wide, 54 dual-stream blocks, a 2-layer token refiner, mlp 4, patch 1, in 65 = 32 latent + 32
condition latent + its mask, out 32, Qwen2.5-VL-7B's 3584-wide hidden states and ByT5's 1472-wide glyph stream, SigLIP
1152-wide image tokens (zeros for text-to-video), RoPE axes (16, 56, 56)), its VAE (``AutoencoderKLHunyuanVideo15``:
32 channels, 16× space, 4× time) and its text encoders (Qwen2.5-VL-7B's language model, 28 layers × 3584; ByT5-small,
12 layers × 1472). One video is 121 frames × 480 × 848: latents 32 × 31 × 30 × 53, 31 × 30 × 53 = 49,290 video
tokens (patch 1), beside the prompt's 1000 Qwen and 256 ByT5 token slots (the pipeline's budgets).

1. **SFT step** (``sft``): a config-only folder of that layout (recognised as ``hunyuanvideo1.5``),
   ``HunyuanVideo15Model(random_init)`` drawn on the GPU, the ``Trainer`` with SFT, bf16 compute, FSDP2 on a world of
   one, activation checkpointing, fused AdamW, clip 1, batch 1, ``--steps`` (median after ``--warmup``). Full weights
   do not fit one card: 8.3 B parameters' fp32 masters, gradients and AdamW moments are 133 GB. So the default is a
   LoRA adapter (``--lora 64``: rank 64 on the blocks' attention projections, the base frozen in fp32, 33 GB);
   ``--lora 0`` asks for full weights (for a card, or a later sharded run, with the room).
2. **Exported 4-NFE student** (``export``): an export folder as the export stage assembles it (the parts' weights
   random, the bf16 transformer and text encoders built on the GPU, the VAE in fp32; a ``few_step_x0`` contract of 4
   steps on the pipeline's ``linspace`` σ grid; the shipped code, ``model_index.json`` naming
   ``pipeline_hunyuan15.DistilledHunyuanVideo15Pipeline``; the tokenizers of the tiny HunyuanVideo 1.5: word ids,
   the chat template's 108-token crop), loaded as its card says (``DiffusionPipeline.from_pretrained(folder,
   trust_remote_code=True, torch_dtype=bf16)``), the VAE tiled (``pipe.vae.enable_tiling()``, as HunyuanVideo 1.5's
   model card runs 480p; the fused chunked decode is Wan's VAE's), then the first video (compile included) and warm
   medians of ``--repeats`` prompt → frames calls (``e2e_s``), with the denoise and decode parts.

Prints ``RESULT {...}`` per part and writes ``$OUT/hunyuan15_bench.json``.
Usage (device machine): ``bash bench/gpu_job.sh run python3 bench/hunyuan15_bench.py [--parts sft,export]``
(estimated on one H100/H200, unmeasured: the SFT part ~3–4 min — the 8.3B init on the GPU, 5 LoRA steps at 49,290
tokens with activation checkpointing, ~15–25 s each, the first with the blocks' compile —; the export part ~4–5 min —
8.3B + 7.6B random weights drawn in bf16 on the GPU, written and read back (~32 GB), one video with the blocks'
compile, one warm —; run the parts as two commands where one 8-minute call is too short).
CPU check of this script: ``BENCH_SMOKE=1 python bench/hunyuan15_bench.py`` (tiny shapes; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cosmos_bench import default_dtype, device, run_parts, sft_run, time_videos  # the Cosmos benchmark's parts, any family's

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
OUT = Path(os.environ.get("OUT", "/tmp"))
HUNYUAN15_480P = dict(
    _class_name="HunyuanVideo15Transformer3DModel", in_channels=65, out_channels=32, num_attention_heads=16,
    attention_head_dim=128, num_layers=54, num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
    qk_norm="rms_norm", text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
    rope_axes_dim=[16, 56, 56], target_size=640, task_type="t2v", use_meanflow=False,
)
VAE = dict(latent_channels=32, block_out_channels=[128, 256, 512, 1024, 1024], layers_per_block=2,
           spatial_compression_ratio=16, temporal_compression_ratio=4, scaling_factor=1.03682)
QWEN_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, max_position_embeddings=128000, rope_theta=1000000.0,
                    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
BYT5_SMALL = dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6, feed_forward_proj="gated-gelu")
FRAMES, HEIGHT, WIDTH = 121, 480, 848
QWEN_ROWS, GLYPH_ROWS = 256, 64  # a training prompt's real tokens per stream (the rest of each budget: masked zeros)
SHIFT = 5.0
STUDENT = {"sampler": "few_step_x0", "shift": SHIFT, "num_train_timesteps": 1000, "sigma_grid": "linspace",
           "timesteps": [1000.0, 937.5, 833.3, 625.0]}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
PROMPT = 'a red fox runs across a snowy field at dawn, a sign reads "WINTER", cinematic, detailed fur'
if SMOKE:
    HUNYUAN15_480P.update(num_attention_heads=2, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
                          text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=8, rope_axes_dim=[4, 6, 6],
                          in_channels=17, out_channels=8)
    VAE.update(latent_channels=8, block_out_channels=[8, 8, 16, 16, 16], layers_per_block=1)
    QWEN_7B_TEXT.update(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=2048, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    BYT5_SMALL.update(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    FRAMES, HEIGHT, WIDTH = 9, 64, 64
    QWEN_ROWS, GLYPH_ROWS = 24, 8


def latent_shape() -> tuple[int, int, int, int]:
    return (HUNYUAN15_480P["out_channels"], (FRAMES - 1) // VAE["temporal_compression_ratio"] + 1,
            HEIGHT // VAE["spatial_compression_ratio"], WIDTH // VAE["spatial_compression_ratio"])


def tiny_parts(root: Path) -> Path:
    """The tiny HunyuanVideo 1.5 (its tokenizers, guider and ``model_index.json`` are what the big folders borrow)."""
    from distillery.tinybase.hunyuan15 import make_tiny_hunyuan15

    return make_tiny_hunyuan15(root / "tiny-hunyuan15")


def config_only_folder(root: Path) -> Path:
    """A HunyuanVideo 1.5 folder of configs only (``random_init`` draws the weights): index, transformer, VAE, scheduler."""
    tiny = tiny_parts(root)
    folder = root / "hunyuanvideo1.5-480p-shape"
    for part in ("transformer", "scheduler", "vae"):
        (folder / part).mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny / "model_index.json", folder / "model_index.json")
    (folder / "transformer" / "config.json").write_text(json.dumps(HUNYUAN15_480P))
    (folder / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLHunyuanVideo15", **VAE}))
    (folder / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": SHIFT, "num_train_timesteps": 1000}))
    return folder


def prompt_rows(g) -> "object":
    """One stored training prompt ``[QWEN_ROWS, 3584 + 1472]``: the Qwen stream's rows, the glyph stream's first
    ``GLYPH_ROWS`` (the packed layout of :mod:`distillery.components.prompt_streams`)."""
    import torch

    qwen, glyph = HUNYUAN15_480P["text_embed_dim"], HUNYUAN15_480P["text_embed_2_dim"]
    rows = torch.zeros(QWEN_ROWS, qwen + glyph)
    rows[:, :qwen] = torch.randn(QWEN_ROWS, qwen, generator=g)
    rows[:GLYPH_ROWS, qwen:] = torch.randn(GLYPH_ROWS, glyph, generator=g)
    return rows.bfloat16()


def sft(steps: int, warmup: int, lora: int) -> dict:
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    from distillery.data import LatentRecord

    with tempfile.TemporaryDirectory() as tmp:
        folder = config_only_folder(Path(tmp))
        g = torch.Generator().manual_seed(0)
        records = [LatentRecord(id=f"s{i}", caption="bench", latent=torch.randn(*latent_shape(), generator=g).bfloat16(),
                                text_embedding=prompt_rows(g), num_frames=FRAMES, height=HEIGHT, width=WIDTH, fps=24.0,
                                source="bench") for i in range(2)]
        adapter = {"lora": {"rank": lora, "alpha": float(lora), "target_modules": LORA_TARGETS}} if lora else {}
        student = {"_target_": "distillery.models.hunyuan15.HunyuanVideo15Model", "init_from": str(folder),
                   "random_init": True, **adapter}
        row = sft_run(Path(tmp), student, records, QWEN_ROWS, steps, warmup, HunyuanVideo15Transformer3DModel)
    c, t, h, w = latent_shape()
    return {**row, "model": "HunyuanVideo-1.5 480p T2V shape, random weights", "lora_rank": lora or None,
            "video": [FRAMES, HEIGHT, WIDTH], "latent": [c, t, h, w], "tokens": t * h * w, "text": [QWEN_ROWS, GLYPH_ROWS]}


def export_folder(root: Path) -> Path:
    """The export stage's folder of a 4-step student over random real-layout parts (module doc)."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel
    from transformers import Qwen2_5_VLTextModel, T5Config, T5EncoderModel
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig

    from distillery.export.code import write_export_code

    dev = device()
    tiny = tiny_parts(root)
    folder = root / "export"
    folder.mkdir(parents=True)
    for part in ("tokenizer", "tokenizer_2", "guider"):
        shutil.copytree(tiny / part, folder / part)
    shutil.copy(tiny / "model_index.json", folder / "model_index.json")
    FlowMatchEulerDiscreteScheduler(shift=SHIFT).save_pretrained(folder / "scheduler")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(dev), default_dtype(dtype):  # drawn on the GPU in bf16: no fp32 copy of 8.3B / 7.6B weights
        transformer = HunyuanVideo15Transformer3DModel(**{k: v for k, v in HUNYUAN15_480P.items() if not k.startswith("_")})
    transformer.save_pretrained(folder / "transformer")
    del transformer
    with torch.device(dev):
        AutoencoderKLHunyuanVideo15(**VAE).save_pretrained(folder / "vae")
    tokens = json.loads((tiny / "text_encoder" / "config.json").read_text())  # the tiny tokenizer's special ids
    with torch.device(dev), default_dtype(dtype):
        qwen = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**QWEN_7B_TEXT, bos_token_id=tokens.get("bos_token_id"),
                                                        eos_token_id=tokens.get("eos_token_id"),
                                                        pad_token_id=tokens.get("pad_token_id")))
    qwen.save_pretrained(folder / "text_encoder")
    del qwen
    with torch.device(dev), default_dtype(dtype):
        T5EncoderModel(T5Config(**BYT5_SMALL)).save_pretrained(folder / "text_encoder_2")
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    (folder / "sampling.json").write_text(json.dumps(STUDENT))
    write_export_code(folder)
    return folder


def export(repeats: int) -> dict:
    import torch
    from diffusers import DiffusionPipeline

    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def load(folder: Path):
        pipe = DiffusionPipeline.from_pretrained(str(folder), trust_remote_code=True, torch_dtype=dtype).to(dev)
        pipe.vae.to(torch.float32)  # the VAE in fp32 (module doc), tiled
        pipe.vae.enable_tiling()
        return pipe

    call = dict(num_frames=FRAMES, height=HEIGHT, width=WIDTH, output_type="np")
    _, row = time_videos(export_folder, load, call, PROMPT, repeats)
    return {**row, "contract": STUDENT, "vae": "fp32, tiled"}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="sft,export")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--lora", type=int, default=64, help="the SFT step's LoRA rank (0: full weights, module doc)")
    args = parser.parse_args()
    lora = min(args.lora, 8) if SMOKE else args.lora  # the tiny layers are 32 wide
    return run_parts({"sft": lambda: sft(args.steps, args.warmup, lora), "export": lambda: export(args.repeats)}, args.parts,
                     "hunyuan15_bench.json")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    raise SystemExit(main())
