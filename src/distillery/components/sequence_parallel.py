"""Ulysses sequence parallelism: one sample's token sequence split over the ranks of an SP group.

The ``sp_size`` consecutive ranks of a group hold the same samples (the same batch, noise and timesteps: the data
and :class:`~distillery.components.rng.BatchRNG` are split over the *data* ranks only) and each computes the
transformer on its own ``1/sp_size`` of the tokens. Everything per token (patch embedding output, norms, FFN, the
cross-attention of a token's query to the whole prompt, the output projection) stays local; self-attention needs
every token, so around it an all-to-all turns the sequence shards into head shards (every token, ``heads/sp_size``
heads on each rank), the attention runs as it would on one rank — any kernel, block-causal masks and KV caches
included — and a second all-to-all turns the result back (DeepSpeed-Ulysses).

Layouts: a sharded tensor holds rank ``r``'s contiguous slice ``[r·n, (r+1)·n)`` of the padded sequence
(``n = ceil(tokens / sp_size)``; the last rank's slice ends in up to ``sp_size − 1`` zero pads, which the attention
never sees — they are dropped after the all-to-all in and put back after it — and :meth:`SequenceParallel.gather`
drops). Attention tensors are ``[B, L, heads, head_dim]``.

Gradients (why plain FSDP averaging stays right): every rank of a group runs the same replicated computation outside
the sharded region (the loss included) and backpropagates from it. :meth:`SequenceParallel.shard` is a plain slice
(its backward puts the shard's gradient in its place, zeros elsewhere), :meth:`SequenceParallel.gather` an
all-gather whose backward is a reduce-scatter (sum) and the all-to-alls are each other's backward. So on every rank a
parameter's gradient is its share (its own tokens) of ``sp_size`` times the sample's gradient, and FSDP2's mean over
all ``data ranks × sp_size`` ranks of its mesh is the mean over the data ranks of the samples' gradients — the same
as without SP. The collectives are ``torch.distributed._functional_collectives`` (traced whole by torch.compile).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's SP group: ``size`` ranks, this one at ``rank`` in it (``group``: their process group)."""

    group: dist.ProcessGroup
    size: int
    rank: int

    def __deepcopy__(self, memo: dict) -> SequenceParallel:  # a process group is not copied
        return self

    def padded(self, tokens: int) -> int:
        """The sequence length ``tokens`` padded to a multiple of :attr:`size`."""
        return -(-tokens // self.size) * self.size

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of ``x`` (whole on every rank) along ``dim``, zero-padded at the end to
        :meth:`padded` first (only the last ranks' slices hold pads)."""
        tokens = x.shape[dim]
        full = self.padded(tokens)
        if full != tokens:
            pad = [0, 0] * (x.ndim - 1 - dim % x.ndim) + [0, full - tokens]
            x = F.pad(x, pad)
        n = full // self.size
        return x.narrow(dim, self.rank * n, n)

    def gather(self, x: torch.Tensor, tokens: int, dim: int = 1) -> torch.Tensor:
        """Every rank's shard of ``dim`` put together (the pads dropped: ``tokens`` long), on every rank."""
        from torch.distributed._functional_collectives import all_gather_single_autograd

        whole = all_gather_single_autograd(x.contiguous(), gather_dim=dim, group=self.group)
        return whole.narrow(dim, 0, tokens) if whole.shape[dim] != tokens else whole

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, n, heads, D]`` (this rank's tokens, every head) → ``[B, n · size, heads / size, D]`` (every token of
        the padded sequence, this rank's heads ``[rank · heads/size, (rank + 1) · heads/size)``)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        b, n, h, d = x.shape
        send = x.reshape(b, n, self.size, h // self.size, d).permute(2, 0, 1, 3, 4).contiguous()
        got = all_to_all_single_autograd(send, None, None, self.group)  # [size (source rank), B, n, h/size, D]
        return got.permute(1, 0, 2, 3, 4).reshape(b, self.size * n, h // self.size, d)

    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`sequence_to_heads`: ``[B, n · size, heads / size, D]`` → ``[B, n, heads, D]``."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        b, full, hs, d = x.shape
        n = full // self.size
        send = x.reshape(b, self.size, n, hs, d).permute(1, 0, 2, 3, 4).contiguous()
        got = all_to_all_single_autograd(send, None, None, self.group)  # [size (source rank: its heads), B, n, hs, D]
        return got.permute(1, 2, 0, 3, 4).reshape(b, n, self.size * hs, d)

    def attention(self, attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                  query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tokens: int) -> torch.Tensor:
        """``attend(q, k, v)`` of the whole sequence, from this rank's shards ``[B, n, heads, D]``: all-to-all in,
        the pads dropped (``attend`` sees the ``tokens`` real ones, ``heads / size`` heads), put back, all-to-all
        out. Returns this rank's shard of the output ``[B, n, heads, D]``."""
        q, k, v = (self.sequence_to_heads(t)[:, :tokens] for t in (query, key, value))
        out = attend(q, k, v)
        full = self.padded(tokens)
        if full != tokens:
            out = F.pad(out, [0, 0, 0, 0, 0, full - tokens])
        return self.heads_to_sequence(out)


def heads_problem(heads: int, sp_size: int) -> str | None:
    """Why ``heads`` attention heads cannot be split over an SP group of ``sp_size`` ranks (None when they can)."""
    if sp_size > 1 and heads % sp_size:
        return f"{heads} attention heads do not split over {sp_size} sequence-parallel ranks (Ulysses gives each rank " \
               f"heads / sp_size of them); use an sp_size that divides {heads}"
    return None
