"""Tensor parallelism of the Wan blocks: attention and FFN split column/row-wise over a TP group, with DTensor.

Megatron's split as torchtitan applies it (``parallelize_module``), per block of a ``WanTransformer3DModel``:

- self- and cross-attention: ``to_q``, ``to_k``, ``to_v`` (and an image-to-video block's ``add_k_proj`` /
  ``add_v_proj``) column-wise — each rank computes ``heads / tp`` heads —, ``to_out.0`` row-wise (its output summed
  over the group: every rank holds the whole residual stream again);
- FFN: ``net.0.proj`` column-wise, ``net.2`` row-wise;
- Wan's q/k RMSNorm runs over the whole inner dimension, across heads (``qk_norm: rms_norm_across_heads``): it becomes
  :class:`HeadsRMSNorm`, which keeps the projection's output a DTensor split by heads, so the mean of squares is a
  reduction over the group (DTensor inserts it, inside a compiled block too) and its weight is split like the heads;
- each attention's ``heads`` becomes ``heads / tp`` (what the processors unflatten by);
- everything else — patch and condition embeddings, the modulation tables, the LayerNorms, the output head, a PDD
  head bank — is whole on every rank (computed alike on each).

FSDP2 then shards over the data dims of the same device mesh (2-D DTensors for the split weights). The parameter
names do not change, so a checkpoint of a TP run reshards into a plain run and the reverse (DCP).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

COLUMN = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.add_k_proj",
          "attn2.add_v_proj", "ffn.net.0.proj")
ROW = ("attn1.to_out.0", "attn2.to_out.0", "ffn.net.2")
NORMED = {"to_q": "norm_q", "to_k": "norm_k", "add_k_proj": "norm_added_k"}  # a projection → the norm of its output


class HeadsRMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm`` over the whole inner dimension of activations split by heads over a TP group.

    Input: the column-wise projection's output as a DTensor ``Shard(-1)`` (its local part ``[..., inner / tp]``);
    output: this rank's part, normalised by the mean of squares over every head (a plain tensor, as the processors
    take it). ``weight``: a DTensor ``Shard(0)`` (this rank's heads' scales)."""

    def __init__(self, norm: torch.nn.RMSNorm, mesh: DeviceMesh) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.eps = norm.eps
        self.weight = torch.nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Shard(0)]),
                                         requires_grad=norm.weight.requires_grad)

    def forward(self, x):  # x: DTensor Shard(-1)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # the mean: a sum over the group (Partial → Replicate)
        return (y * self.weight.float()).to(x.dtype).to_local()


def tensor_parallel_problem(config: dict, tp_size: int, sp_size: int = 1) -> str | None:
    """Why a Wan transformer of ``config`` (its ``config.json``) cannot be split over ``tp_size`` ranks (with Ulysses over
    ``sp_size`` on each rank's heads), or None."""
    heads, ffn = int(config["num_attention_heads"]), int(config["ffn_dim"])
    if heads % (tp_size * sp_size):
        return (f"{heads} attention heads do not split over tp_size {tp_size} × sp_size {sp_size}; use sizes whose "
                f"product divides {heads}")
    if ffn % tp_size:
        return f"the FFN width {ffn} does not split over tp_size {tp_size}"
    if config.get("qk_norm") not in (None, "rms_norm_across_heads"):
        return f"qk_norm {config.get('qk_norm')!r}: tensor parallelism splits rms_norm_across_heads only"
    return None


def install_tensor_parallel(transformer: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Split every block of ``transformer`` over the TP ``mesh`` (module doc), in place, before FSDP2 wraps it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    for block in transformer.blocks:
        if getattr(block.attn1, "fused_projections", False) or getattr(block.attn2, "fused_projections", False):
            raise ValueError("tensor parallelism splits unfused q/k/v projections; unfuse them first")
        plan = {}
        for name in COLUMN:
            owner, proj = name.split(".", 1)
            if proj.startswith("add_") and getattr(getattr(block, owner), proj, None) is None:
                continue  # a text-to-video block: no image projections
            plan[name] = ColwiseParallel(use_local_output=proj not in NORMED)  # a normed projection's output stays a DTensor
        plan.update({name: RowwiseParallel() for name in ROW})
        parallelize_module(block, mesh, plan)
        for attn in (block.attn1, block.attn2):
            for proj, norm in NORMED.items():
                if getattr(attn, proj, None) is not None:
                    setattr(attn, norm, HeadsRMSNorm(getattr(attn, norm), mesh))
            attn.heads //= tp
