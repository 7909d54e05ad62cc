"""PDD Cosmos: the Cosmos trunk with a bank of per-interval output heads — :class:`~distillery.models.wan.pdd.HeadBankModel`
(the head bank, its forwards, the fused projection: written once for every family) over :class:`CosmosModel`'s inputs.
Cosmos' ``proj_out`` has no bias, so neither have its heads (their ``bias`` in ``pdd_heads.safetensors`` is zeros)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distillery.config.typed import bounded, check_fields
from distillery.models.base import Conditioning, TrainingBatch
from distillery.models.cosmos.bidirectional import CosmosModel
from distillery.models.cosmos.common import CosmosModelConfig
from distillery.models.wan.pdd import HeadBankModel


@dataclass
class PDDCosmosModelConfig(CosmosModelConfig):
    pdd_steps: int = bounded(8, 1, 1000)  # fine-grid intervals = heads of the bank

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, "model")  # pdd_steps' declared range, for a config built in Python


class PDDCosmosModel(HeadBankModel, CosmosModel):
    """A :class:`CosmosModel` whose output projection is a head bank; the Cosmos family's
    :class:`~distillery.models.base.PDDModelBase`."""

    config_class = PDDCosmosModelConfig

    def __init__(self, config: PDDCosmosModelConfig, role: str, transformer: torch.nn.Module | None = None) -> None:
        CosmosModel.__init__(self, config, role, transformer)
        self.attach_head_bank(config, role)

    def trunk_output(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                     conditional: bool) -> torch.Tensor:
        return self.forward_module(**self.transformer_inputs(noisy_latents, timesteps, batch, conditional))[0]
