"""GPU time of a training step by kernel family, from a torch.profiler window over steady steps.

Used by the step benchmarks (``bench/sft_step.py --breakdown``): a callback steps a profiler whose
schedule skips the warm-up steps and records ``active`` steps; :func:`kernel_families` sums the
kernels' device time per family and divides by the steps recorded. Families are matched on kernel
names (cuDNN / flash / memory-efficient attention, cuBLAS/nvjet GEMMs, Triton fusions, the fused
optimizer, NCCL, copies, other) — names, not semantics, so the table says which name matched.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from distillery.callbacks.base import Callback

FAMILIES = (  # first match wins; patterns are lower-case substrings of the kernel name
    ("attention backward", ("bprop", "flash_bwd", "attention_backward", "fmha_bwd", "attn_bwd", "flash_attn_bwd",
                            "attentionbackward")),  # the last: FlashAttention-4's CuTe kernels (and their pre/post passes)
    ("attention forward", ("fprop", "flash_fwd", "fmha_fwd", "attn_fwd", "flash_attn_fwd", "efficient_attention_forward",
                           "attentionforward")),
    ("optimizer (fused AdamW, foreach)", ("adam", "multi_tensor_apply", "foreach")),
    ("nccl", ("nccl",)),
    ("gemm (cuBLAS / nvjet / cutlass)", ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "cublas")),
    ("triton (compiled fusions)", ("triton",)),
    ("copies / casts", ("copy", "memcpy", "memset", "cast")),
    ("elementwise / reductions (eager)", ("elementwise", "reduce", "vectorized")),
)


def family_of(kernel: str) -> str:
    name = kernel.lower()
    for family, patterns in FAMILIES:
        if any(p in name for p in patterns):
            return family
    return "other"


def kernel_families(prof: Any, steps: int) -> dict[str, Any]:
    """``{"per_step_s": {family: seconds}, "kernels_per_step_s": total, "top": [(kernel, s/step, family), ...]}``."""
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if str(getattr(event, "device_type", "")).endswith("CUDA") and event.device_time_total > 0 and not event.cpu_children:
            per_kernel[event.name] += event.device_time_total / 1e6
    # key_averages() nests ops over kernels; raw events with device time and no CPU children are the kernels
    fam: dict[str, float] = defaultdict(float)
    for name, seconds in per_kernel.items():
        fam[family_of(name)] += seconds / steps
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    return {"per_step_s": {k: round(v, 4) for k, v in sorted(fam.items(), key=lambda kv: -kv[1])},
            "kernels_per_step_s": round(sum(fam.values()), 4),
            "top": [(name[:110], round(s / steps, 4), family_of(name)) for name, s in top]}


class ProfilerStepper(Callback):
    """Advances a ``torch.profiler.profile`` with a schedule at the end of every optimizer step."""

    def __init__(self, prof: Any) -> None:
        super().__init__(config=None, name="bench_profiler")
        self.prof = prof

    def on_training_step_end(self, ctx, step):  # noqa: ANN001 - the Callback hook
        self.prof.step()
        return {}
