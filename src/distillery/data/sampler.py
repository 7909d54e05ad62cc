"""Deterministic, resumable, rank-sharded batch order, and the loader that collates it.

Every rank builds the same permutation per epoch; the global batch of step ``k`` is the ``k``-th
run of ``world_size * batch_size`` consecutive permutation entries, and rank ``r`` takes its
``r``-th slice of ``batch_size``. So the union over ranks of one step is exactly the batch a single
process with ``batch_size * world_size`` would draw, and a resumed run continues with the batch an
uninterrupted run would have drawn next.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

from distillery.common.errors import UserError
from distillery.data.dataset import LatentDataset, collate_latents

__all__ = ["LatentBatchLoader", "ShardedBatchSampler"]

logger = logging.getLogger("distillery.data")


class ShardedBatchSampler:
    """Infinite iterator of this rank's batches: lists of ``batch_size`` sample indices.

    Epoch ``e`` uses ``torch.randperm(num_samples)`` drawn from
    ``torch.Generator().manual_seed(seed + e)`` (identical on every rank). With ``drop_last`` (the
    default) the tail that does not fill a global batch is dropped; without it the last global
    batch is filled up with the first indices of the same permutation. Every rank gets the same
    number of batches per epoch (:attr:`steps_per_epoch`).

    Resume: :meth:`state_dict` / :meth:`load_state_dict`. Position is counted in global batches, so
    a restore is exact when the global batch size (``batch_size * world_size``) is unchanged, also
    across a different number of ranks.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        global_batch = batch_size * world_size
        if num_samples < global_batch:
            raise UserError(
                f"the dataset has {num_samples} samples, fewer than one global batch of "
                f"{global_batch} (batch_size {batch_size} x world_size {world_size}); "
                "use a smaller batch size, fewer ranks or more data"
            )
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.global_batch_size = global_batch
        full, rest = divmod(self.num_samples, global_batch)
        #: batches this rank yields per epoch (the same on every rank)
        self.steps_per_epoch = full if (drop_last or rest == 0) else full + 1
        self._epoch = 0
        self._batches_in_epoch = 0
        self._perm: torch.Tensor | None = None
        self._perm_epoch = -1

    @property
    def epoch(self) -> int:
        """Epoch of the most recently yielded batch (0 before the first)."""
        return self._epoch

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_samples, generator=g)
            need = self.steps_per_epoch * self.global_batch_size
            if need > self.num_samples:
                perm = torch.cat([perm, perm[: need - self.num_samples]])
            self._perm, self._perm_epoch = perm, epoch
        assert self._perm is not None
        return self._perm

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        if self._batches_in_epoch >= self.steps_per_epoch:
            self._epoch += 1
            self._batches_in_epoch = 0
        perm = self._permutation(self._epoch)
        start = self._batches_in_epoch * self.global_batch_size + self.rank * self.batch_size
        self._batches_in_epoch += 1
        return perm[start : start + self.batch_size].tolist()

    def state_dict(self) -> dict[str, int]:
        """Position after the last yielded batch: ``epoch``, ``batches_in_epoch``, ``seed``, ``num_samples``."""
        return {
            "epoch": self._epoch,
            "batches_in_epoch": self._batches_in_epoch,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a position from :meth:`state_dict`; the next batch is the one that would have followed.

        :class:`UserError` if the dataset size changed or the position does not fit this sampler's
        epoch length. A different seed is taken from the checkpoint (with a warning), since the
        position only means something under the seed it was recorded with.
        """
        if int(sd["num_samples"]) != self.num_samples:
            raise UserError(
                f"cannot resume the data order: the checkpoint was taken on a dataset of {int(sd['num_samples'])} "
                f"samples, the dataset now has {self.num_samples}; resume with the same latents artifact"
            )
        epoch, batches = int(sd["epoch"]), int(sd["batches_in_epoch"])
        if epoch < 0 or not 0 <= batches <= self.steps_per_epoch:
            raise UserError(
                f"cannot resume the data order: position epoch {epoch}, batch {batches} does not fit an epoch "
                f"of {self.steps_per_epoch} batches (global batch {self.global_batch_size}); "
                "resume with the same global batch size"
            )
        if int(sd["seed"]) != self.seed:
            logger.warning(
                "data seed %d differs from the checkpoint's %d; continuing the checkpoint's order",
                self.seed,
                int(sd["seed"]),
            )
            self.seed = int(sd["seed"])
            self._perm_epoch = -1
        self._epoch, self._batches_in_epoch = epoch, batches


class LatentBatchLoader:
    """Infinite iterator of collated batches (see :func:`collate_latents`) in sampler order.

    Collation runs in the calling process (rows are already in memory), into page-locked memory
    with ``pin_memory`` (for non-blocking copies to a GPU). ``state_dict`` /
    ``load_state_dict`` / ``epoch`` are the sampler's.
    """

    def __init__(
        self,
        dataset: LatentDataset,
        sampler: ShardedBatchSampler,
        text_max_length: int,
        dtype: torch.dtype | None = None,
        pin_memory: bool = False,
    ) -> None:
        if sampler.num_samples != len(dataset):
            raise ValueError(f"sampler covers {sampler.num_samples} samples but the dataset has {len(dataset)}")
        self.dataset = dataset
        self.sampler = sampler
        self.text_max_length = text_max_length
        self.dtype = dtype
        self.pin_memory = pin_memory

    @property
    def epoch(self) -> int:
        """Epoch of the most recently yielded batch."""
        return self.sampler.epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        indices = next(self.sampler)
        return collate_latents([self.dataset[i] for i in indices], self.text_max_length, self.dtype, self.pin_memory)

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sampler.load_state_dict(sd)
