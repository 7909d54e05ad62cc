"""Benchmark: SFT or DMD2 training steps of a Wan 2.2 TI2V-5B-shaped transformer (random weights) at its native 720p,
full weights or a LoRA adapter on every trainable role.

The shape is the real one (Wan2.2-TI2V-5B, the Wan team's ``wan/configs/wan_ti2v_5B.py`` and the diffusers
folder's ``transformer/config.json``): dim 3072 = 24 heads × 128, 30 layers, ffn 14336, in/out channels 48
(the Wan 2.2 VAE's ``z_dim``), patch (1, 2, 2), text_dim 4096, freq_dim 256; flow shift 5.0. The VAE compresses
4× in time and 16× in space, so 121 frames × 704 × 1280 are latents 31 × 44 × 80 ((121 − 1)/4 + 1 = 31,
704/16 = 44, 1280/16 = 80) and 31 × 22 × 40 = 27,280 tokens after the 2×2 patch.

The step is our engine's real path: a config-only diffusers folder of the TI2V-5B layout (``model_index.json``
with ``expand_timesteps: true``, a VAE config of ``z_dim`` 48 — recognised as the ``wan2.2-ti2v-5b`` family, so
the transformer gets one timestep per token as ``WanPipeline`` feeds it), ``WanModel`` with ``random_init`` (weights
drawn on the GPU), the ``Trainer`` with SFT, bf16 compute on fp32 master weights, fused AdamW, grad clipping at 1,
batch 1, 512 × 4096 text; ``--wrapper fsdp`` (default): FSDP2 on a world of one (``shard_single_rank``),
``plain``: no wrapper (a bf16 compute copy beside the fp32 masters). Activation checkpointing on by default
(``--no-ac`` turns it off), ``training.model.compile`` null (regional compile on CUDA in bf16).

``--method dmd2``: the step of ``bench/distill_step.py``'s ``dmd2_data`` on this layout — student and critic trained
(critic betas [0, 0.999]), the teacher frozen, teacher CFG 4, a generator and a critic update every iteration, a
4-step student ladder; all three roles TI2V-5B-shaped. ``--lora R``: ``models.<role>.lora`` of rank R (alpha R) on
q, k, v, out of both attentions and the two FFN projections of every block, for every trainable role (the frozen
base weights stay fp32 beside the adapters, as in ``bench/lora_step.py``).

Reports, as JSON (stdout ``RESULT {...}`` and ``$OUT/wan22_step_<method>[_lora].json``): the median post-warm-up step time
(the trainer's ``step_time_s``), the first step's, the peak CUDA memory (``max_memory_allocated``), the family the
folder was recognised as, the latent shape and token count.

Usage (device machine):  python bench/wan22_step.py [--method sft|dmd2] [--lora 64] [--steps 8 --warmup 3]
                         [--wrapper fsdp|plain] [--no-ac]
CPU check of this script:  ``BENCH_SMOKE=1 python bench/wan22_step.py`` (a tiny transformer of the same layout,
latents 3 × 8 × 8; its times mean nothing).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_step import init_weights_on  # noqa: E402

TI2V_5B = dict(
    _class_name="WanTransformer3DModel", patch_size=[1, 2, 2], num_attention_heads=24, attention_head_dim=128,
    in_channels=48, out_channels=48, text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, image_dim=None,
    added_kv_proj_dim=None, pos_embed_seq_len=None,
)
VAE_STRIDE = (4, 16, 16)  # the Wan 2.2 VAE: time, height, width
FRAMES, HEIGHT, WIDTH = 121, 704, 1280
TEXT_LEN, TEXT_DIM = 512, 4096
SHIFT = 5.0
if os.environ.get("BENCH_SMOKE") == "1":  # a CPU check of this script itself, tiny shapes
    TI2V_5B.update(num_attention_heads=2, attention_head_dim=16, text_dim=64, ffn_dim=64, num_layers=2)
    FRAMES, HEIGHT, WIDTH, TEXT_LEN, TEXT_DIM = 9, 128, 128, 16, 64


def latent_shape() -> tuple[int, int, int, int]:
    """``(C, T, H, W)`` of one video of ``FRAMES × HEIGHT × WIDTH`` through the Wan 2.2 VAE."""
    st, sh, sw = VAE_STRIDE
    return TI2V_5B["in_channels"], (FRAMES - 1) // st + 1, HEIGHT // sh, WIDTH // sw


def make_assets(root: Path) -> tuple[Path, Path]:
    """A config-only TI2V-5B-layout folder (no weights: ``random_init``) and a 2-sample latent set."""
    import torch

    from distillery.data import LatentRecord, write_latent_shards

    model = root / "wan2.2-ti2v-5b"
    for part in ("transformer", "scheduler", "vae"):
        (model / part).mkdir(parents=True, exist_ok=True)
    (model / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "boundary_ratio": None, "expand_timesteps": True,
        "transformer": ["diffusers", "WanTransformer3DModel"], "transformer_2": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}))
    (model / "transformer" / "config.json").write_text(json.dumps(TI2V_5B))
    (model / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 48, "is_residual": True,
                                                           "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4}))
    (model / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": SHIFT, "num_train_timesteps": 1000}))
    data = root / "latents"
    g = torch.Generator().manual_seed(0)
    records = [
        LatentRecord(id=f"s{i}", caption="bench", latent=torch.randn(*latent_shape(), generator=g).bfloat16(),
                     text_embedding=torch.randn(TEXT_LEN, TEXT_DIM, generator=g).bfloat16(), num_frames=FRAMES,
                     height=HEIGHT, width=WIDTH, fps=24.0, source="bench")
        for i in range(2)
    ]
    write_latent_shards(records, data, rows_per_shard=2)
    from distillery.data.dataset import write_empty_prompt_embedding  # the negative prompt DMD2's teacher CFG reads

    write_empty_prompt_embedding(data, torch.randn(TEXT_LEN, TEXT_DIM, generator=g).bfloat16())
    return model, data


LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def run_config(model: Path, data: Path, out: Path, steps: int, wrapper: str, ac: bool, method: str = "sft",
               lora: int | None = None) -> dict:
    """The raw run config of one configuration: ``method`` ``sft`` (one trainable student) or ``dmd2`` (student and
    critic trained, a frozen teacher); ``lora``: an adapter of that rank on every trainable role, else full weights."""
    wan = "distillery.models.wan.WanModel"
    adapter = {"lora": {"rank": lora, "alpha": float(lora), "target_modules": LORA_TARGETS}} if lora else {}
    models = {"student": {"_target_": wan, "init_from": str(model), "random_init": True, **adapter}}
    target = {"_target_": "distillery.methods.sft.SFTMethod"}
    if method == "dmd2":
        models["critic"] = {"_target_": wan, "init_from": str(model), "random_init": True, **adapter,
                            "optimizer": {"learning_rate": 1e-5, "betas": [0.0, 0.999]}}
        models["teacher"] = {"_target_": wan, "init_from": str(model), "random_init": True, "trainable": False}
        target = {"_target_": "distillery.methods.dmd2.DMD2Method", "rollout": "data_latent", "generator_update_interval": 1,
                  "real_score_guidance_scale": 4.0, "num_student_steps": 4}
    return {
        "models": models,
        "method": target,
        "training": {
            "distributed": {"shard_single_rank": wrapper == "fsdp", **({"reshard_after_forward": True} if method == "dmd2" else {})},
            "data": {"path": str(data), "batch_size": 1, "text_max_length": TEXT_LEN},
            "optimizer": {"learning_rate": 1e-5},
            "loop": {"max_train_steps": steps, "progress_bar": False},
            "checkpoint": {"output_dir": str(out), "save_final": False},
            "tracker": {"backend": "none"},
            "model": {"activation_checkpointing": ac},
        },
        "callbacks": {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}},
    }


def run(steps: int, warmup: int, wrapper: str, ac: bool, method: str = "sft", lora: int | None = None) -> dict:
    import torch

    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.assemble import build_trainer
    from distillery.models.registry import family_of

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        model, data = make_assets(Path(tmp))
        family = family_of(model).name
        config = load_run_config(raw=run_config(model, data, Path(tmp) / "run", steps, wrapper, ac, method, lora), prefixes=allowed_prefixes())
        env = init_distributed(config.training.distributed)
        try:
            init_weights_on(env.device)
            t0 = time.perf_counter()
            trainer = build_trainer(config, env)
            build_s = time.perf_counter() - t0
            student = trainer.run.models["student"]
            assert student.layout.expand_timesteps, "the TI2V-5B layout was not read: timesteps would not be per token"
            params = sum(p.numel() for p in student.transformer.parameters())
            trainable = sum(p.numel() for m in trainer.run.models.values() for p in m.transformer.parameters()
                            if p.requires_grad)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            static = torch.cuda.memory_allocated() / 2**30 if cuda else None
            result = trainer.fit()
            if cuda:
                torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        finally:
            shutdown()
    times = [row["step_time_s"] for row in result.history]
    c, t, h, w = latent_shape()
    p_t, p_h, p_w = TI2V_5B["patch_size"]
    return {"model": "Wan2.2-TI2V-5B shape, random weights", "family": family, "params": params,
            "video": [FRAMES, HEIGHT, WIDTH], "latent": [c, t, h, w], "tokens": (t // p_t) * (h // p_h) * (w // p_w),
            "method": method, "lora_rank": lora, "trainable_params": trainable,
            "wrapper": wrapper, "activation_checkpointing": ac, "batch_size": 1, "text": [TEXT_LEN, TEXT_DIM],
            "steps": steps, "warmup": warmup, "step_s": statistics.median(times[warmup:]) if len(times) > warmup else None,
            "first_step_s": times[0], "step_times": times, "peak_mem_gib": peak, "static_mem_gib": static, "build_s": build_s,
            "final_loss": result.history[-1].get("total_loss"),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--wrapper", default="fsdp", choices=["fsdp", "plain"])
    parser.add_argument("--no-ac", action="store_true", help="activation checkpointing off (on by default)")
    parser.add_argument("--method", default="sft", choices=["sft", "dmd2"])
    parser.add_argument("--lora", type=int, default=None, help="a LoRA adapter of this rank on every trainable role")
    args = parser.parse_args()
    out = run(args.steps, args.warmup, args.wrapper, not args.no_ac, args.method, args.lora)
    print("RESULT " + json.dumps(out), flush=True)
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    (out_dir / f"wan22_step_{args.method}{'_lora' if args.lora else ''}.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
