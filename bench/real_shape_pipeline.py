"""Benchmark: the pipeline's stage work at the real Wan2.1-T2V-1.3B shape on one GPU.

Writes a Wan2.1-T2V-1.3B-shaped diffusers folder with random weights (the real-shape transformer,
the Wan2.1 VAE, the UMT5-XXL text encoder — ``--text-encoder small`` for a 2-layer one of the same
width — and the tiny base's tokenizer), a few real-size captioned clips (81 frames, 480×832, 16 fps),
then runs what each stage runs, in order, with small step counts:

  latents   ``distillery.data.preprocess.preprocess`` on the GPU (VAE + text encoder);
  teacher   ``torchrun -m distillery.cli.train`` (SFT of the base) → ``export_weights``;
  pretrain  ``torchrun -m distillery.cli.train`` (Diffusion-Forcing SFT of the causal student from the teacher);
  validate  ``run_validation`` on the GPU with the latent set's stored prompt embeddings (no text encoder);
  export    the teacher as a diffusers folder sampled by stock ``WanPipeline``.

DVC, Prefect and MLflow are not installed on the device image, so the stage adapters themselves
(lineage, tracking) do not run here; every model, data and training path they call does. Per phase:
wall seconds, GPU busy fraction and peak GPU memory (``nvidia-smi`` sampled every 0.2 s), written to
``$OUT/real_shape_pipeline.json`` after each phase. Usage (device machine):
``bash bench/gpu_job.sh run python bench/real_shape_pipeline.py [--text-encoder xxl|small] [--steps 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import yaml

WAN_1_3B = dict(patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                dense_act_fn="gelu_new", is_gated_act=True, layer_norm_epsilon=1e-6, tie_word_embeddings=False)
FRAMES, HEIGHT, WIDTH, FPS = 81, 480, 832, 16.0
OUT = Path(os.environ.get("OUT", "/tmp"))
state_timing: dict[str, object] = {}  # training phases: run_summary.json's step timing (warm-up dropped)
if os.environ.get("BENCH_SMOKE") == "1":  # a CPU check of this script itself: tiny shapes
    WAN_1_3B.update(num_attention_heads=2, attention_head_dim=8, text_dim=32, ffn_dim=32, num_layers=2)
    UMT5_XXL.update(d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4, vocab_size=128)
    FRAMES, HEIGHT, WIDTH = 9, 32, 48


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


DEVICE = _device()


class GpuSampler:
    """``nvidia-smi`` utilisation and memory every 0.2 s in a thread; per-window busy fraction and peak."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float]] = []  # (time, util %, used MiB)
        self._proc = None
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                                           "-lms", "200"], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                util, mem = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.rows.append((time.time(), util, mem))

    def window(self, start: float, end: float) -> dict[str, float]:
        rows = [r for r in self.rows if start <= r[0] <= end]
        if not rows:
            return {}
        return {"gpu_busy_fraction": round(sum(r[1] for r in rows) / len(rows) / 100, 3),
                "peak_gpu_mem_gib": round(max(r[2] for r in rows) / 1024, 1), "samples": len(rows)}

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()


def build_base(root: Path, text_encoder: str, *, name: str = "wan-1.3b-shape", transformer: dict | None = None,
               vae: dict | None = None, index: dict | None = None, note: str = "Wan2.1-T2V-1.3B-shaped") -> Path:
    """The real-shape diffusers folder ``root/name`` (random weights, bf16 transformer and text encoder, fp32 VAE).
    Defaults: Wan2.1-T2V-1.3B (``WAN_1_3B``, the Wan 2.1 VAE of diffusers' defaults, the tiny base's
    ``model_index.json``); ``transformer`` / ``vae``: another layout's configuration (the transformer's
    ``text_dim`` is set to the text encoder's width), ``index``: keys set in ``model_index.json``."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from distillery.tinybase.shipped import shipped_tiny_base

    base = root / name
    tiny = shipped_tiny_base()
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    for part in ("tokenizer", "scheduler"):
        shutil.copytree(tiny / part, base / part)
    shutil.copy2(tiny / "model_index.json", base / "model_index.json")
    if index:
        model_index = json.loads((base / "model_index.json").read_text())
        (base / "model_index.json").write_text(json.dumps({**model_index, **index}, indent=2))
    (base / "README.md").write_text("---\nlibrary_name: diffusers\ndistillery:\n  max_sequence_length: 512\n---\n"
                                    f"{note}, random weights (bench/).\n")
    config = WAN_1_3B if transformer is None else dict(transformer, text_dim=UMT5_XXL["d_model"])
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = WanTransformer3DModel(**config).to(torch.bfloat16)
    model.save_pretrained(base / "transformer")
    del model
    smoke = {"base_dim": 8} if os.environ.get("BENCH_SMOKE") == "1" else {}
    with torch.device(DEVICE):
        autoencoder = AutoencoderKLWan(**(vae if vae is not None else smoke))  # default: the Wan2.1 VAE (diffusers' defaults)
    autoencoder.save_pretrained(base / "vae")
    del autoencoder
    cfg = dict(UMT5_XXL, num_layers=UMT5_XXL["num_layers"] if text_encoder == "xxl" else 2)
    with torch.device(DEVICE):
        encoder = UMT5EncoderModel(UMT5Config(**cfg)).to(torch.bfloat16)
    encoder.save_pretrained(base / "text_encoder")
    del encoder
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return base


def write_clips(root: Path, train: int = 4, validation: int = 2) -> Path:
    """Real-size captioned clips: a coloured square moving over a gradient, 81 frames of 480×832."""
    import numpy as np

    from distillery.clips.video_io import write_video

    data = root / "videos"
    colours = {"red": (230, 40, 40), "blue": (40, 60, 230), "yellow": (230, 210, 40), "green": (40, 200, 60)}
    for split, count in (("train", train), ("validation", validation)):
        (data / split / "videos").mkdir(parents=True, exist_ok=True)
        lines = []
        for i in range(count):
            name, rgb = list(colours.items())[(i + (split == "validation")) % len(colours)]
            frames = np.empty((FRAMES, HEIGHT, WIDTH, 3), np.uint8)
            frames[:] = np.linspace(0, 60, WIDTH, dtype=np.uint8)[None, None, :, None]
            for t in range(FRAMES):
                x = 40 + t * (WIDTH - 200) // FRAMES
                frames[t, 180:300, x:x + 120] = rgb
            write_video(data / split / "videos" / f"{split}{i}.mp4", frames, FPS, crf=18, pix_fmt="yuv420p")
            lines.append(json.dumps({"path": f"videos/{split}{i}.mp4", "caption": f"a {name} square moving right slowly"}))
        (data / split / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return data


def _release_gpu() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_stage(root: Path, name: str, init_from: Path, data: Path, steps: int, causal: bool) -> Path:
    """One training stage's run (torchrun, one GPU, the stage template's method) → its exported model folder."""
    from distillery.export.weights import export_weights

    run_dir = root / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    model = {"_target_": "distillery.models.wan.CausalWanModel" if causal else "distillery.models.wan.WanModel",
             "init_from": str(init_from)}
    method = {"_target_": "distillery.methods.sft.SFTMethod", "caption_dropout": 0.1}
    if causal:
        model["chunk_size"] = 3
        method = {"_target_": "distillery.methods.dfsft.DFSFTMethod", "chunk_size": 3, "caption_dropout": 0.1}
    config = {
        "models": {"student": model}, "method": method,
        "training": {"data": {"path": str(data), "batch_size": 1, "text_max_length": 512},
                     "optimizer": {"learning_rate": 1e-5}, "loop": {"max_train_steps": steps, "log_every": 1},
                     "checkpoint": {"output_dir": str(run_dir), "save_every": 0, "save_final": True},
                     "tracker": {"backend": "none"}},
        "callbacks": {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}},
    }
    run_dir.mkdir(parents=True)
    (run_dir / "run.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "distillery.cli.train",
           "--config", str(run_dir / "run.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (OUT / f"{name}.log").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: torchrun exited {proc.returncode}: {proc.stderr[-1500:]}")
    summary = json.loads((run_dir / "run_summary.json").read_text())
    out = root / "artifacts" / name / "model"
    shutil.rmtree(out, ignore_errors=True)
    export_weights(run_dir / summary["checkpoint"], "student", out)
    shutil.copytree(init_from / "scheduler", out / "scheduler")
    (out / "sampling.json").write_text(json.dumps(summary["sampling"]))
    state_timing[name] = summary.get("timing")
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/tmp/real_shape")
    parser.add_argument("--text-encoder", choices=["xxl", "small"], default="xxl")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--budget", type=float, default=560, help="seconds; phases that would start later are skipped")
    args = parser.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    sampler = GpuSampler()
    started = time.time()
    results: dict[str, dict] = {}
    state: dict[str, Path] = {}

    def phase(name: str, fn, min_left: float = 30) -> None:
        if time.time() - started > args.budget - min_left:
            results[name] = {"skipped": "out of the job's time"}
            return
        t0 = time.time()
        try:
            extra = fn() or {}
            results[name] = {"wall_s": round(time.time() - t0, 1), **extra}
        except Exception as exc:  # noqa: BLE001 - a phase that breaks at real shape is the finding
            results[name] = {"wall_s": round(time.time() - t0, 1), "error": f"{type(exc).__name__}: {str(exc)[-1200:]}"}
            traceback.print_exc()
        results[name].update(sampler.window(t0, time.time()))
        print(name, json.dumps(results[name]), flush=True)
        (OUT / "real_shape_pipeline.json").write_text(json.dumps({"text_encoder": args.text_encoder, "steps": args.steps,
                                                                  "shape": [FRAMES, HEIGHT, WIDTH], "phases": results}, indent=1))

    def base() -> None:
        state["base"] = build_base(root, args.text_encoder)

    def clips() -> None:
        state["videos"] = write_clips(root)

    def latents() -> None:
        from distillery.data.preprocess import PreprocessConfig, preprocess

        out = root / "artifacts" / "latents" / "data"
        shutil.rmtree(out, ignore_errors=True)
        preprocess(state["base"], state["videos"], out, PreprocessConfig(num_frames=FRAMES, height=HEIGHT, width=WIDTH, fps=FPS,
                                                                        batch_size=1, device=DEVICE))
        state["latents"] = out
        _release_gpu()  # a stage is its own process in the pipeline: leave the GPU to the next one

    def teacher() -> dict:
        state["teacher"] = train_stage(root, "teacher", state["base"], state["latents"], args.steps, causal=False)
        return {"timing": state_timing.get("teacher")}

    def pretrain() -> dict:
        state["pretrain"] = train_stage(root, "pretrain", state["teacher"], state["latents"], args.steps, causal=True)
        return {"timing": state_timing.get("pretrain")}

    def validate() -> None:
        from distillery.evaluation.candidates import Candidate, teacher_candidates
        from distillery.evaluation.validate import run_validation
        from distillery.evaluation.validation_config import ValidationConfig
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's stages/ package
        from stages import validate as evaluation

        evaluation.ARTIFACTS = root / "artifacts"
        prompts, embeddings = evaluation.validation_prompts(2)
        cfg = ValidationConfig(num_frames=FRAMES, height=HEIGHT, width=WIDTH, fps=FPS, num_seeds=1,
                               grid_formats=["gif"], device=DEVICE, progress_bar=False)
        candidates = teacher_candidates(state["teacher"], [4], 4.0)
        if "pretrain" in state:
            candidates.append(Candidate.from_artifact("pretrain_4", state["pretrain"], 4, 4.0))
        metrics = run_validation(state["base"], candidates, prompts, root / "artifacts" / "validate", cfg, prompt_embeddings=embeddings)
        _release_gpu()
        return {"metrics": {k: v for k, v in metrics.items() if "latency" in k or "nfe" in k}}

    def export() -> None:
        import torch
        from diffusers import WanPipeline

        folder = root / "artifacts" / "export"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(state["base"], folder, ignore=shutil.ignore_patterns("transformer"))
        shutil.copytree(state["teacher"] / "transformer", folder / "transformer")
        pipe = WanPipeline.from_pretrained(str(folder), torch_dtype=torch.bfloat16).to(DEVICE)
        video = pipe("a red square moving right slowly", height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=2,
                     guidance_scale=4.0, output_type="latent", generator=torch.Generator(DEVICE).manual_seed(0)).frames
        print("export: stock WanPipeline latents", tuple(video.shape), flush=True)

    for name, fn in (("base", base), ("clips", clips), ("latents", latents), ("teacher", teacher), ("pretrain", pretrain),
                     ("validate", validate), ("export", export)):
        phase(name, fn)
    sampler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
