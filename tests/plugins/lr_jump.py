"""A collapse injected on purpose: DMD2 whose student's learning rate is multiplied after a given step.

``LRJumpDMD2`` is DMD2 with two more knobs: after optimizer step ``jump_step`` the student's schedule (its base rates
and the rate it set) is multiplied by ``jump_factor`` (e.g. ×100): the run trains normally, then the generator's
updates blow up — the collapse tests/test_collapse.py must catch.
"""

from __future__ import annotations

from dataclasses import dataclass

from distillery.methods.dmd2 import DMD2Config, DMD2Method


@dataclass
class LRJumpConfig(DMD2Config):
    jump_step: int = 10  # after this optimizer step ...
    jump_factor: float = 100.0  # ... the student's learning rate is multiplied by this


class LRJumpDMD2(DMD2Method):
    config_class = LRJumpConfig

    def optimizers_step(self, step: int) -> None:
        super().optimizers_step(step)
        if step == self.config.jump_step:
            scheduler = self.lr_schedulers["student"]
            scheduler.base_lrs = [lr * self.config.jump_factor for lr in scheduler.base_lrs]
            for group in self.optimizers["student"].param_groups:
                group["lr"] = group["lr"] * self.config.jump_factor
