"""Low-precision compute copy of a trainable transformer, kept in step with its fp32 master.

On a world of one rank without FSDP, bf16 training keeps two sets of parameters:

- the **master** module (fp32): what the optimizer updates and what EMA, grad clipping,
  checkpoints and export read — ``ModelBase.transformer``;
- the **compute** copy (bf16 parameters, fp32 buffers such as RoPE tables): what runs forward and
  backward, so every matmul, norm and activation is bf16 exactly as in a pure-bf16 model, without
  ``torch.autocast``'s per-op dispatch or its fp32 activations.

After each backward, :meth:`ComputeCopy.collect_grads` adds the copy's bf16 gradients into fp32
master gradients (micro-batches accumulate in fp32); after each optimizer step,
:meth:`ComputeCopy.refresh` writes the updated masters back into the copy. Both are a handful of
fused (foreach) kernels, no host sync. Updates smaller than bf16 resolution accumulate in the
masters instead of being rounded away.
"""

from __future__ import annotations

import copy

import torch


class ComputeCopy:
    """The ``dtype`` twin of ``master`` on ``device``: same structure, parameters cast, buffers kept."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.module = cast_parameters_(copy.deepcopy(master), dtype).to(device)
        self._pairs = [
            (pm, pc) for pm, pc in zip(master.parameters(), self.module.parameters(), strict=True) if pm.requires_grad
        ]
        self._master_params = [pm for pm, _ in self._pairs]
        self._compute_params = [pc for _, pc in self._pairs]
        self._grad_buffers: list[torch.Tensor] | None = None  # fp32 master gradients, allocated once

    def _buffers(self) -> list[torch.Tensor]:
        if self._grad_buffers is None:
            self._grad_buffers = [torch.empty_like(pm) for pm, _ in self._pairs]
        return self._grad_buffers

    @torch.no_grad()
    def collect_grads(self) -> None:
        """Master ``.grad`` (fp32) += the copy's ``.grad`` (bf16); the copy's gradients are cleared.

        A master whose ``.grad`` is None (after ``zero_grad(set_to_none=True)``) gets a fresh
        fp32 buffer holding the copy's gradient; one that has a gradient accumulates.
        """
        fresh_dst, fresh_src, acc_dst, acc_src = [], [], [], []
        for (pm, pc), buf in zip(self._pairs, self._buffers()):
            if pc.grad is None:
                continue
            if pm.grad is None:
                pm.grad = buf
                fresh_dst.append(buf)
                fresh_src.append(pc.grad)
            else:
                acc_dst.append(pm.grad)
                acc_src.append(pc.grad)
        if fresh_dst:
            torch._foreach_copy_(fresh_dst, fresh_src)
        if acc_dst:
            torch._foreach_add_(acc_dst, acc_src)
        for pc in self._compute_params:
            pc.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the (updated) fp32 master weights into the compute parameters."""
        if self._pairs:
            torch._foreach_copy_(self._compute_params, self._master_params)


def cast_parameters_(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``module``'s parameters (not its buffers: RoPE tables stay fp32) to ``dtype`` in place."""
    with torch.no_grad():
        for param in module.parameters():
            param.data = param.data.to(dtype)
    return module


def compile_wanted(setting: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    """A ``compile`` setting (training's ``training.model.compile`` or ``validate.compile``) resolved: null is on
    for bf16 on CUDA (the fastest step and sampling, BENCHMARKS.md), off otherwise."""
    if setting is not None:
        return setting
    return device.type == "cuda" and dtype == torch.bfloat16
