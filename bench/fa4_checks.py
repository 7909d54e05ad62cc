"""GPU checks of the FA4 attention backend (issue 24), one process, results in ``$OUT/fa4_checks_<parts>.json`` after
each part.

1. ``kernels`` — attention alone at the Wan2.1-1.3B training shape (1 × 32,760 tokens × 12 heads × 128, bf16; CUDA
   events, median of ``--reps``): full attention (cuDNN SDPA, torch's default SDPA, the FA4 op) and block-causal
   attention over 7 chunks of 4,680 tokens (3 latent frames): SDPA with a boolean mask, SDPA per-chunk prefix calls
   (what ``native`` runs), FA4 with a ``mask_mod`` alone (every tile computed), the FA4 op per chunk (``fa4``) and the
   FA4 op with block sparsity (``fa4_sparse``); forward and forward + backward ms, TFLOP/s on the FLOPs computed,
   and the largest difference of out / dq / dk / dv from the SDPA reference of each. Our forward block lists against
   FA4's own ``compute_block_sparsity`` of the same ``mask_mod``.
2. ``agreement`` — the model plugins at 21×60×104 (random-init Wan-1.3B weights in bf16, one set shared by all):
   ``predict_noise`` of the bidirectional Wan, the PDD Wan (head of t = 500) and the causal Wan (block-causal
   training forward; streaming: chunk 0 into the KV cache, then chunks 1–2 in one call over the cache) with every
   backend, compared with ``native`` (relative L2 and max abs of the float32 velocity); the gradients of one
   training step (MSE to a random target, activation checkpointing on to fit the graph) of the bidirectional Wan
   (fa4) and the causal Wan (fa4, fa4_sparse). The bf16 noise floor is SDPA against SDPA: ``cudnn`` / ``flash``
   against ``native``. A backend agrees when its relative L2 is at most ``max(1.6e-2, 2 × floor)`` (1.6e-2: the
   bf16 rtol of ``torch.testing``).
3. ``causal_i2v`` — the causal image-to-video student (latent frame 0 the given frame, a block of its own) at an
   I2V-shaped Wan-1.3B, latent 22×60×104: forward and streaming with ``chunk_size`` 1 (FA4 sparse: one block-sparse
   call) and 3 (per-chunk prefix calls), and one step's gradients, every backend against ``native``; the streamed
   video against the whole-video forward.

Usage (device machine, after ``source device-env.sh``):  python bench/fa4_checks.py [--parts agreement,kernels,causal_i2v]
CPU check of the agreement part's code: ``BENCH_SMOKE=1 python bench/fa4_checks.py --parts agreement`` (tiny model;
the FA4 and CUDA-only backends report their errors).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_step import TEXT_LEN, WAN_1_3B, make_assets  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
RESULTS: dict = {}
BF16_RTOL = 1.6e-2
SMOKE = os.environ.get("BENCH_SMOKE") == "1"  # a CPU check of this script's agreement part: tiny model and latent
LATENT = (9, 8, 8) if SMOKE else (21, 60, 104)


NAME = ["fa4_checks"]  # the results file's stem: fa4_checks_<parts>.json


def save() -> None:
    (OUT / f"{NAME[0]}.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def timed(fn, reps: int, warmup: int = 2) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn`` in ms, after ``warmup`` untimed calls."""
    from attention_kernels import cuda_median_seconds

    return 1000 * cuda_median_seconds(fn, reps, warmup)


# -- 1. kernels ---------------------------------------------------------------------------------------------
def kernels(reps: int) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from distillery.models.wan.attention import (
        FA4_TILE,
        _block_causal_mask_mod,
        block_causal_mask,
        block_lists,
        fa4_attention,
        tile_kinds,
    )

    n, h, d, chunk = 32760, 12, 128, 4680
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True) for _ in range(3))
    dout = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = block_causal_mask(n, n, chunk, 0, "cuda")
    groups = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    full_flops = 4 * n * n * d * h
    causal_flops = sum(4 * (e - s) * e * d * h for s, e in groups)

    def sdpa(mask_=None, backend=None):
        def run(q_, k_, v_):
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
                                                      attn_mask=mask_).transpose(1, 2)
        return run

    def prefix(attend):
        return lambda q_, k_, v_: torch.cat([attend(q_[:, s:e], k_[:, :e], v_[:, :e]) for s, e in groups], dim=1)

    def fa4_mask_mod_only(q_, k_, v_):  # FA4 with the mask_mod evaluated on every tile (no block lists)
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

        class MaskOnly(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a, b, c):
                out, lse = _flash_attn_fwd(a, b, c, mask_mod=_block_causal_mask_mod(chunk, 0), return_lse=True)[:2]
                ctx.save_for_backward(a, b, c, out, lse)
                return out

            @staticmethod
            def backward(ctx, grad):
                a, b, c, out, lse = ctx.saved_tensors
                return tuple(_flash_attn_bwd(a, b, c, out, grad.contiguous(), lse, mask_mod=_block_causal_mask_mod(chunk, 0))[:3])

        return MaskOnly.apply(q_, k_, v_)

    variants = {
        "full/sdpa_cudnn": (sdpa(backend=SDPBackend.CUDNN_ATTENTION), full_flops, "full/sdpa_cudnn"),
        "full/sdpa_default": (sdpa(), full_flops, "full/sdpa_cudnn"),
        "full/fa4": (lambda a, b, c: fa4_attention(a, b, c), full_flops, "full/sdpa_cudnn"),
        "block_causal/sdpa_bool_mask": (sdpa(mask_=mask), full_flops, "block_causal/sdpa_bool_mask"),
        "block_causal/sdpa_prefix (native)": (prefix(sdpa()), causal_flops, "block_causal/sdpa_bool_mask"),
        "block_causal/fa4_mask_mod_only": (fa4_mask_mod_only, full_flops, "block_causal/sdpa_bool_mask"),
        "block_causal/fa4_prefix (fa4)": (prefix(lambda a, b, c: fa4_attention(a, b, c)), causal_flops, "block_causal/sdpa_bool_mask"),
        "block_causal/fa4_sparse (fa4_sparse)": (lambda a, b, c: fa4_attention(a, b, c, chunk, 0), causal_flops,
                                                 "block_causal/sdpa_bool_mask"),
    }
    refs: dict = {}
    out_rows = RESULTS.setdefault("kernels", {"shape": [1, n, h, d], "chunk_tokens": chunk, "reps": reps})
    for name, (fn, flops, ref_name) in variants.items():
        row: dict = {}
        try:
            t0 = time.time()
            out = fn(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            row["first_call_s"] = time.time() - t0  # FA4's JIT compile on its first call of a layout
            if ref_name == name:
                refs[name] = (out.detach(), [x.detach() for x in grads])
            else:
                ro, rg = refs[ref_name]
                row["max_abs_vs_" + ref_name.split("/")[1]] = {
                    "out": (out - ro).abs().max().item(),
                    **{f"d{c}": (a - b).abs().max().item() for c, a, b in zip("qkv", grads, rg)}}
            del out, grads
            with torch.no_grad():
                row["fwd_ms"] = timed(lambda: fn(q, k, v), reps)

            def fwd_bwd():
                torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

            row["fwd_bwd_ms"] = timed(fwd_bwd, reps)
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            row["fwd_bwd_tflops"] = 3 * flops / row["fwd_bwd_ms"] / 1e9  # backward = 2 × forward FLOPs
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            traceback.print_exc()
        out_rows[name] = row
        print(name, json.dumps(row), flush=True)
        save()
    del refs
    kinds = tile_kinds(n, n, chunk, 0, FA4_TILE, "cuda")
    lists = block_lists(kinds)
    out_rows["block_lists"] = {"tiles": list(kinds.shape), "skipped": float((kinds == 0).float().mean()),
                               "partial": float((kinds == 1).float().mean()), "full": float((kinds == 2).float().mean())}
    try:  # FA4's own block-sparsity kernel evaluates the mask_mod on every element: the same lists?
        from flash_attn.cute.compute_block_sparsity import compute_block_sparsity

        theirs = compute_block_sparsity(FA4_TILE[0], FA4_TILE[1], 1, 1, n, n, _block_causal_mask_mod(chunk, 0), None, q.device)

        def sets(cnt, idx):
            return [set(idx[r, :int(cnt[r])].tolist()) for r in range(cnt.shape[0])]

        same_full = sets(lists.full_cnt, lists.full_idx) == sets(theirs.full_block_cnt[0, 0], theirs.full_block_idx[0, 0])
        same_mask = sets(lists.mask_cnt, lists.mask_idx) == sets(theirs.mask_block_cnt[0, 0], theirs.mask_block_idx[0, 0])
        out_rows["block_lists"]["equal_to_fa4_compute_block_sparsity"] = {"full": same_full, "partial": same_mask}
    except Exception as exc:
        out_rows["block_lists"]["fa4_compute_block_sparsity_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print("block lists", json.dumps(out_rows["block_lists"]), flush=True)
    save()


# -- 2. agreement ---------------------------------------------------------------------------------------------
def _compare(a, b) -> dict:
    diff = (a.float() - b.float())
    return {"rel_l2": (diff.norm() / b.float().norm().clamp_min(1e-30)).item(), "max_abs": diff.abs().max().item()}


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def forwards(rows: dict, name: str, model, backends: list[str], call, dev, dtype) -> dict:
    """``call(model)`` under each attention backend (no grad), timed; ``rows[name]``: per backend its seconds and
    resolved backend (or its error), then each against ``native`` (:func:`_verdicts`). Returns the outputs."""
    import torch

    outs = {}
    for backend in backends:
        try:
            model.set_attention_backend(backend, dev, dtype)
            t0 = time.time()
            with torch.no_grad():
                outs[backend] = call(model)
            _sync(dev)
            rows.setdefault(name, {})[backend] = {"s": time.time() - t0, "resolved": model.attention_backend}
        except Exception as exc:
            rows.setdefault(name, {})[backend] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            traceback.print_exc()
    _verdicts(rows[name], outs)
    print(name, json.dumps(rows[name]), flush=True)
    save()
    return outs


def gradients(rows: dict, name: str, model, backends: list[str], loss, dev, dtype) -> None:
    """The gradients of ``loss(model)`` (a scalar) under each backend against the first backend's: ``rows[name]``
    per backend its seconds, relative L2 over all trainable parameters, the worst tensor's; ``agrees`` as module doc
    (the floor: ``cudnn`` / ``flash`` against the first)."""
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    names = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    ref: list | None = None
    entry = rows.setdefault(name, {})
    for backend in backends:
        try:
            model.set_attention_backend(backend, dev, dtype)
            for p in params:
                p.grad = None
            t0 = time.time()
            loss(model).backward()
            _sync(dev)
            grads = [p.grad.detach().clone() if p.grad is not None else None for p in params]
            entry[backend] = {"s": time.time() - t0}
            if ref is None:
                ref = grads
                continue
            pairs = [(i, a, b) for i, (a, b) in enumerate(zip(grads, ref)) if b is not None]
            num = sum(float((a.float() - b.float()).pow(2).sum()) for _, a, b in pairs)
            den = sum(float(b.float().pow(2).sum()) for _, _, b in pairs)
            worst = max((_compare(a, b)["rel_l2"], i) for i, a, b in pairs if b.float().norm() > 0)
            entry[backend].update(rel_l2=(num / den) ** 0.5, worst_tensor_rel_l2=worst[0], worst_tensor=names[worst[1]])
            del grads
        except Exception as exc:
            entry[backend] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            traceback.print_exc()
    for p in params:
        p.grad = None
    floor = max((entry[b]["rel_l2"] for b in ("cudnn", "flash") if "rel_l2" in entry.get(b, {})), default=None)
    for r in entry.values():
        if isinstance(r, dict) and "rel_l2" in r:
            r["agrees"] = r["rel_l2"] <= max(BF16_RTOL, 2 * floor) if floor is not None else r["rel_l2"] <= BF16_RTOL
    entry["floor_rel_l2"] = floor
    print(name, json.dumps(entry), flush=True)
    save()


def agreement() -> None:
    import torch
    import torch.nn.functional as F

    from distillery.components.precision import cast_parameters_
    from distillery.models.base import Conditioning
    from distillery.models.wan import CausalWanModel, CausalWanModelConfig, PDDWanModel, PDDWanModelConfig, WanModel, WanModelConfig

    dev, bf16 = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    rows = RESULTS.setdefault("agreement", {"latent": list(LATENT), "bf16_rtol": BF16_RTOL})
    folder, _ = make_assets(Path(tempfile.mkdtemp(prefix="fa4-checks-")), (3, 8, 8))  # a config-only Wan-1.3B folder
    with torch.device(dev):
        bi = WanModel(WanModelConfig(init_from=str(folder), random_init=True, trainable=True), role="bidirectional")
    cast_parameters_(bi.transformer, bf16)
    bi.bind_device(dev, bf16)
    pdd = PDDWanModel(PDDWanModelConfig(init_from=str(folder), random_init=True, pdd_steps=8), role="pdd", transformer=bi.transformer)
    pdd.bind_device(dev, bf16)
    causal_cfg = CausalWanModelConfig(init_from=str(folder), random_init=True, chunk_size=3)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, 16, *LATENT, device=dev, generator=g)
    target = torch.randn(1, 16, *LATENT, device=dev, generator=g)
    text = torch.randn(1, TEXT_LEN, WAN_1_3B["text_dim"], device=dev, generator=g)
    cond = Conditioning(text)
    t = torch.tensor([500.0], device=dev)

    sdpa = ["native", "cudnn", "flash"]
    def mse(m):
        return F.mse_loss(m.predict_noise(x, t, cond), target)

    forwards(rows, "bidirectional_forward", bi, sdpa + ["fa4"], lambda m: m.predict_noise(x, t, cond), dev, bf16)
    forwards(rows, "pdd_forward", pdd, sdpa + ["fa4"], lambda m: m.predict_noise(x, t, cond), dev, bf16)
    bi.transformer.enable_gradient_checkpointing()
    gradients(rows, "bidirectional_gradients", bi, ["native", "cudnn", "fa4"], mse, dev, bf16)
    causal = CausalWanModel(causal_cfg, role="causal", transformer=bi.transformer)
    causal.bind_device(dev, bf16)
    every = sdpa + ["fa4", "fa4_sparse"]
    forwards(rows, "causal_forward", causal, every, lambda m: m.predict_noise(x, t, cond), dev, bf16)

    def stream(m):
        m.clear_caches()
        m.predict_noise_streaming(x[:, :, :3], t, cond, cache_tag="c", store_kv=True, cur_start_frame=0)
        out = m.predict_noise_streaming(x[:, :, 3:9], t, cond, cache_tag="c", store_kv=False, cur_start_frame=3)
        m.clear_caches()
        return out

    forwards(rows, "causal_streaming", causal, every, stream, dev, bf16)
    gradients(rows, "causal_gradients", causal, ["native", "cudnn", "fa4", "fa4_sparse"], mse, dev, bf16)


# -- 3. causal_i2v ------------------------------------------------------------------------------------------
def causal_i2v() -> None:
    """The causal image-to-video student (latent frame 0 the given frame, a block of its own; chunks from frame 1) at
    an I2V-shaped Wan-1.3B (in_channels 36, image_dim 1280, 257 image tokens), latent 22×60×104 = 1 + 21 frames:
    forwards with chunk_size 1 (fa4_sparse takes its one block-sparse call) and 3 (fa4_sparse falls back to
    per-chunk prefix calls), streaming (frame 0 into the cache, then chunks 1.., then the rest in one call) and the
    gradients of one step, every backend against ``native``."""
    import torch
    import torch.nn.functional as F

    from distillery.components.precision import cast_parameters_
    from distillery.models.base import Conditioning
    from distillery.models.wan import CausalWanModel, CausalWanModelConfig

    dev, bf16 = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    frames = 1 + (LATENT[0] // 3) * 3  # 22 on the GPU, 10 in the smoke run
    latent = (frames, *LATENT[1:])
    rows = RESULTS.setdefault("causal_i2v", {"latent": list(latent), "bf16_rtol": BF16_RTOL})
    folder, _ = make_assets(Path(tempfile.mkdtemp(prefix="fa4-i2v-")), (3, 8, 8))
    config_file = folder / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    width = config["num_attention_heads"] * config["attention_head_dim"]
    image_dim = 1280 if not SMOKE else 32
    config.update(in_channels=36, out_channels=16, image_dim=image_dim, added_kv_proj_dim=width)
    config_file.write_text(json.dumps(config))
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, 16, *latent, device=dev, generator=g)
    target = torch.randn(1, 16, *latent, device=dev, generator=g)
    first = torch.zeros(1, 20, *latent, device=dev)
    first[:, :4, 0] = 1.0  # the mask marks frame 0 given
    first[:, 4:, :1] = torch.randn(1, 16, 1, *latent[1:], device=dev, generator=g)
    cond = Conditioning(torch.randn(1, TEXT_LEN, WAN_1_3B["text_dim"], device=dev, generator=g), first_frame=first,
                        image_embeds=torch.randn(1, 257, image_dim, device=dev, generator=g))
    t = torch.tensor([500.0], device=dev)
    every = ["native", "cudnn", "flash", "fa4", "fa4_sparse"]
    shared = None
    for chunk in (1, 3):
        with torch.device(dev):
            model = CausalWanModel(CausalWanModelConfig(init_from=str(folder), random_init=shared is None,
                                                        trainable=True, chunk_size=chunk),
                                   role="causal", **({} if shared is None else {"transformer": shared}))
        if shared is None:
            cast_parameters_(model.transformer, bf16)
            shared = model.transformer
        model.bind_device(dev, bf16)
        assert model.given_first_frame, "an I2V folder makes a given-first-frame causal student"

        def forward(m):
            return m.predict_noise(x, t, cond)

        def stream(m, chunk=chunk):
            m.clear_caches()
            outs = [m.predict_noise_streaming(x[:, :, :1], t, cond, cache_tag="c", store_kv=True, cur_start_frame=0)]
            outs.append(m.predict_noise_streaming(x[:, :, 1:1 + chunk], t, cond, cache_tag="c", store_kv=True,
                                                  cur_start_frame=1))
            outs.append(m.predict_noise_streaming(x[:, :, 1 + chunk:], t, cond, cache_tag="c", store_kv=False,
                                                  cur_start_frame=1 + chunk))
            m.clear_caches()
            return torch.cat(outs, dim=2)

        whole = forwards(rows, f"forward_chunk{chunk}", model, every, forward, dev, bf16).get("native")
        streamed = forwards(rows, f"streaming_chunk{chunk}", model, every, stream, dev, bf16).get("native")
        if whole is not None and streamed is not None:  # the streamed video against the whole-video forward
            rows[f"streaming_chunk{chunk}"]["native_vs_whole_forward"] = _compare(streamed, whole)
            save()
        model.transformer.enable_gradient_checkpointing()
        gradients(rows, f"gradients_chunk{chunk}", model, ["native", "cudnn", "fa4", "fa4_sparse"],
                  lambda m: F.mse_loss(m.predict_noise(x, t, cond)[:, :, 1:], target[:, :, 1:]), dev, bf16)
        model.transformer.disable_gradient_checkpointing()


def _verdicts(entry: dict, outs: dict) -> None:
    if "native" not in outs:
        return
    for b, out in outs.items():
        if b != "native":
            entry[b].update(_compare(out, outs["native"]))
    floor = max((entry[b]["rel_l2"] for b in ("cudnn", "flash") if "rel_l2" in entry.get(b, {})), default=None)
    entry["floor_rel_l2"] = floor
    for b, r in entry.items():
        if isinstance(r, dict) and "rel_l2" in r:
            r["agrees"] = r["rel_l2"] <= max(BF16_RTOL, 2 * floor) if floor is not None else r["rel_l2"] <= BF16_RTOL


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="agreement,kernels")
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    NAME[0] = "fa4_checks_" + args.parts.replace(",", "_")
    import torch

    from distillery.models.wan.attention import fa4_problem

    cuda = torch.cuda.is_available()
    RESULTS["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "capability": list(torch.cuda.get_device_capability()) if cuda else None,
                      "fa4_problem": fa4_problem("cuda" if cuda else "cpu", torch.bfloat16)}
    try:
        from importlib.metadata import version

        RESULTS["env"]["flash_attn_4"] = version("flash-attn-4")
        RESULTS["env"]["nvidia_cutlass_dsl"] = version("nvidia-cutlass-dsl")
    except Exception as exc:
        RESULTS["env"]["versions_error"] = repr(exc)[:200]
    print(json.dumps(RESULTS["env"]), flush=True)
    save()
    for part in args.parts.split(","):
        t0 = time.time()
        try:
            {"kernels": lambda: kernels(args.reps), "agreement": agreement, "causal_i2v": causal_i2v}[part]()
        except Exception as exc:
            RESULTS[f"{part}_error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
            traceback.print_exc()
        RESULTS[f"{part}_wall_s"] = time.time() - t0
        save()
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
