"""Benchmark: distillery's DMD2 and Self-Forcing training iterations on the Wan2.1-T2V-1.3B shape vs the plain-diffusers
DMD2 anchor (``shared/anchors/plain_diffusers_dmd2_step.py``).

Runs, in one GPU job, each configuration in its own process (so peak memory is per configuration), through the real
``Trainer`` (parquet latent loading, fp32 master weights + bf16 compute copies of the trainable roles, fused AdamW, grad
clipping at 1.0, one host sync per step), all three roles Wan-1.3B-shaped with random weights, batch 1, 512×4096 text:

  - ``dmd2_data``  — ``DMD2Method``, ``rollout: data_latent`` (the anchor's regime);
  - ``dmd2_sim``   — ``DMD2Method``, ``rollout: simulate`` down a 4-step student ladder (no-grad steps before the exit);
  - ``sf``         — ``SelfForcingMethod``: causal student (``CausalWanModel``, ``chunk_size`` 3: 7 chunks of 21 latent
                     frames), 4-step ladder, bidirectional teacher and critic;
  - ``pdd_euler`` / ``pdd_mid`` — ``PDDMethod`` (``data_latent``): a ``PDDWanModel`` student (the trunk + an 8-head bank,
                     ``pdd_steps`` 8, blocks up to 8) and the frozen teacher, Euler (1 teacher call) or midpoint (2 calls)
                     targets; no critic;
  - ``causal_cd``  — ``CausalCDMethod``: causal student (``chunk_size`` 3) on the data latents, the frozen teacher as
                     ``pretrain.method: causal_cd`` runs it (the bidirectional teacher artifact, over the noisy video;
                     ``BENCH_CD_TEACHER=causal``: a causal one, a Teacher-Forcing SFT student's shape, teacher-forced as
                     FastVideo's recipe runs it), the target network (the student's frozen twin on shadow weights, its
                     EMA step every iteration); the student's and the target's forwards teacher-forced over
                     ``[clean | noisy]``; no critic;

with ``generator_update_interval: 1`` (every iteration is a generator + critic update, as in the anchor) and
``real_score_guidance_scale: 4`` (the teacher runs conditional + unconditional, as in the anchor). Student and critic
train (the critic with its own optimizer, betas [0, 0.999], as the anchor's), the teacher is frozen.

Per configuration: the median wall time of the post-warm-up iterations (the trainer's ``step_time_s``), the GPU span of
each iteration (CUDA events recorded around the trainer's ``train_step``), FLOPs counted per role from what the method
runs (see :func:`iteration_flops`; model FLOPs exclude activation-checkpoint recomputation, "executed" FLOPs include it),
TFLOP/s and its fraction of the bf16 matmul ceiling measured in the same job (:func:`matmul_ceiling`), peak memory.
The anchor's figures are read from ``$OUT/anchor_dmd2_<T>x<H>x<W>.json`` (run it first in the same job:
``bench/gpu_job.sh distill``).

The three Wan transformers' random initial weights are drawn on the training device instead of the CPU (``WanTransformer3DModel.from_config``
runs under ``torch.device(cuda)``): the same random-init model, the same placement, compute copies and training path,
minus ~10 s of serial CPU random-number generation per role and configuration.

Usage (device machine):
  python bench/distill_step.py [--runs dmd2_data:21x60x104:default:on,...] [--steps 6 --warmup 2] [--deadline S]
  one configuration:  python bench/distill_step.py --one dmd2_data 21 30 52 default off
Run spec: METHOD:LATENT:COMPILE:AC[:OPTS] — COMPILE ``default`` (training.model.compile null: compiled on CUDA), ``eager``
or ``compile``; AC ``on``/``off`` (training.model.activation_checkpointing); OPTS
``steps=N;warmup=N;nproc=N;attention=B;compile_mode=M;snapshot=N;breakdown=1;need=S;NAME=VALUE`` (``nproc`` > 1: FSDP2 over N GPUs under
torchrun, one sample per rank, rank 0's figures; ``attention``: training.model.attention_backend, default ``--attention``
(``auto``); ``compile_mode``: ``blocks`` (regional, default) or ``model``; ``snapshot``: a CUDA memory snapshot after N
iterations, what holds the peak in the result's ``memory_peak``; ``need``: with ``--deadline``, the seconds that must be
left to start it, default 150 above 16,384 tokens, else 75): this configuration's iteration counts, knobs and
environment variables (e.g. ``TORCH_LOGS=recompiles`` with ``--child-logs``).
Prints a table and writes ``$OUT/distill_step<tag>.json`` after every configuration.
CPU check of this script: ``BENCH_SMOKE=1 python bench/distill_step.py`` (tiny model and latents).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_step import TEXT_DIM, TEXT_LEN, WAN_1_3B, flops_per_sample, init_weights_on, make_assets  # noqa: E402

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
CHUNK_SIZE = 3  # Self-Forcing student: latent frames per causal chunk
STUDENT_STEPS = 4  # the student ladder (DMD2 simulate and Self-Forcing)
PDD_STEPS = 8  # PDD: fine-grid intervals = output heads
GUIDANCE = 4.0  # teacher CFG, the anchor's w
DEFAULT_RUNS = [  # most important first: a run cut by --deadline loses the least
    "dmd2_data:21x60x104:default:on", "dmd2_data:21x30x52:default:off", "sf:21x30x52:default:off",
    "dmd2_sim:21x30x52:default:off", "dmd2_sim:21x60x104:default:on", "sf:21x60x104:default:on",
]
if SMOKE:  # tiny shapes: 9 latent frames = 3 causal chunks
    DEFAULT_RUNS = ["dmd2_data:9x8x8:default:off", "dmd2_sim:9x8x8:default:on", "sf:9x8x8:default:off", "sf:9x8x8:default:on"]


# -- FLOPs ------------------------------------------------------------------------------------------
def teacher_shape() -> dict:
    """The frozen teacher's transformer config: Wan-1.3B's (the student's) unless ``$BENCH_TEACHER=14b`` (a run's OPTS
    ``BENCH_TEACHER=14b``): Wan2.1-T2V-14B's shape (40 layers × 5120, FFN 13,824), as the published Wan-1.3B
    distillations' real score — the critic stays 1.3B-shaped, initialised apart from the teacher."""
    if os.environ.get("BENCH_TEACHER", "1.3b") == "1.3b":
        return WAN_1_3B
    if SMOKE:  # a bigger tiny teacher: 3 layers × 3 heads
        return {**WAN_1_3B, "num_attention_heads": 3, "num_layers": 3}
    return {**WAN_1_3B, "num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 40}


def forward_flops(q_tokens: int, k_tokens: int | None = None, text: int = TEXT_LEN, shape: dict | None = None) -> float:
    """One transformer forward over ``q_tokens`` query tokens whose self-attention reads ``k_tokens`` keys
    (``None``: bidirectional over themselves). Dense: per layer 2·(4d² self-attn q,k,v,o + 2d² cross-attn q,o + 2·d·ffn)
    per query token, plus the text's cross-attention k,v (2·2d² per text token, recomputed every forward);
    attention: per layer 4·d·q·k (QKᵀ and PV) for self-attention and 4·d·q·text for cross-attention. Patch/time
    embeddings, norms and the output head are left out. For ``k_tokens = q_tokens`` this is exactly a third of the SFT
    formula (``sft_step.flops_per_sample``, the anchors' ``3 × forward``). ``shape``: the transformer's config
    (default Wan-1.3B's)."""
    shape = WAN_1_3B if shape is None else shape
    d = shape["num_attention_heads"] * shape["attention_head_dim"]
    layers, ffn = shape["num_layers"], shape["ffn_dim"]
    k_tokens = q_tokens if k_tokens is None else k_tokens
    dense = q_tokens * layers * 2 * (6 * d * d + 2 * d * ffn) + text * layers * 2 * (2 * d * d)
    attn = layers * (4 * q_tokens * k_tokens * d + 4 * q_tokens * text * d)
    return float(dense + attn)


def tokens_of(size: tuple[int, int, int]) -> int:
    t, h, w = size
    return t * (h // 2) * (w // 2)


def iteration_flops(method: str, size: tuple[int, int, int], exits: list[int], ac: bool) -> dict:
    """FLOPs of one iteration, per role, from what the method runs (backward = 2 × forward; activation checkpointing
    re-runs each forward that keeps a graph once more in backward):

    - DMD2 (``generator_update_interval`` 1, w ≠ 1): student — ``k`` no-grad forwards down the ladder (``simulate``
      only, ``k`` = the exit step drawn) + 1 forward with graph + its backward; critic — 1 no-grad forward at (x_τ, τ)
      + 1 flow-matching forward with graph + its backward; teacher — 2 no-grad forwards (conditional, unconditional).
      The critic trains on the generator's own detached x̂0, so there is no extra student forward for it (the anchor
      has one: 10 forward-equivalents against our 9 in ``data_latent``).
    - Self-Forcing: per chunk c of n_c = frames·(H/2)(W/2) tokens after a cached prefix of P_c tokens, every student
      forward costs ``forward_flops(n_c, P_c + n_c)`` (queries of the chunk attend to the prefix and the chunk); per
      chunk ``k_c`` no-grad ladder forwards + 1 exit forward with graph (+ backward: every chunk, since
      ``start_gradient_frame`` is 0) + 1 no-grad forward writing the chunk's keys/values to the cache (all but the last
      chunk). Critic and teacher as DMD2, bidirectional over the whole video.

    - Causal CD: the student's forward with graph + its backward and the target's (no grad) are teacher-forced
      (:func:`teacher_forcing_flops`); the teacher's conditional and unconditional (no grad) are plain forwards over
      the video (a causal teacher, ``BENCH_CD_TEACHER=causal``: teacher-forced too).

    ``exits``: the exit step per iteration (DMD2) or per chunk (Self-Forcing), as the trainer logged them.
    Returns ``{"model": total, "executed": total incl. recompute, "roles": {role: model FLOPs}}``.
    """
    n = tokens_of(size)
    full = forward_flops(n)
    assert abs(3 * full - flops_per_sample(*size)[0]) < 1e-6 * full  # the SFT formula, forward = 1/3
    roles: dict[str, float] = {}
    recompute = 0.0
    if method.startswith("pdd"):  # student: 1 trunk forward with graph + backward (the heads' projections are ~0.01%);
        # teacher: (1 Euler | 2 midpoint calls) × (conditional + unconditional)
        roles["student"] = 3 * full
        roles["teacher"] = (2 if method == "pdd_mid" else 1) * 2 * forward_flops(n, shape=teacher_shape())
        model = sum(roles.values())
        return {"model": model, "executed": model + (full if ac else 0.0), "roles": roles}
    if method == "causal_cd":
        tf = teacher_forcing_flops(size)
        causal_teacher = os.environ.get("BENCH_CD_TEACHER", "bidirectional") == "causal"
        roles["student"], roles["target"], roles["teacher"] = 3 * tf, tf, 2 * (tf if causal_teacher else full)
        model = sum(roles.values())
        return {"model": model, "executed": model + (tf if ac else 0.0), "roles": roles}
    if method in ("dmd2_data", "dmd2_sim"):
        k = exits[0] if method == "dmd2_sim" else 0
        roles["student"] = k * full + 3 * full
        recompute += full
    else:
        t, h, w = size
        per_frame = (h // 2) * (w // 2)
        starts = list(range(0, t, CHUNK_SIZE))
        total = 0.0
        for c, s in enumerate(starts):
            f = min(CHUNK_SIZE, t - s)
            fc = forward_flops(f * per_frame, (s + f) * per_frame)
            last = c == len(starts) - 1
            total += (exits[c] + 1 + (0 if last else 1)) * fc + 2 * fc
            recompute += fc
        roles["student"] = total
    roles["critic"] = full + 3 * full
    recompute += full
    roles["teacher"] = 2 * forward_flops(n, shape=teacher_shape())
    model = sum(roles.values())
    return {"model": model, "executed": model + (recompute if ac else 0.0), "roles": roles}


def teacher_forcing_flops(size: tuple[int, int, int], shape: dict | None = None) -> float:
    """One teacher-forcing forward over ``[clean | noisy]`` (2 × the video's tokens, one call): per chunk c of n_c
    tokens after P_c earlier ones, its clean queries read the P_c + n_c clean keys and its noisy queries the P_c clean
    keys + their own n_c: :func:`forward_flops` of each such group, the text's cross-attention keys and values counted
    once for the call."""
    shape = WAN_1_3B if shape is None else shape
    d = shape["num_attention_heads"] * shape["attention_head_dim"]
    t, h, w = size
    per_frame = (h // 2) * (w // 2)
    groups = [(min(CHUNK_SIZE, t - s) * per_frame, (s + min(CHUNK_SIZE, t - s)) * per_frame) for s in range(0, t, CHUNK_SIZE)]
    text_kv = TEXT_LEN * shape["num_layers"] * 2 * (2 * d * d)
    return 2 * sum(forward_flops(q, k, shape=shape) for q, k in groups) - (2 * len(groups) - 1) * text_kv


# -- the run config -----------------------------------------------------------------------------------
def distill_run_config(model: Path, data: Path, output_dir: Path, method: str, steps: int, compile_blocks: bool | None,
                       ac: bool, attention: str = "auto", compile_mode: str = "blocks", teacher: Path | None = None) -> dict:
    """The raw run config of one configuration (batch 1, lr 1e-5, critic betas [0, 0.999], grad clip 1.0, no tracking).
    ``teacher``: the teacher's model folder (default ``model``, the student's)."""
    wan = "distillery.models.wan.WanModel"
    student = {"_target_": wan, "init_from": str(model), "random_init": True}
    knobs = {"generator_update_interval": 1, "real_score_guidance_scale": GUIDANCE, "num_student_steps": STUDENT_STEPS}
    if method.startswith("pdd"):
        student = {"_target_": "distillery.models.wan.PDDWanModel", "init_from": str(model), "random_init": True,
                   "pdd_steps": PDD_STEPS}
        target = "distillery.methods.pdd.PDDMethod"
        knobs = {"rollout": "data_latent", "integrator": "midpoint" if method == "pdd_mid" else "euler",
                 "teacher_guidance_scale": GUIDANCE, "block_size_max": PDD_STEPS}
    elif method in ("sf", "causal_cd"):
        student = {"_target_": "distillery.models.wan.CausalWanModel", "init_from": str(model), "random_init": True,
                   "chunk_size": CHUNK_SIZE}
        target = "distillery.methods.self_forcing.SelfForcingMethod"
        knobs["rollout"] = "simulate"
        if method == "causal_cd":  # the grid of the published recipe (48), the EMA target updated every iteration
            target = "distillery.methods.causal_cd.CausalCDMethod"
            knobs = {"num_discrete_steps": 48, "guidance_scale": GUIDANCE, "target_decay": 0.99, "target_start_step": 0}
    else:
        target = "distillery.methods.dmd2.DMD2Method"
        knobs["rollout"] = {"dmd2_data": "data_latent", "dmd2_sim": "simulate"}[method]
    models = {"student": student, "teacher": {"_target_": wan, "init_from": str(teacher or model), "random_init": True,
                                              "trainable": False}}
    if method == "causal_cd" and os.environ.get("BENCH_CD_TEACHER", "bidirectional") == "causal":  # a TF-SFT teacher
        models["teacher"].update({"_target_": "distillery.models.wan.CausalWanModel", "chunk_size": CHUNK_SIZE})
    if not method.startswith("pdd") and method != "causal_cd":
        models["critic"] = {"_target_": wan, "init_from": str(model), "random_init": True,
                            "optimizer": {"learning_rate": 1e-5, "betas": [0.0, 0.999]}}
    return {
        "models": models,
        "method": {"_target_": target, **knobs},
        "training": {
            "distributed": shard_settings(),
            "data": {"path": str(data), "batch_size": 1, "text_max_length": TEXT_LEN},
            "optimizer": {"learning_rate": 1e-5},
            "loop": {"max_train_steps": steps, "progress_bar": False},
            "checkpoint": {"output_dir": str(output_dir), "save_final": False},
            "tracker": {"backend": "none"},
            "model": {"compile": compile_blocks, "compile_mode": compile_mode, "activation_checkpointing": ac,
                      "activation_checkpointing_fraction": ac_fraction(), "attention_backend": attention},
        },
        "callbacks": {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}},
    }


def _exits(method: str, row: dict, size: tuple[int, int, int]) -> list[int]:
    if method == "causal_cd":  # the grid point drawn
        return [int(round(row.get("cd_step", 0.0)))]
    if method.startswith("pdd"):  # the supervised head
        return [int(round(row.get("pdd_head", 0.0)))]
    if method != "sf":
        return [int(round(row.get("exit_step", 0.0)))]
    chunks = len(range(0, size[0], CHUNK_SIZE))
    return [int(round(row[f"exit_step/chunk{c}"])) for c in range(chunks)]


def shard_settings() -> dict:
    """``training.distributed`` for one configuration: ``$BENCH_SHARD_SINGLE_RANK=1`` (a run's OPTS) wraps every role
    in FSDP2 on a world of one with ``reshard_after_forward`` (no resident bf16 compute copy, as FastVideo's loader
    does); unset: the library's defaults (a plain module on one rank). ``$BENCH_SP_SIZE`` / ``$BENCH_TP_SIZE``: ``sp_size`` / ``tp_size`` (under torchrun)."""
    from sft_step import sp_settings

    sp = sp_settings()  # sp_size / tp_size from $BENCH_SP_SIZE / $BENCH_TP_SIZE (bench/sp_step.py)
    if os.environ.get("BENCH_SHARD_SINGLE_RANK") == "1":
        return {"shard_single_rank": True, "reshard_after_forward": True, **sp}
    return sp


def ac_fraction() -> float:
    """``training.model.activation_checkpointing_fraction`` from ``$BENCH_AC_FRACTION`` (a run's OPTS
    ``BENCH_AC_FRACTION=0.2``; default 1: every block when AC is on)."""
    return float(os.environ.get("BENCH_AC_FRACTION", "1.0"))


def run_one(method: str, size: tuple[int, int, int], compile_blocks: bool | None, ac: bool, steps: int, warmup: int,
            attention: str = "auto", compile_mode: str = "blocks", snapshot_after: int = 0, breakdown: bool = False) -> dict:
    """Train ``steps`` iterations with the real Trainer; report post-warm-up medians and per-iteration FLOPs.

    ``snapshot_after`` > 0 (CUDA): record the allocator's history with Python stacks from before the models are
    built, take a memory snapshot after that many iterations and stop recording (keep it inside the warm-up, so
    the timed iterations run unrecorded); the result gets ``memory_peak`` (``memory_peak.peak_summary``: the peak
    and what holds it), and ``$SNAPSHOT_PICKLE`` (a path), when set, receives the snapshot itself. ``breakdown``:
    GPU time per kernel family of the two iterations after the warm-up (``bench/kernel_breakdown.py``; they are then
    profiled, ~7 % slower, and left out of the timed ones)."""
    import torch

    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.assemble import build_trainer
    from distillery.engine.builder import resolve_compile
    from distillery.engine.loop import Trainer

    spans: list[tuple] = []
    snapshot: dict = {}
    cuda = torch.cuda.is_available()
    if cuda:  # GPU span of each iteration: CUDA events around the trainer's step (read after the run)
        inner = Trainer.train_step

        def timed_step(self, step):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = inner(self, step)
            b.record()
            spans.append((a, b))
            if snapshot_after and len(spans) == snapshot_after:
                torch.cuda.synchronize()
                snapshot["data"] = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
            return out

        Trainer.train_step = timed_step
        if snapshot_after:
            torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    with tempfile.TemporaryDirectory() as tmp:
        model, data = make_assets(Path(tmp), size)
        # the guided real score needs the empty prompt's embedding (sft_step's set has none): a random one here
        from distillery.data.dataset import write_empty_prompt_embedding

        write_empty_prompt_embedding(data, torch.randn(TEXT_LEN, TEXT_DIM, generator=torch.Generator().manual_seed(1)).bfloat16())
        teacher = None
        if teacher_shape() is not WAN_1_3B:  # a separate teacher folder of its own shape (teacher_shape)
            teacher = Path(tmp) / "wan-teacher"
            shutil.copytree(model, teacher)
            (teacher / "transformer" / "config.json").write_text(json.dumps(teacher_shape()))
        raw = distill_run_config(model, data, Path(tmp) / "run", method, steps, compile_blocks, ac, attention, compile_mode,
                                 teacher)
        config = load_run_config(raw=raw, prefixes=allowed_prefixes())
        env = init_distributed(config.training.distributed)
        try:
            init_weights_on(env.device)  # draw the random initial weights on the GPU (module doc)
            t0 = time.perf_counter()
            trainer = build_trainer(config, env)
            build_s = time.perf_counter() - t0
            profiler = contextlib.nullcontext()
            if breakdown:
                from kernel_breakdown import ProfilerStepper
                from torch.profiler import ProfilerActivity, profile, schedule

                profiler = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU],
                                   schedule=schedule(wait=warmup - 1, warmup=1, active=2, repeat=1))
                trainer.run.callbacks.append(ProfilerStepper(profiler))
            compiled = resolve_compile(config.training.model, env)
            resolved = {role: getattr(m, "attention_backend", "native") for role, m in trainer.run.models.items()}
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            static_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None
            t0 = time.perf_counter()
            with profiler:
                result = trainer.fit()
            fit_s = time.perf_counter() - t0
            if cuda:
                torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            peak_reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
        finally:
            shutdown()
    hist = result.history
    times = [row["step_time_s"] for row in hist]
    gpu = [a.elapsed_time(b) / 1e3 for a, b in spans] if spans else []
    flops = [iteration_flops(method, size, _exits(method, row, size), ac) for row in hist]
    meas = slice(warmup + 2 if breakdown else warmup, None)
    m_times, m_flops = times[meas], flops[meas]
    model_flops = sum(f["model"] for f in m_flops)
    executed = sum(f["executed"] for f in m_flops)
    extra = {}
    if breakdown:
        from kernel_breakdown import kernel_families

        extra["breakdown"] = kernel_families(profiler, steps=2)
    if snapshot.get("data") is not None:
        from memory_peak import peak_summary

        extra["memory_peak"] = peak_summary(snapshot["data"])
        if os.environ.get("SNAPSHOT_PICKLE"):
            import pickle

            with open(os.environ["SNAPSHOT_PICKLE"], "wb") as fh:
                pickle.dump(snapshot["data"], fh)
    return {
        **extra, "attention": attention, "attention_resolved": resolved, "compile_mode": compile_mode,
        "method": method, "size": list(size), "tokens": tokens_of(size), "compile": compile_blocks, "compiled": compiled,
        "activation_checkpointing": ac, "ac_fraction": ac_fraction() if ac else None, "distributed": shard_settings(),
        "iteration_s": statistics.median(m_times), "mean_iteration_s": statistics.mean(m_times),
        "gpu_iteration_s": statistics.median(gpu[meas]) if gpu else None, "first_iteration_s": times[0],
        "model_tflop_per_iteration": model_flops / len(m_flops) / 1e12,
        "executed_tflop_per_iteration": executed / len(m_flops) / 1e12,
        "tflops": model_flops / sum(m_times) / 1e12, "executed_tflops": executed / sum(m_times) / 1e12,
        "role_tflop_per_iteration": {r: statistics.mean(f["roles"][r] for f in m_flops) / 1e12 for r in m_flops[0]["roles"]},
        "exits": [_exits(method, row, size) for row in hist], "peak_mem_gib": peak, "peak_reserved_gib": peak_reserved,
        "static_mem_gib": static_gib, "build_s": build_s, "fit_s": fit_s, "iteration_times": times, "gpu_times": gpu,
        "teacher": os.environ.get("BENCH_TEACHER", "1.3b"),
        **({"cd_teacher": os.environ.get("BENCH_CD_TEACHER", "bidirectional")} if method == "causal_cd" else {}),
        "final_losses": {k: hist[-1][k] for k in ("generator_loss", "critic_loss", "pdd_loss", "consistency_loss")
                         if k in hist[-1]},
    }


def matmul_ceiling() -> dict:
    """bf16 matmul rate, 8192³ on random data (3 warm-ups, median of 20 timed with CUDA events)."""
    import torch

    if not torch.cuda.is_available():
        return {"bf16_matmul_tflops": None}
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return {"bf16_matmul_tflops": 2 * n**3 / statistics.median(times) / 1e12, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__}


def _child(cmd: list[str], timeout: float, env: dict | None = None, log: Path | None = None,
           label: str = "") -> tuple[dict | None, str]:
    """Run one configuration; its RESULT line, or None and the end of its output. ``log``: append its stderr there."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stderr or b"")
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return None, f"timed out after {timeout:.0f} s\n{out[-1500:]}"
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"==== {label} rc={proc.returncode}\n{proc.stderr}\n")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        return None, (proc.stderr or proc.stdout)[-3000:]
    return json.loads(line[-1][len("RESULT "):]), ""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", nargs=6, metavar=("METHOD", "T", "H", "W", "COMPILE", "AC"))
    parser.add_argument("--probe", action="store_true", help="print the bf16 matmul ceiling and exit")
    parser.add_argument("--no-probe", action="store_true", help="skip measuring the bf16 matmul ceiling first")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma list of METHOD:TxHxW:COMPILE:AC")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=0, help="seconds: start no configuration after this, cap timeouts")
    parser.add_argument("--config-timeout", type=float, default=420)
    parser.add_argument("--child-logs", action="store_true", help="append every configuration's stderr to $OUT/children.log")
    parser.add_argument("--tag", default="", help="write $OUT/distill_step<tag>.json")
    parser.add_argument("--attention", default="auto", help="training.model.attention_backend (every run; a run's OPTS attention=… wins)")
    parser.add_argument("--compile-mode", default="blocks", choices=["blocks", "model"], help="training.model.compile_mode")
    parser.add_argument("--snapshot-after", type=int, default=0, help="with --one: memory snapshot after N iterations (run_one)")
    parser.add_argument("--breakdown", action="store_true", help="with --one: GPU time per kernel family (run_one)")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    if args.probe:
        print("RESULT " + json.dumps(matmul_ceiling()), flush=True)
        return 0
    if args.one:
        method, t, h, w, comp, ac = args.one
        res = run_one(method, (int(t), int(h), int(w)), {"eager": False, "compile": True, "default": None}[comp], ac == "on",
                      args.steps, args.warmup, args.attention, args.compile_mode, args.snapshot_after, args.breakdown)
        res["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: rank 0's figures (each rank one sample)
            print("RESULT " + json.dumps(res), flush=True)
        return 0
    started = time.time()
    ceiling, err = _child([sys.executable, __file__, "--probe"], 120) if not args.no_probe else (None, "skipped (--no-probe)")
    ceiling = ceiling or {"bf16_matmul_tflops": None, "error": err[-300:]}
    peak = ceiling.get("bf16_matmul_tflops")
    print(json.dumps(ceiling), flush=True)
    anchors = {}
    for path in out_dir.glob("anchor_dmd2_*.json"):
        ref = json.loads(path.read_text())
        anchors["x".join(map(str, ref["latent"]))] = ref
    rows: list[dict] = []
    for spec in args.runs.split(","):
        method, latent, comp, ac, *extra = spec.split(":")
        size = tuple(int(v) for v in latent.split("x"))
        # optional 5th field: steps=N;warmup=N (this configuration's counts) and NAME=VALUE (its environment)
        opts = dict(kv.split("=", 1) for kv in extra[0].split(";")) if extra and extra[0] else {}
        steps, warmup = int(opts.pop("steps", args.steps)), int(opts.pop("warmup", args.warmup))
        nproc = int(opts.pop("nproc", 1))  # > 1: FSDP2 over that many GPUs under torchrun, one sample per rank
        attention, compile_mode = opts.pop("attention", args.attention), opts.pop("compile_mode", args.compile_mode)
        snapshot_after = int(opts.pop("snapshot", 0))  # a memory snapshot after that many iterations (run_one)
        breakdown = opts.pop("breakdown", "0") == "1"  # GPU time per kernel family (run_one)
        need = float(opts.pop("need", 150 if tokens_of(size) > 16384 else 75))  # seconds left to start it (--deadline)
        timeout = args.config_timeout
        if args.deadline:
            left = args.deadline - (time.time() - started)
            if left < need:  # roughly what one configuration needs at the least
                rows.append({"method": method, "size": list(size), "compile": comp, "activation_checkpointing": ac == "on",
                             "error": "skipped: job deadline"})
                print(f"SKIPPED {spec} (deadline)", flush=True)
                continue
            timeout = min(timeout, left)
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        "--nproc_per_node", str(nproc)]
        cmd = [*launcher, __file__, "--one", method, *map(str, size), comp, ac, "--steps", str(steps),
               "--warmup", str(warmup), "--attention", attention, "--compile-mode", compile_mode,
               "--snapshot-after", str(snapshot_after), *(["--breakdown"] if breakdown else [])]
        t0 = time.time()
        res, err = _child(cmd, timeout, {**os.environ, **opts}, out_dir / "children.log" if args.child_logs else None, spec)
        if res is None:
            print(f"FAILED {spec} after {time.time() - t0:.0f} s:\n{err}", flush=True)
            oom = "OutOfMemoryError" in err or "out of memory" in err
            rows.append({"method": method, "size": list(size), "compile": comp, "activation_checkpointing": ac == "on",
                         "attention": attention, "compile_mode": compile_mode,
                         "error": ("CUDA out of memory: " if oom else "") + err[-600:]})
        else:
            res["wall_s"] = time.time() - t0
            ref = anchors.get(latent)
            if ref:
                res["anchor_iteration_s"] = ref["iteration_s"]
                res["anchor_peak_mem_gib"] = ref["peak_mem_gib"]
                res["ratio_to_anchor"] = res["iteration_s"] / ref["iteration_s"]
                res["speedup_vs_anchor"] = ref["iteration_s"] / res["iteration_s"]
            if peak:
                res["fraction_of_ceiling"] = res["tflops"] / peak
            rows.append(res)
            print(json.dumps({k: v for k, v in res.items() if k not in ("iteration_times", "gpu_times", "exits", "memory_peak")}), flush=True)
            if "memory_peak" in res:
                print("MEMORY " + json.dumps(res["memory_peak"]), flush=True)
        (out_dir / f"distill_step{args.tag}.json").write_text(json.dumps({"ceiling": ceiling, "anchor": anchors, "ours": rows},
                                                                          indent=1))
    print(f"\nbf16 matmul ceiling: {peak} TFLOP/s")
    for key, ref in sorted(anchors.items()):
        print(f"anchor {key}: {ref['iteration_s']:.3f} s, {ref['tflops']:.0f} TFLOP/s, {ref['peak_mem_gib']:.1f} GiB")
    print(f"{'method':>9} {'attention':>10} {'latent':>10} {'mode':>8} {'AC':>3} {'iter s':>7} {'GPU s':>7} {'TFLOP/it':>8} {'TFLOP/s':>7} "
          f"{'ceil':>5} {'GiB':>6} {'anchor':>7} {'ratio':>6}")
    for r in rows:
        latent = "x".join(map(str, r["size"]))
        mode = {True: "compile", False: "eager", None: "default"}.get(r["compile"], str(r["compile"]))
        if r.get("compiled") is not None and r["compile"] is None:
            mode = "def:" + ("comp" if r["compiled"] else "eag")
        if r.get("compile_mode") == "model":
            mode += "/M"
        ac = "on" if r["activation_checkpointing"] else "off"
        if "error" in r:
            print(f"{r['method']:>9} {r.get('attention', ''):>10} {latent:>10} {mode:>8} {ac:>3}  FAILED: {r['error'][:60]!r}")
            continue
        nan = float("nan")
        r = {k: (nan if v is None else v) for k, v in r.items()}
        att = r["attention_resolved"].get("student", r["attention"])
        print(f"{r['method']:>9} {att:>10} {latent:>10} {mode:>8} {ac:>3} {r['iteration_s']:7.3f} {r['gpu_iteration_s']:7.3f} "
              f"{r['model_tflop_per_iteration']:8.1f} {r['tflops']:7.1f} {r.get('fraction_of_ceiling', nan):5.2f} "
              f"{r['peak_mem_gib']:6.1f} {r.get('anchor_iteration_s', nan):7.3f} {r.get('ratio_to_anchor', nan):6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
