"""The batches a run trains on: a rank's share of the latent set, in a resumable order.

:class:`TrainBatches` is what the trainer draws micro-batches from: the collated batches of a
:class:`~distillery.data.LatentBatchLoader`, each with the latent set's empty-prompt embedding
(the CFG negative) — or, with ``training.data.unconditional: negative``, its negative prompt's — under
``empty_text_embeds`` when the set stores one — and, for a method that reads prompts only, ``latent_shape`` (the
``[C, T, H, W]`` its rollouts generate: ``training.data.latent_shape``, else the set's manifest's). The set may be
a latent set or a prompt-only one (the ``prompts`` stage's); a method that reads video latents is refused a
prompt-only set before any model is loaded (:func:`check_data_kind`). Its ``state_dict`` is the
loader's position (epoch, batches drawn in it, seed, samples), which a checkpoint stores as the
trainer's ``data_*`` entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.components.distributed import DistEnv
from distillery.config.schema import DataConfig, RunConfig
from distillery.data import LatentBatchLoader, LatentDataset, ShardedBatchSampler, data_kind, pad_prompt_embedding, read_empty_prompt_embedding
from distillery.data.dataset import MANIFEST_FILE, PROMPTS_KIND, recorded_latent_shape


class TrainBatches:
    """Infinite iterator of training batches (``next(batches)``: one micro-batch, a dict of CPU
    tensors as :func:`~distillery.data.collate_latents` makes them, plus ``empty_text_embeds``:
    fp32 ``[text_max_length, D]`` on the device, the same tensor every batch)."""

    def __init__(self, loader: LatentBatchLoader, empty_text: torch.Tensor | None = None,
                 latent_shape: tuple[int, ...] | None = None) -> None:
        self.loader = loader
        self.empty_text = empty_text
        self.latent_shape = latent_shape

    def __iter__(self) -> TrainBatches:
        return self

    def __next__(self) -> dict[str, Any]:
        batch = next(self.loader)
        if self.empty_text is not None:
            batch["empty_text_embeds"] = self.empty_text
        if self.latent_shape is not None and "latents" not in batch:
            batch["latent_shape"] = self.latent_shape
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
    latent_shape = None if with_latents else rollout_latent_shape(root, data)
    dataset = LatentDataset(root, data.split, with_latents=with_latents)
    sampler = ShardedBatchSampler(len(dataset), data.batch_size, env.data_rank, env.data_world, seed, data.drop_last)  # the ranks of an SP group read the same
    # on CUDA, batches are collated into page-locked memory: their copy to the GPU does not wait for queued work
    loader = LatentBatchLoader(dataset, sampler, data.text_max_length, pin_memory=env.device.type == "cuda")
    empty = read_empty_prompt_embedding(root, data.unconditional)
    empty_text = None
    if empty is not None:  # constant: on the device once, not copied every step
        empty_text = pad_prompt_embedding(empty, data.text_max_length).to(env.device, torch.float32)
    return TrainBatches(loader, empty_text, latent_shape)


def rollout_latent_shape(root: Path, data: DataConfig) -> tuple[int, ...]:
    """The ``[C, T, H, W]`` a prompts-only method's rollouts generate: ``data.latent_shape``, else the data set's
    manifest's ``latent_shape`` (a latent set: its rows'; a prompt-only set: what its stage derived from the frames,
    size and the base's VAE), else — a latent set written without a manifest — its first row's (a set holds one
    layout). Both given and different, or none of them, is one :class:`UserError` line."""
    recorded = recorded_latent_shape(root, data.split)
    if data.latent_shape is not None:
        if recorded is not None and list(data.latent_shape) != recorded:
            raise UserError(f"config error: training.data.latent_shape: {list(data.latent_shape)} differs from the "
                            f"{recorded} {root / MANIFEST_FILE} records; set it to that, or null to use it")
        return tuple(int(v) for v in data.latent_shape)
    if recorded is None:
        raise UserError(f"config error: training.data.latent_shape: required ([C, T, H, W] of the samples rollouts "
                        f"generate): {root / MANIFEST_FILE} records none")
    return tuple(recorded)


def check_data_kind(config: RunConfig) -> None:
    """Before any model is loaded: a method that reads video latents with its config
    (:meth:`~distillery.methods.base.TrainingMethod.reads_latents`) on a prompt-only set is one :class:`UserError`
    line (nothing else is checked here: a missing or bad data folder is named where it is read)."""
    path = Path(config.training.data.path) if config.training.data.path else None
    method = config.method.cls
    if path is None or not path.is_dir() or not isinstance(method, type) or not hasattr(method, "reads_latents"):
        return
    if data_kind(path) == PROMPTS_KIND and method.reads_latents(config.method.config):
        rollout = getattr(config.method.config, "rollout", None)
        gan = float(getattr(config.method.config, "gan_weight", 0.0) or 0.0)
        if gan > 0 and rollout != "data_latent":  # a GAN term: the discriminator's real samples are the set's latents
            raise UserError(f"config error: training.data.path: {path} holds prompt embeddings only (no video latents), "
                            f"but {method.__name__}'s GAN term (gan_weight {gan:g}) needs real latents for its "
                            "discriminator; give it a latent set (the latents stage's, or one of the teacher's samples) "
                            "or set gan_weight 0")
        how = f" with rollout: {rollout}" if rollout else ""
        raise UserError(f"config error: training.data.path: {path} holds prompt embeddings only (no video latents), but "
                        f"{method.__name__}{how} trains on video latents; give it a latent set (the latents stage's)"
                        + (" or use rollout: simulate" if rollout == "data_latent" else ""))
