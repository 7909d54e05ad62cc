"""Probe for issue 29 (DMD2 on 2 GPUs under FSDP2 stopped at step 1 with ``grad_norm/critic=inf,
grad_norm/student=inf``): find the first non-finite / corrupted tensor, with and without the fix.

Suspected cause (fixed in ``engine/builder.py``; not yet seen on a GPU by the fix's author): Inductor's *mix-order
reduction* (Triton, default on since torch 2.10) never writes the gradient of a Wan block's ``scale_shift_table``
(pytorch/pytorch#193061), so compiled blocks return uninitialised or stale memory as that gradient. The benchmark's
DMD2 run compiled bidirectional blocks with the feature on; Self-Forcing (finite on 2 GPUs) had it off because its
causal student turned it off process-wide.

Two modes (both also run on the CPU at a tiny shape with ``--tiny``, to check the script itself):

``block`` (ONE GPU is enough: the bug is in the compiled kernel, not in FSDP2):
    one Wan-1.3B-wide transformer with ``--layers`` blocks (random init, bf16 parameters as FSDP2 gathers them) on
    latents ``--latent T H W`` and 512 text tokens; the gradients of every parameter from eager, from compiled blocks
    with mix-order reduction ON and with it OFF, each compared with eager (max |diff| / max |eager|, and
    non-finite counts). Expected if the diagnosis is right: ON corrupts ``blocks.*.scale_shift_table`` (every call,
    values uninitialised or a previous call's), OFF matches eager to bf16 rounding.

        python bench/dmd2_two_gpu_probe.py block [--latent 21 60 104] [--layers 2]

``trainer`` (the failing configuration through the real Trainer; torchrun over N GPUs, or one GPU):
    ``bench/distill_step.py``'s ``dmd2_data`` configuration (random init, generator update every step, teacher
    CFG 4, grad clip 1, compiled blocks), ``--steps`` steps. After every backward each rank prints the parameters
    whose (local shard of the) gradient is non-finite, the largest ones, and each role's output finiteness.
    ``--keep-mix-order`` restores the pre-fix behaviour (mix-order reduction stays on) to reproduce the failure.

        torchrun --standalone --nproc_per_node 2 bench/dmd2_two_gpu_probe.py trainer --keep-mix-order
        torchrun --standalone --nproc_per_node 2 bench/dmd2_two_gpu_probe.py trainer          # with the fix
        (GPU image: ``source bench/gpu_env.sh`` first; latent 21x60x104 needs ~120 GiB per H200 without AC)

Output lines start with ``PROBE``; ``block`` also prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

TEXT_LEN = 512
WIDE = dict(num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
            freq_dim=256, ffn_dim=8960, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
            rope_max_seq_len=1024, patch_size=[1, 2, 2])
TINY = dict(WIDE, num_attention_heads=2, attention_head_dim=16, text_dim=64, ffn_dim=64)


def log(msg: str) -> None:
    rank = os.environ.get("RANK", "0")
    print(f"PROBE[rank {rank}] {msg}", flush=True)


# -- block mode -------------------------------------------------------------------------------------------------
def _grads(model: torch.nn.Module, latents: torch.Tensor, text: torch.Tensor, t: torch.Tensor,
           probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (fp32 copy) of ``<out, probe>`` (a fixed random projection of the output)."""
    model.zero_grad(set_to_none=True)
    out = model(hidden_states=latents, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    (out.float() * probe).sum().backward()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, dict]:
    rows = {}
    for name, r in ref.items():
        g = got.get(name)
        if g is None:
            rows[name] = {"missing": True}
            continue
        bad = int((~torch.isfinite(g)).sum())
        diff = (g - r).abs().nan_to_num(float("inf")).max().item()
        rows[name] = {"nonfinite": bad, "rel_err": diff / max(r.abs().max().item(), 1e-30)}
    return rows


def run_block(args: argparse.Namespace) -> int:
    from diffusers import WanTransformer3DModel
    from torch._inductor import config as inductor_config

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    arch = dict(TINY if args.tiny else WIDE, num_layers=args.layers)
    torch.manual_seed(0)
    with torch.device(device):
        eager = WanTransformer3DModel(**arch).to(torch.bfloat16)  # what FSDP2 gathers: bf16 params, fp32 rotary buffers
    t, h, w = args.latent
    g = torch.Generator(device).manual_seed(1)
    latents = torch.randn(1, arch["in_channels"], t, h, w, generator=g, device=device).bfloat16()
    text = torch.randn(1, TEXT_LEN, arch["text_dim"], generator=g, device=device).bfloat16()
    step = torch.tensor([500.0], device=device)
    probe = torch.randn(1, arch["out_channels"], t, h, w, generator=g, device=device)
    ref = _grads(eager, latents, text, step, probe)
    result = {"device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"), "torch": torch.__version__,
              "latent": [t, h, w], "layers": args.layers, "variants": {}}
    for label, mix in (("compiled_mix_order_on", True), ("compiled_mix_order_off", False)):
        torch._dynamo.reset()
        model = copy.deepcopy(eager)
        for block in model.blocks:
            block.compile()
        with inductor_config.patch({"triton.mix_order_reduction": mix}):
            calls = [_compare(ref, _grads(model, latents, text, step, probe)) for _ in range(2)]  # 2nd: stale reuse
        worst = {}
        for name in ref:
            worst[name] = {"nonfinite": max(c[name].get("nonfinite", -1) for c in calls),
                           "rel_err": max(c[name].get("rel_err", float("inf")) for c in calls)}
        top = sorted(worst.items(), key=lambda kv: -kv[1]["rel_err"])[:6]
        tables = {n: v for n, v in worst.items() if n.endswith("scale_shift_table")}  # the suspect (module doc)
        result["variants"][label] = {"worst": dict(top), "scale_shift_tables": tables,
                                     "nonfinite_params": [n for n, v in worst.items() if v["nonfinite"]]}
        log(f"{label}: scale_shift_table relative errors vs eager: "
            + ", ".join(f"{n}={v['rel_err']:.3g}" for n, v in tables.items()))
        log(f"{label}: largest relative gradient errors vs eager: "
            + ", ".join(f"{n}={v['rel_err']:.3g}" + (f" ({v['nonfinite']} non-finite)" if v["nonfinite"] else "")
                        for n, v in top))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# -- trainer mode -----------------------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    from distillery.components.distributed import local_shard

    return local_shard(t)


def _check_grads(method, phase: str) -> None:
    """Per trainable role: parameters with non-finite gradient entries, and the 3 largest finite gradient norms."""
    for role in ("student", "critic"):
        model = method.role_models[role]
        bad, norms = [], []
        for mod_name, module in model.trainable_modules().items():
            for name, p in module.named_parameters():
                if p.grad is None:
                    continue
                g = _local(p.grad)
                if g.numel() == 0:
                    continue
                n_bad = int((~torch.isfinite(g)).sum())
                if n_bad:
                    bad.append(f"{mod_name}.{name} ({n_bad}/{g.numel()}, max|g| {g.abs().max().item():.3g})")
                else:
                    norms.append((g.float().norm().item(), f"{mod_name}.{name}"))
        norms.sort(reverse=True)
        log(f"{phase} {role}: {len(bad)} parameters with non-finite grads"
            + (": " + "; ".join(bad[:12]) if bad else "")
            + " | largest finite local grad norms: " + ", ".join(f"{n}={v:.3g}" for v, n in norms[:3]))


def _watch_outputs(method) -> None:
    """Log each role's transformer output when it is non-finite (root module only: hooks inside compiled blocks
    would be traced and could change what Inductor fuses)."""
    for role, model in method.role_models.items():
        def hook(module, args, kwargs, output, role=role):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and not torch.isfinite(out).all():
                log(f"forward output of {role} is non-finite ({int((~torch.isfinite(out)).sum())} entries)")
        model.transformer.register_forward_hook(hook, with_kwargs=True)


def run_trainer(args: argparse.Namespace) -> int:
    if args.tiny:
        os.environ["BENCH_SMOKE"] = "1"  # distill_step / sft_step: tiny Wan widths
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import distill_step  # noqa: E402  (bench/, after the path insert)
    from sft_step import make_assets  # noqa: E402

    import distillery.engine.builder as builder
    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.assemble import build_trainer
    from distillery.methods.dmd2 import DMD2Method

    if args.keep_mix_order:  # the pre-fix behaviour: a bidirectional model never turns the feature off
        builder.avoid_mix_order_reduction = lambda: None
        log("keeping Inductor mix-order reduction ON (pre-fix behaviour)")
    inner = DMD2Method.backward

    def backward(self, output, grad_accum_rounds=1):
        inner(self, output, grad_accum_rounds)
        _check_grads(self, f"after backward ({', '.join(f'{k}={float(v):.4g}' for k, v in output.losses.items())})")

    DMD2Method.backward = backward
    size = tuple(args.latent)
    with tempfile.TemporaryDirectory() as tmp:
        model, data = make_assets(Path(tmp), size)
        raw = distill_step.distill_run_config(model, data, Path(tmp) / "run", "dmd2_data", args.steps,
                                              False if args.eager else None, args.ac)
        raw["training"]["loop"]["skip_nonfinite_steps"] = args.steps  # keep going: see every step's gradients
        config = load_run_config(raw=raw, prefixes=allowed_prefixes())
        env = init_distributed(config.training.distributed)
        try:
            if env.device.type == "cuda":  # random weights drawn on the GPU, as bench/distill_step.py does
                from diffusers import WanTransformer3DModel

                on_cpu = WanTransformer3DModel.from_config

                def from_config_on_device(*a, **k):
                    with torch.device(env.device):
                        return on_cpu(*a, **k)

                WanTransformer3DModel.from_config = from_config_on_device
            trainer = build_trainer(config, env)
            from torch._inductor import config as inductor_config

            log(f"world {env.world_size}, compute {env.compute_dtype}, compiled "
                f"{builder.resolve_compile(config.training.model, env)}, mix_order_reduction "
                f"{inductor_config.triton.mix_order_reduction}")
            _watch_outputs(trainer.method)
            result = trainer.fit()
            for row in result.history:
                log("step " + json.dumps({k: v for k, v in row.items() if k.startswith(("grad_norm", "skipped",
                                                                                          "generator", "critic_loss"))}))
        finally:
            shutdown()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["block", "trainer"])
    parser.add_argument("--latent", type=int, nargs=3, default=None, metavar=("T", "H", "W"))
    parser.add_argument("--layers", type=int, default=2, help="block mode: transformer blocks")
    parser.add_argument("--steps", type=int, default=2, help="trainer mode: optimizer steps")
    parser.add_argument("--keep-mix-order", action="store_true", help="trainer mode: the pre-fix behaviour")
    parser.add_argument("--eager", action="store_true", help="trainer mode: no compiled blocks (control)")
    parser.add_argument("--ac", action="store_true", help="trainer mode: activation checkpointing")
    parser.add_argument("--tiny", action="store_true", help="tiny widths and latents, on the CPU (checks the script)")
    args = parser.parse_args()
    if args.latent is None:
        args.latent = [3, 8, 8] if args.tiny else [21, 60, 104]
    return run_block(args) if args.mode == "block" else run_trainer(args)


if __name__ == "__main__":
    sys.exit(main())
