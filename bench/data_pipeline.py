"""CPU benchmark of the data path: preprocessing clips/s, and the latent loader's samples/s against
what the tiny SFT step consumes (the loader must be ≥ 10× faster).

Usage: .venv/bin/python bench/data_pipeline.py [--out results.json]   (2-core machine: ~2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    import torch

    from distillery.clips.synthetic import ClipSetConfig, make_clip_set
    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.data import LatentBatchLoader, LatentDataset, ShardedBatchSampler
    from distillery.data.preprocess import PreprocessConfig, preprocess
    from distillery.engine.assemble import build_trainer
    from distillery.tinybase.tiny import make_tiny_base

    res: dict = {"machine": f"{os.cpu_count()} CPU cores", "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        clips = make_clip_set(root / "clips", ClipSetConfig())
        res["clips_make_s"] = time.perf_counter() - t0
        base = make_tiny_base(root / "base")
        t0 = time.perf_counter()
        manifest = preprocess(base, clips, root / "lat", PreprocessConfig(num_frames=17))
        seconds = time.perf_counter() - t0
        n = sum(c["rows"] for c in manifest["splits"].values())
        res["preprocess"] = {"clips": n, "seconds": seconds, "clips_per_s": n / seconds}

        ds = LatentDataset(root / "lat", "train")
        loader = LatentBatchLoader(ds, ShardedBatchSampler(len(ds), args.batch_size, 0, 1, seed=0), text_max_length=32)
        next(loader)
        t0 = time.perf_counter()
        batches = 300
        for _ in range(batches):
            next(loader)
        load_s = time.perf_counter() - t0
        res["loader"] = {"batch_size": args.batch_size, "samples_per_s": batches * args.batch_size / load_s}

        raw = {
            "models": {"student": {"_target_": "distillery.models.wan.WanModel", "init_from": str(base)}},
            "method": {"_target_": "distillery.methods.sft.SFTMethod", "caption_dropout": 0.1},
            "training": {"data": {"path": str(root / "lat"), "batch_size": args.batch_size, "text_max_length": 32},
                         "loop": {"max_train_steps": 25, "progress_bar": False},
                         "checkpoint": {"output_dir": str(root / "run"), "save_final": False},
                         "tracker": {"backend": "none"}},
            "callbacks": {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback"}},
        }
        config = load_run_config(raw=raw, prefixes=allowed_prefixes())
        env = init_distributed(config.training.distributed)
        try:
            result = build_trainer(config, env).fit()
        finally:
            shutdown()
        step_s = statistics.median(r["step_time_s"] for r in result.history[5:])
        res["sft_step"] = {"batch_size": args.batch_size, "step_s": step_s, "samples_per_s": args.batch_size / step_s}
        res["loader_over_training"] = res["loader"]["samples_per_s"] / res["sft_step"]["samples_per_s"]
    print(json.dumps(res, indent=1))
    print(f"\npreprocess {res['preprocess']['clips_per_s']:.1f} clips/s | loader {res['loader']['samples_per_s']:.0f} samples/s | "
          f"SFT consumes {res['sft_step']['samples_per_s']:.0f} samples/s | ratio {res['loader_over_training']:.0f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
