"""Where does our SFT step spend time beyond the plain-diffusers step? (GPU, Wan-1.3B shape)

Runs variants of the small-latent (21×30×52) step, each in its own process, reporting the median
step time, plus a torch.profiler table of the default variant. Variants toggle one thing each:
FSDP2 resharding after forward, the grad-clip callback, regional compile.

Usage (device machine): python bench/profile_step.py   → table, $OUT/profile_*.txt
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sft_step import TEXT_LEN, make_assets  # noqa: E402

SIZE = (21, 30, 52)
VARIANTS = {
    "default": {},
    "no_reshard": {"reshard_after_forward": False},
    "no_clip": {"clip": False},
    "no_reshard_no_clip": {"reshard_after_forward": False, "clip": False},
}


def run_variant(name: str, steps: int = 12, warmup: int = 4, profile: bool = False) -> dict:
    import torch

    from distillery.config import allowed_prefixes, load_run_config
    from distillery.distributed import init_distributed, shutdown
    from distillery.trainer import Trainer

    opts = VARIANTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        model, data = make_assets(Path(tmp), SIZE)
        raw = {
            "models": {"student": {"_target_": "distillery.models.wan.WanModel", "init_from": str(model), "random_init": True}},
            "method": {"_target_": "distillery.methods.sft.SFTMethod"},
            "training": {
                "distributed": {"reshard_after_forward": opts.get("reshard_after_forward", True)},
                "data": {"path": str(data), "batch_size": 1, "text_max_length": TEXT_LEN},
                "optimizer": {"learning_rate": 1e-5},
                "loop": {"max_train_steps": steps, "progress_bar": False},
                "checkpoint": {"output_dir": str(Path(tmp) / "run"), "save_final": False},
                "tracker": {"backend": "none"},
            },
            "callbacks": {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback"}} if opts.get("clip", True) else {},
        }
        config = load_run_config(raw=raw, prefixes=allowed_prefixes())
        env = init_distributed(config.training.distributed)
        try:
            trainer = Trainer(config, env)
            trainer.method.on_train_start(env.device, env.world_size)
            for cb in trainer.run.callbacks:
                cb.on_train_start(trainer.ctx)
            times = []
            import time

            for step in range(1, steps + 1):
                t0 = time.perf_counter()
                trainer._read_metrics(trainer._train_step(step))
                times.append(time.perf_counter() - t0)
            prof_text = ""
            if profile:
                from torch.profiler import ProfilerActivity, profile as tprofile

                with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for step in range(steps + 1, steps + 4):
                        trainer._read_metrics(trainer._train_step(step))
                prof_text = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
                prof_text += "\n\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
        finally:
            shutdown()
    return {"variant": name, "step_s": statistics.median(times[warmup:]), "times": times, "profile": prof_text}


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp"))
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        res = run_variant(sys.argv[2], profile=sys.argv[2] == "default")
        if res["profile"]:
            (out / f"profile_{sys.argv[2]}.txt").write_text(res.pop("profile"))
        res.pop("profile", None)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    rows = []
    for name in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(name, "FAILED", proc.stderr[-1500:])
            continue
        rows.append(json.loads(line[0][7:]))
        print(name, round(rows[-1]["step_s"], 4), flush=True)
    (out / "profile_variants.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
