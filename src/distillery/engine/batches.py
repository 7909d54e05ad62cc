"""The batches a run trains on: a rank's share of the latent set, in a resumable order.

:class:`TrainBatches` is what the trainer draws micro-batches from: the collated batches of a
:class:`~distillery.data.LatentBatchLoader`, each with the latent set's empty-prompt embedding
(the CFG negative) — or, with ``training.data.unconditional: negative``, its negative prompt's — under
``empty_text_embeds`` when the set stores one. Its ``state_dict`` is the
loader's position (epoch, batches drawn in it, seed, samples), which a checkpoint stores as the
trainer's ``data_*`` entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from distillery.components.distributed import DistEnv
from distillery.config.schema import DataConfig
from distillery.data import LatentBatchLoader, LatentDataset, ShardedBatchSampler, pad_prompt_embedding, read_empty_prompt_embedding


class TrainBatches:
    """Infinite iterator of training batches (``next(batches)``: one micro-batch, a dict of CPU
    tensors as :func:`~distillery.data.collate_latents` makes them, plus ``empty_text_embeds``:
    fp32 ``[text_max_length, D]`` on the device, the same tensor every batch)."""

    def __init__(self, loader: LatentBatchLoader, empty_text: torch.Tensor | None = None) -> None:
        self.loader = loader
        self.empty_text = empty_text

    def __iter__(self) -> TrainBatches:
        return self

    def __next__(self) -> dict[str, Any]:
        batch = next(self.loader)
        if self.empty_text is not None:
            batch["empty_text_embeds"] = self.empty_text
        return batch

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def build_batches(root: Path, data: DataConfig, seed: int, env: DistEnv, with_latents: bool) -> TrainBatches:
    """This rank's batches of the latent set at ``root`` (split ``data.split``, ``data.batch_size``
    rows each, text padded to ``data.text_max_length``), shuffled by ``seed``; ``with_latents``:
    False for a method that reads prompts only (``data_kind == "prompts"``). The batches' unconditional
    prompt embedding is the set's empty prompt's, or with ``data.unconditional: negative`` its negative
    prompt's (:func:`~distillery.data.read_empty_prompt_embedding`)."""
    dataset = LatentDataset(root, data.split, with_latents=with_latents)
    sampler = ShardedBatchSampler(len(dataset), data.batch_size, env.rank, env.world_size, seed, data.drop_last)
    # on CUDA, batches are collated into page-locked memory: their copy to the GPU does not wait for queued work
    loader = LatentBatchLoader(dataset, sampler, data.text_max_length, pin_memory=env.device.type == "cuda")
    empty = read_empty_prompt_embedding(root, data.unconditional)
    empty_text = None
    if empty is not None:  # constant: on the device once, not copied every step
        empty_text = pad_prompt_embedding(empty, data.text_max_length).to(env.device, torch.float32)
    return TrainBatches(loader, empty_text)
