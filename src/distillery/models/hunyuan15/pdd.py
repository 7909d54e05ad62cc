"""PDD HunyuanVideo 1.5: the trunk with a bank of per-interval output heads —
:class:`~distillery.models.wan.pdd.HeadBankModel` (the head bank, its forwards, the fused projection: written once for
every family) over :class:`HunyuanVideo15Model`'s inputs. Its ``proj_out`` has a bias, so the heads have one.

The bank lays each head's output out per token as ``(patch, channels)``; HunyuanVideo 1.5 unpatchifies channels first
— the same for its released patch size of 1 (every folder of the family), so another patch size is one line."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distillery.common.errors import UserError
from distillery.config.typed import bounded, check_fields
from distillery.models.base import Conditioning, TrainingBatch
from distillery.models.hunyuan15.bidirectional import HunyuanVideo15Model
from distillery.models.hunyuan15.common import HunyuanVideo15ModelConfig
from distillery.models.wan.pdd import HeadBankModel


@dataclass
class PDDHunyuanVideo15ModelConfig(HunyuanVideo15ModelConfig):
    pdd_steps: int = bounded(8, 1, 1000)  # fine-grid intervals = heads of the bank

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, "model")  # pdd_steps' declared range, for a config built in Python


class PDDHunyuanVideo15Model(HeadBankModel, HunyuanVideo15Model):
    """A :class:`HunyuanVideo15Model` whose output projection is a head bank; the family's
    :class:`~distillery.models.base.PDDModelBase`."""

    config_class = PDDHunyuanVideo15ModelConfig

    def __init__(self, config: PDDHunyuanVideo15ModelConfig, role: str, transformer: torch.nn.Module | None = None) -> None:
        HunyuanVideo15Model.__init__(self, config, role, transformer)
        if self.patch_size != (1, 1, 1):
            raise UserError(f"models.{role}: a PDD HunyuanVideo 1.5 student needs patch size 1 (the released models'); "
                            f"{self.transformer_dir} has {self.patch_size}, whose channels-first unpatchify the head bank "
                            "does not lay out")
        self.attach_head_bank(config, role)

    def trunk_output(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                     conditional: bool) -> torch.Tensor:
        return self.forward_module(**self.transformer_inputs(noisy_latents, timesteps, batch, conditional))[0]
