"""PDD HunyuanVideo 1.5: the trunk with a bank of per-interval output heads —
:class:`~distillery.models.diffusers_family.DiffusersHeadBankModel` (the head bank, its forwards, the fused projection: written once for
every family) over :class:`HunyuanVideo15Model`'s inputs. Its ``proj_out`` has a bias, so the heads have one.

The bank lays each head's output out per token as ``(patch, channels)``; HunyuanVideo 1.5 unpatchifies channels first
— the same for its released patch size of 1 (every folder of the family), so another patch size is one line."""

from __future__ import annotations

from dataclasses import dataclass

from distillery.models.diffusers_family import DiffusersHeadBankModel, PDDStepsConfig
from distillery.models.hunyuan15.bidirectional import HunyuanVideo15Model
from distillery.models.hunyuan15.common import HunyuanVideo15ModelConfig


@dataclass
class PDDHunyuanVideo15ModelConfig(PDDStepsConfig, HunyuanVideo15ModelConfig):
    """A :class:`HunyuanVideo15ModelConfig` with the bank's ``pdd_steps``."""


class PDDHunyuanVideo15Model(DiffusersHeadBankModel, HunyuanVideo15Model):
    """A :class:`HunyuanVideo15Model` whose output projection is a head bank; the family's
    :class:`~distillery.models.base.PDDModelBase`."""

    config_class = PDDHunyuanVideo15ModelConfig

    def head_layout_problem(self) -> str | None:
        if self.patch_size != (1, 1, 1):
            return (f"a PDD HunyuanVideo 1.5 student needs patch size 1 (the released models'); {self.transformer_dir} "
                    f"has {self.patch_size}, whose channels-first unpatchify the head bank does not lay out")
        return None
