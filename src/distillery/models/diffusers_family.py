"""What the plugins of a family that wraps a diffusers transformer as it is share (Cosmos Predict 2.5, HunyuanVideo
1.5): building the role from a folder, the velocity it predicts, and a PDD student's head bank on it — written once;
a family's plugin says only how its pipeline feeds the transformer (:meth:`DiffusersFamilyModel.transformer_inputs`)
and what it reads from the transformer's config (:meth:`DiffusersFamilyModel.read_config`).

- :class:`DiffusersFamilyModel` — one role backed by the family's diffusers transformer (fp32 master weights on CPU at
  build), full attention; its output is the velocity ``v = ε − x0`` as it is (the family's module doc says why);
- :class:`PDDStepsConfig` — a PDD student's ``pdd_steps`` (the fine grid's intervals = the heads of its bank), mixed
  into the family's config class;
- :class:`DiffusersHeadBankModel` — the PDD student: the family's model with
  :class:`~distillery.models.wan.pdd.HeadBankModel`'s bank over its ``proj_out``
  (``class PDD<Family>Model(DiffusersHeadBankModel, <Family>Model)``).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.components.rng import BatchRNG
from distillery.config.typed import bounded, check_fields
from distillery.models.base import Conditioning, ModelBase, TrainingBatch, load_transformer
from distillery.models.wan.pdd import HeadBankModel


class DiffusersFamilyModel(ModelBase):
    """One role backed by the family's diffusers transformer, ``TRANSFORMER_CLASS`` (module doc). ``transformer``: an
    already loaded module of ``config.init_from`` to wrap instead of loading it again (a diffusers pipeline's own
    component). A config the family refuses (:meth:`config_problem`) is one :class:`UserError` line before any weight
    is read."""

    TRANSFORMER_CLASS: ClassVar[str]  # the diffusers class (``_class_name``) the family's folders hold
    FAMILY_LOG: ClassVar[str]  # the logger's name (``models.<family>``)

    def __init__(self, config: Any, role: str, transformer: torch.nn.Module | None = None) -> None:
        super().__init__(config, role)
        import diffusers

        module_class = getattr(diffusers, self.TRANSFORMER_CLASS)
        transformer_dir, scheduler_dir = self.locate_transformer(config.init_from)
        self.transformer_dir = transformer_dir
        problem = self.config_problem(dict(transformer.config) if transformer is not None
                                      else module_class.load_config(transformer_dir))
        if problem:  # before any weight is read
            raise UserError(f"models.{role}: {transformer_dir}: {problem}")
        self.transformer = transformer if transformer is not None else load_transformer(
            module_class, transformer_dir, config.random_init)
        self.settle_transformer(scheduler_dir)
        self.attention_backend = "native"
        self.read_config(dict(self.transformer.config))
        get_logger(self.FAMILY_LOG).info(
            "role %s: %s from %s (%.1f M params, shift %.2f)", role, self.TRANSFORMER_CLASS, transformer_dir,
            sum(p.numel() for p in self.transformer.parameters()) / 1e6, self.schedule.shift)

    # -- the family's part ---------------------------------------------------------------------
    @staticmethod
    @abstractmethod
    def locate_transformer(init_from: str | Path) -> tuple[Path, Path | None]:
        """``(transformer folder, scheduler folder or None)`` of a folder of the family."""

    def config_problem(self, config: dict[str, Any]) -> str | None:
        """Why a transformer of ``config`` cannot be trained or run here (one line), None when it can."""
        del config
        return None

    @abstractmethod
    def read_config(self, config: dict[str, Any]) -> None:
        """Set what the plugin reads from its transformer's config (``patch_size``, ``in_channels``, the prompt's
        widths; a config of another layout: one :class:`UserError` line)."""

    @abstractmethod
    def transformer_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                           conditional: bool) -> dict[str, Any]:
        """The keyword arguments of one transformer call for ``noisy_latents`` ``[B, C, T, H, W]`` at ``timesteps``
        (``[B]`` or per frame ``[B, T]``, in [0, 1000]), as the family's pipeline builds them, in the compute dtype."""

    # -- shared --------------------------------------------------------------------------------
    def shardable_blocks(self, module: torch.nn.Module | None = None) -> list[torch.nn.Module]:
        return list((module if module is not None else self.transformer).transformer_blocks)

    def transformer_config(self) -> dict[str, Any]:
        return dict(self.transformer.config)

    def enable_activation_checkpointing(self) -> None:
        """Recompute each block's activations in backward (diffusers' gradient checkpointing)."""
        self.transformer.enable_gradient_checkpointing()

    def sample_timesteps(self, batch_size: int, rng: BatchRNG) -> torch.Tensor:
        sigmas = self.schedule.sample_sigmas(batch_size, rng, self.config.timestep_sampling, self.config.logit_mean,
                                             self.config.logit_std)
        return sigmas * self.schedule.num_train_timesteps

    def raw_output(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                   conditional: bool) -> torch.Tensor:
        """One transformer call on :meth:`transformer_inputs`: its output ``[B, C', T, H, W]`` in the compute dtype."""
        return self.forward_module(**self.transformer_inputs(noisy_latents, timesteps, batch, conditional))[0]

    def predict_noise(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                      conditional: bool = True) -> torch.Tensor:
        """Velocity ``v = ε − x0`` ``[B, C, T, H, W]`` (float32): the transformer's output as it is (module doc)."""
        return self.raw_output(noisy_latents, timesteps, batch, conditional).float()


@dataclass
class PDDStepsConfig:
    """A PDD student's knob, mixed into its family's config class: ``class PDD<Family>ModelConfig(PDDStepsConfig,
    <Family>ModelConfig)``."""

    pdd_steps: int = bounded(8, 1, 1000)  # fine-grid intervals = heads of the bank

    def __post_init__(self) -> None:
        super().__post_init__()  # the family's config's checks
        check_fields(self, "model")  # pdd_steps' declared range, for a config built in Python


class DiffusersHeadBankModel(HeadBankModel):
    """A PDD student of a :class:`DiffusersFamilyModel` family: the family's model (next in the MRO) built, its head
    layout checked (:meth:`head_layout_problem`), then the bank over its ``proj_out``; the trunk's output is one
    transformer call on the family's inputs."""

    def __init__(self, config: Any, role: str, transformer: torch.nn.Module | None = None) -> None:
        super().__init__(config, role, transformer)  # the family's model
        problem = self.head_layout_problem()
        if problem:
            raise UserError(f"models.{role}: {problem}")
        self.attach_head_bank(config, role)

    def head_layout_problem(self) -> str | None:
        """Why the bank cannot lay out this transformer's output (one line), None when it can: the bank writes each
        head's output per token channel-last, as ``proj_out`` does in Wan and Cosmos."""
        return None

    def trunk_output(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                     conditional: bool) -> torch.Tensor:
        return self.raw_output(noisy_latents, timesteps, batch, conditional)
