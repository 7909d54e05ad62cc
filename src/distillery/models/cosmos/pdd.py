"""PDD Cosmos: the Cosmos trunk with a bank of per-interval output heads — :class:`~distillery.models.diffusers_family.DiffusersHeadBankModel`
(the head bank, its forwards, the fused projection: written once for every family) over :class:`CosmosModel`'s inputs.
Cosmos' ``proj_out`` has no bias, so neither have its heads (their ``bias`` in ``pdd_heads.safetensors`` is zeros)."""

from __future__ import annotations

from dataclasses import dataclass

from distillery.models.cosmos.bidirectional import CosmosModel
from distillery.models.cosmos.common import CosmosModelConfig
from distillery.models.diffusers_family import DiffusersHeadBankModel, PDDStepsConfig


@dataclass
class PDDCosmosModelConfig(PDDStepsConfig, CosmosModelConfig):
    """A :class:`CosmosModelConfig` with the bank's ``pdd_steps``."""


class PDDCosmosModel(DiffusersHeadBankModel, CosmosModel):
    """A :class:`CosmosModel` whose output projection is a head bank; the Cosmos family's
    :class:`~distillery.models.base.PDDModelBase`."""

    config_class = PDDCosmosModelConfig
