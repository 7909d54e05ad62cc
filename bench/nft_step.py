"""Benchmark: one DiffusionNFT post-training iteration of a few-step student at the Wan2.1-T2V-1.3B shape, with the
CLIP reward — time and peak memory.

Through the real ``Trainer`` (``build_trainer(config, env).fit()``), one GPU: the student is Wan-1.3B-shaped with random
weights (the real layout, ``sft_step.WAN_1_3B``), a DMD2-style 4-step ``few_step_x0`` contract, latents 21×60×104 and
512×4096 prompt embeddings, bf16 compute over fp32 masters (compiled blocks: ``training.model.compile`` null),
activation checkpointing on, grad clipping at 1.0; the old policy and the reference are shadow weights of the student
(``components/shadow.py``: frozen twins placed like it, fp32 masters and their bf16 compute copies). The reward is
:class:`~distillery.rewards.clip.ClipTextReward` over a CLIP
ViT-L/14-shaped ``CLIPModel`` with random weights (the layout of ``openai/clip-vit-large-patch14``: 24 × 1024 vision
layers at 224 px / patch 14, 12 × 768 text layers, 768-d projections; a byte-level tokenizer), every decoded frame; the
rollouts are decoded by a Wan 2.1-shaped ``AutoencoderKLWan`` with random weights (diffusers' default config, fp32, as
the method decodes: one video at a time).

One **iteration** is one rollout group and its updates: ``--prompts`` prompts (``training.data.batch_size``) ×
``--k`` rollouts (``samples_per_prompt``), sampled by the old policy at 4 NFE, decoded, scored, then
``K·P / minibatch`` optimizer steps of one sample each, each over the contract's first 3 timesteps (3 micro-steps:
the old policy's and the reference's forwards without gradient, the student's with). Two groups are trained; the
second is reported: ``rollout_s`` (its first step minus the median update step: sampling, decoding, scoring),
``update_s`` (the median of its other steps), ``iteration_s`` (the sum of its steps) and the peak memory of the run.

Usage (device machine, one H100/H200, the wheels in .whl/ carried):
``bash bench/gpu_job.sh run python3 bench/nft_step.py --k 4 --prompts 1`` (``[--size 21x60x104]``).
Writes ``$OUT/nft_step.json``. CPU check of this script: ``BENCH_SMOKE=1 python bench/nft_step.py`` (tiny model,
tiny CLIP and VAE, 3×8×8 latents).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_step import TEXT_DIM, TEXT_LEN, init_weights_on, make_assets  # noqa: E402

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
LADDER = [1000.0, 937.5, 833.3, 625.0]  # a 4-step few_step_x0 ladder (the distilled student's contract)
CLIP_L14 = dict(vision=dict(image_size=224, patch_size=14, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                            num_attention_heads=16),
                text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                          max_position_embeddings=77),
                projection_dim=768)
VAE = dict(base_dim=96)  # AutoencoderKLWan's defaults are Wan 2.1's VAE
if SMOKE:
    CLIP_L14 = dict(vision=dict(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2),
                    text=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              max_position_embeddings=77),
                    projection_dim=8)
    VAE = dict(base_dim=8)


def _byte_vocab() -> dict[str, int]:
    """A byte-level CLIP vocabulary without merges (a token per character; what a real tokenizer's cost is not)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = [], 0
    for b in range(256):
        chars.append(chr(b) if b in keep else chr(256 + (shifted := shifted + 1) - 1))
    return {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}


def make_reward_assets(root: Path) -> tuple[Path, Path]:
    """A CLIP folder (random weights, ViT-L/14's layout) and a base folder holding a random Wan 2.1-shaped VAE."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    clip = root / "clip"
    vocab = _byte_vocab()
    text = dict(CLIP_L14["text"], vocab_size=len(vocab), bos_token_id=vocab["<|startoftext|>"],
                eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"])
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config=CLIP_L14["vision"],
                         projection_dim=CLIP_L14["projection_dim"])).save_pretrained(clip)
    CLIPTokenizer(vocab=vocab, merges=[]).save_pretrained(clip)
    base = root / "vae-base"
    AutoencoderKLWan(**VAE).save_pretrained(base / "vae")
    (base / "text_encoder").mkdir(parents=True)
    (base / "text_encoder" / "config.json").write_text(json.dumps({"architectures": ["UMT5EncoderModel"],
                                                                   "d_model": TEXT_DIM}))  # the class names its width
    (base / "tokenizer").mkdir()
    return clip, base


def run_config(model: Path, data: Path, clip: Path, base: Path, out: Path, k: int, prompts: int) -> dict:
    return {
        "models": {"student": {"_target_": "distillery.models.wan.WanModel", "init_from": str(model), "random_init": True}},
        "method": {"_target_": "distillery.methods.rl.nft.DiffusionNFTMethod", "samples_per_prompt": k, "minibatch_size": 1,
                   "sampling": {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": LADDER},
                   "vae_from": str(base),
                   "rewards": {"clip": {"_target_": "distillery.rewards.clip.ClipTextReward", "model_from": str(clip)}}},
        "training": {
            "data": {"path": str(data), "batch_size": prompts, "text_max_length": TEXT_LEN},
            "optimizer": {"learning_rate": 1e-5},
            "loop": {"max_train_steps": 2 * k * prompts, "progress_bar": False},
            "checkpoint": {"output_dir": str(out), "save_final": False},
            "tracker": {"backend": "none"},
            "model": {"activation_checkpointing": not SMOKE},
        },
        "callbacks": {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}},
    }


def run(size: tuple[int, int, int], k: int, prompts: int) -> dict:
    import torch

    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.assemble import build_trainer

    with tempfile.TemporaryDirectory() as tmp:
        model, data = make_assets(Path(tmp), size)
        clip, base = make_reward_assets(Path(tmp))
        config = load_run_config(raw=run_config(model, data, clip, base, Path(tmp) / "run", k, prompts), prefixes=allowed_prefixes())
        env = init_distributed(config.training.distributed)
        init_weights_on(env.device)
        try:
            trainer = build_trainer(config, env)
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            result = trainer.fit()
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        finally:
            shutdown()
    steps = [row["step_time_s"] for row in result.history]
    per_group = k * prompts
    second = steps[per_group:]
    update = statistics.median(second[1:]) if len(second) > 1 else float("nan")
    return {"size": list(size), "samples_per_prompt": k, "prompts": prompts, "updates_per_group": per_group,
            "micro_steps_per_update": 3, "rollout_s": second[0] - update, "update_s": update, "iteration_s": sum(second),
            "first_group_s": sum(steps[:per_group]), "peak_mem_gib": peak, "step_times": steps,
            "reward": [row.get("reward") for row in result.history if "reward" in row],
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=4, help="rollouts per prompt (samples_per_prompt)")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per rollout group (training.data.batch_size)")
    parser.add_argument("--size", default="3x8x8" if SMOKE else "21x60x104", help="latent T x H x W")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    out = run(size, args.k, args.prompts)
    print(f"nft iteration at {args.size} ({out['gpu']}): rollout {out['rollout_s']:.2f} s, update {out['update_s']:.2f} s "
          f"× {out['updates_per_group']}, iteration {out['iteration_s']:.2f} s, peak {out['peak_mem_gib']:.1f} GiB")
    path = Path(os.environ.get("OUT", "/tmp")) / "nft_step.json"
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k != "step_times"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
