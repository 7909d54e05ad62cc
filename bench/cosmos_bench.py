"""Benchmark: Cosmos Predict 2.5 (2B) at its native shape with random weights in the real layout — one SFT step's time
and peak memory through our trainer, and one video end to end from its exported 4-NFE student (issue 63).

The shape is the released one (nvidia/Cosmos-Predict2.5-2B, diffusers' ``CosmosTransformer3DModel`` config: 16 heads ×
128 = 2048 wide, 28 blocks, mlp 4, AdaLN-LoRA 256, patch (1, 2, 2), RoPE scale (1, 3, 3), in 17 = 16 latent + the
condition mask, out 16, the Qwen2.5-VL-7B prompt embedding of 28 layers × 3584 = 100,352 projected to 1024), Wan 2.1's
VAE (8× space, 4× time) and Qwen2.5-VL-7B (28 layers of 3584; its vision tower as released). One video is 93 frames ×
704 × 1280 (the pipeline's defaults): latents 16 × 24 × 88 × 160, 24 × 44 × 80 = 84,480 tokens; prompts of 512
tokens. ``concat_padding_mask`` is the release's (true) where torchvision imports, else false (diffusers resizes the
mask with torchvision; the result says which ran).

1. **SFT step** (``sft``): a config-only folder of that layout (recognised as ``cosmos-predict2.5``),
   ``CosmosModel(random_init)`` drawn on the GPU, the ``Trainer`` with SFT, bf16 compute on fp32 masters, FSDP2 on a
   world of one, activation checkpointing, fused AdamW, clip 1, batch 1, ``--steps`` (median after ``--warmup``).
2. **Exported 4-NFE student** (``export``): an export folder as the export stage assembles it (the parts' weights
   random, bf16 transformer and text encoder built on the GPU, fp32 VAE; a ``few_step_x0`` contract of 4 steps; the
   shipped code, ``model_index.json`` naming ``pipeline_cosmos.DistilledCosmosPipeline``), loaded as its card says
   (``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True, safety_checker=..., torch_dtype=bf16)``, a
   pass-through checker: NVIDIA's guardrail downloads its own models), then the first video (compile included) and
   warm medians of ``--repeats`` prompt → frames calls (``e2e_s``), with the denoise and decode parts.

Prints ``RESULT {...}`` per part and writes ``$OUT/cosmos_bench.json``.
Usage (device machine, the wheels carried): ``bash bench/gpu_job.sh run python3 bench/cosmos_bench.py [--parts sft,export]``
(estimated on one H100/H200, unmeasured: the SFT part ~3 min — a 2B step at 84,480 tokens with activation
checkpointing, ~10–15 s, the first with the blocks' compile —, the export part ~4–5 min — 2B + 8B random weights
drawn in bf16 on the GPU, written and read back (~21 GB), one video with the blocks' compile, one warm —; run the parts
as two commands where one 8-minute call is too short).
CPU check of this script: ``BENCH_SMOKE=1 python bench/cosmos_bench.py`` (tiny shapes; its times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
OUT = Path(os.environ.get("OUT", "/tmp"))
PADDING_MASK = importlib.util.find_spec("torchvision") is not None
COSMOS_2B = dict(
    _class_name="CosmosTransformer3DModel", in_channels=17, out_channels=16, num_attention_heads=16, attention_head_dim=128,
    num_layers=28, mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256, max_size=[128, 240, 240], patch_size=[1, 2, 2],
    rope_scale=[1.0, 3.0, 3.0], concat_padding_mask=PADDING_MASK, extra_pos_embed_type=None, use_crossattn_projection=True,
    crossattn_proj_in_channels=100352, encoder_hidden_states_channels=1024,
)
QWEN_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, max_position_embeddings=128000, rope_theta=1000000.0,
                    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
QWEN_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[7, 15, 23, 31])
FRAMES, HEIGHT, WIDTH, TEXT_LEN = 93, 704, 1280, 512
VAE_STRIDE = (4, 8, 8)
SHIFT = 5.0
STUDENT = {"sampler": "few_step_x0", "shift": SHIFT, "num_train_timesteps": 1000, "timesteps": [1000.0, 937.5, 833.3, 625.0]}
PROMPT = "a red fox runs across a snowy field at dawn, cinematic, detailed fur"
if SMOKE:
    COSMOS_2B.update(num_attention_heads=2, attention_head_dim=16, num_layers=2, adaln_lora_dim=8, text_embed_dim=32,
                     encoder_hidden_states_channels=32, crossattn_proj_in_channels=2 * 16, max_size=[32, 64, 64])
    QWEN_7B_TEXT.update(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=512, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    QWEN_7B_VISION.update(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                          fullatt_block_indexes=[0])
    FRAMES, HEIGHT, WIDTH, TEXT_LEN = 9, 32, 32, 48


def latent_shape() -> tuple[int, int, int, int]:
    st, sh, sw = VAE_STRIDE
    return COSMOS_2B["out_channels"], (FRAMES - 1) // st + 1, HEIGHT // sh, WIDTH // sw


def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def config_only_folder(root: Path) -> Path:
    """A Cosmos Predict 2.5 folder of configs only (``random_init`` draws the weights): index, transformer, VAE, scheduler."""
    from distillery.tinybase.cosmos import model_index

    folder = root / "cosmos-predict2.5-2b-shape"
    for part in ("transformer", "scheduler", "vae"):
        (folder / part).mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps(model_index()))
    (folder / "transformer" / "config.json").write_text(json.dumps(COSMOS_2B))
    (folder / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 16}))
    (folder / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": SHIFT, "num_train_timesteps": 1000}))
    return folder


def build_on_device(model_class, dev):
    """``model_class.from_config`` drawing its random weights on ``dev`` (for this process: a 2B init on the CPU takes
    longer than the step)."""
    import torch

    on_cpu = model_class.from_config

    def from_config_on_device(*args, **kwargs):
        with torch.device(dev):
            return on_cpu(*args, **kwargs)

    model_class.from_config = from_config_on_device


def sft_run(tmp: Path, student: dict, records: list, text_len: int, steps: int, warmup: int, transformer_class) -> dict:
    """One SFT run of any family through the trainer (module doc: bf16 compute, FSDP2 on one rank, activation
    checkpointing, fused AdamW, clip 1, batch 1): ``records`` written as the latent set under ``tmp``, ``student`` the
    role's model config (its folder's weights drawn on the device: ``transformer_class``). The row's common part."""
    import torch

    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.data import write_latent_shards
    from distillery.engine.assemble import build_trainer
    from distillery.models.registry import family_of

    cuda = torch.cuda.is_available()
    write_latent_shards(records, tmp / "latents", rows_per_shard=len(records))
    raw = {"models": {"student": student}, "method": {"_target_": "distillery.methods.sft.SFTMethod"},
           "training": {"distributed": {"shard_single_rank": True},
                        "data": {"path": str(tmp / "latents"), "batch_size": 1, "text_max_length": text_len},
                        "optimizer": {"learning_rate": 1e-5}, "loop": {"max_train_steps": steps, "progress_bar": False},
                        "checkpoint": {"output_dir": str(tmp / "run"), "save_final": False},
                        "tracker": {"backend": "none"}, "model": {"activation_checkpointing": True}},
           "callbacks": {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}}}
    config = load_run_config(raw=raw, prefixes=allowed_prefixes())
    env = init_distributed(config.training.distributed)
    try:
        build_on_device(transformer_class, env.device)
        t0 = time.perf_counter()
        trainer = build_trainer(config, env)
        build_s = time.perf_counter() - t0
        transformer = trainer.run.models["student"].transformer
        params = sum(p.numel() for p in transformer.parameters())
        trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        result = trainer.fit()
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    finally:
        shutdown()
    times = [row["step_time_s"] for row in result.history]
    return {"part": "sft", "family": family_of(student["init_from"]).name, "params": params, "trainable_params": trainable,
            "steps": steps, "warmup": warmup, "step_s": statistics.median(times[warmup:]) if len(times) > warmup else None,
            "first_step_s": times[0], "step_times": times, "peak_mem_gib": peak, "build_s": build_s,
            "activation_checkpointing": True, "wrapper": "fsdp (one rank)"}


def sft(steps: int, warmup: int) -> dict:
    import torch
    from diffusers import CosmosTransformer3DModel

    from distillery.data import LatentRecord

    with tempfile.TemporaryDirectory() as tmp:
        folder = config_only_folder(Path(tmp))
        g = torch.Generator().manual_seed(0)
        text_width = COSMOS_2B["crossattn_proj_in_channels"]
        records = [LatentRecord(id=f"s{i}", caption="bench", latent=torch.randn(*latent_shape(), generator=g).bfloat16(),
                                text_embedding=torch.randn(TEXT_LEN, text_width, generator=g).bfloat16(), num_frames=FRAMES,
                                height=HEIGHT, width=WIDTH, fps=16.0, source="bench") for i in range(2)]
        student = {"_target_": "distillery.models.cosmos.CosmosModel", "init_from": str(folder), "random_init": True}
        row = sft_run(Path(tmp), student, records, TEXT_LEN, steps, warmup, CosmosTransformer3DModel)
    c, t, h, w = latent_shape()
    return {**row, "model": "Cosmos-Predict2.5-2B shape, random weights", "video": [FRAMES, HEIGHT, WIDTH],
            "latent": [c, t, h, w], "tokens": t * (h // 2) * (w // 2),
            "text": [TEXT_LEN, COSMOS_2B["crossattn_proj_in_channels"]], "concat_padding_mask": PADDING_MASK}


def export_folder(root: Path) -> Path:
    """The export stage's folder of a 4-step student over random real-layout parts (module doc)."""
    import torch
    from diffusers import AutoencoderKLWan, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from distillery.export.code import write_export_code
    from distillery.tinybase.cosmos import model_index
    from distillery.tinybase.shipped import shipped_tiny_cosmos

    dev = device()
    folder = root / "export"
    folder.mkdir(parents=True)
    shutil.copytree(shipped_tiny_cosmos() / "tokenizer", folder / "tokenizer")  # word ids; the embedding table is Qwen's
    FlowMatchEulerDiscreteScheduler(shift=SHIFT).save_pretrained(folder / "scheduler")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(dev), default_dtype(dtype):  # drawn on the GPU in bf16: no fp32 copy of 2B / 8B weights
        transformer = CosmosTransformer3DModel(**{k: v for k, v in COSMOS_2B.items() if not k.startswith("_")})
    transformer.save_pretrained(folder / "transformer")
    del transformer
    with torch.device(dev):
        vae = AutoencoderKLWan(**({"base_dim": 8} if SMOKE else {}))
    vae.save_pretrained(folder / "vae")
    del vae
    qwen = Qwen2_5_VLConfig(text_config=QWEN_7B_TEXT, vision_config=QWEN_7B_VISION)
    with torch.device(dev), default_dtype(dtype):
        encoder = Qwen2_5_VLForConditionalGeneration(qwen)
    encoder.save_pretrained(folder / "text_encoder")
    del encoder
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    (folder / "model_index.json").write_text(json.dumps(model_index()))
    (folder / "sampling.json").write_text(json.dumps(STUDENT))
    write_export_code(folder)
    return folder


@contextlib.contextmanager
def default_dtype(dtype):
    """torch's default dtype is ``dtype`` inside (modules built there hold their weights in it)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class PassThroughChecker:
    """A safety checker that passes everything (the pipeline does not run without one)."""

    def to(self, *args, **kwargs):
        return self

    def check_text_safety(self, prompt):
        return True


def time_videos(build, load, call: dict, prompt: str, repeats: int) -> tuple[object, dict]:
    """The export part's timings, for any family: ``build()`` → the export folder (in a temporary folder it is given),
    ``load(folder)`` → the pipeline on the device; the first video of ``call`` (compile included), then warm medians of
    ``repeats`` prompt → frames calls and prompt → latents calls, and one decode. Returns ``(pipeline, row)``."""
    import torch

    dev = device()

    def timed(fn):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    with tempfile.TemporaryDirectory() as tmp:
        build_s, folder = timed(lambda: build(Path(tmp)))
        load_s, pipe = timed(lambda: load(folder))
        pipe.set_progress_bar_config(disable=True)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        first_s, _ = timed(lambda: pipe(prompt, generator=torch.Generator(dev).manual_seed(0), **call))
        e2e, denoise = [], []
        for _ in range(repeats):
            t, _ = timed(lambda: pipe(prompt, generator=torch.Generator(dev).manual_seed(0), **call))
            e2e.append(t)
            t, latents = timed(lambda: pipe(prompt, generator=torch.Generator(dev).manual_seed(0), **{**call, "output_type": "latent"}))
            denoise.append(t)
        decode_s, _ = timed(lambda: pipe.decode_latents(latents.frames, output_type="np"))
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
        return pipe, {"part": "export", "pipeline": type(pipe).__name__, "nfe": pipe.nfe(call["num_frames"]),
                      "video": [call["num_frames"], call["height"], call["width"]],
                      "plan": pipe.speed_plan.describe(pipe.speed_label), "build_s": round(build_s, 1),
                      "load_s": round(load_s, 1), "first_video_s": round(first_s, 2), "e2e_s": round(statistics.median(e2e), 3),
                      "latents_call_s": round(statistics.median(denoise), 3), "decode_s": round(decode_s, 3),
                      "e2e_times": [round(t, 3) for t in e2e], "peak_gib": peak}


def export(repeats: int) -> dict:
    import torch
    from diffusers import DiffusionPipeline

    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def load(folder: Path):
        return DiffusionPipeline.from_pretrained(str(folder), trust_remote_code=True, torch_dtype=dtype,
                                                 safety_checker=PassThroughChecker()).to(dev)

    call = dict(num_frames=FRAMES, height=HEIGHT, width=WIDTH, max_sequence_length=TEXT_LEN, output_type="np")
    _, row = time_videos(export_folder, load, call, PROMPT, repeats)
    return {**row, "contract": STUDENT, "concat_padding_mask": PADDING_MASK}


def run_parts(parts: dict, chosen: str, out_name: str) -> int:
    """Run the ``chosen`` parts (comma-separated names of ``parts``: name → a call returning its row), each failure a
    row too; print ``RESULT {...}`` per part and write them all to ``$OUT/<out_name>`` after each."""
    import torch

    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    for part in chosen.split(","):
        try:
            row = parts[part]()
        except Exception as exc:  # one part's failure is a result too
            import traceback

            row = {"part": part, "error": f"{type(exc).__name__}: {str(exc)[:500]}", "traceback": traceback.format_exc()[-3000:]}
        results[part] = row
        print("RESULT " + json.dumps(row), flush=True)
        (OUT / out_name).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="sft,export")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    return run_parts({"sft": lambda: sft(args.steps, args.warmup), "export": lambda: export(args.repeats)}, args.parts,
                     "cosmos_bench.json")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    raise SystemExit(main())
