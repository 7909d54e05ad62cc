"""``pdd_fused`` — parallel decoding: one forward per block of a fine σ grid, through a fused head.

A PDD student (a :class:`~distillery.models.base.PDDModelBase`, e.g. Wan's
:class:`~distillery.models.wan.pdd.PDDWanModel`) has one velocity head per interval
of a fine grid of ``pdd_steps`` intervals (``σ_0 = 1 > … > σ_P = 0``, the ``P``-step Euler grid of
its shifted schedule). ``num_steps`` = N blocks split the grid evenly
(:func:`~distillery.models.schedule.block_partition`: nodes ``⌊i·P/N⌋``); each block ``[a, b)``
advances in one forward at its start::

    x_b = x_a + Σ_{k=a}^{b−1} (σ_{k+1} − σ_k) · head_k(x_a, t_a) = x_a + (σ_b − σ_a) · fused_{a,b}(x_a, t_a)

with the block's heads fused into one projection (linear heads: no extra cost). NFE per video =
N (× 2 with CFG; a PDD student is trained on guided teacher targets, so its contract has no CFG).
A block wider than the ``block_size_max`` the student was trained with is refused (its far heads
were never supervised from that start). With N = P and every head equal to the base projection
this is the ``euler`` sampler at P steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from distillery.common.errors import UserError
from distillery.models.schedule import block_partition, widest_block
from distillery.sampling.base import LatentShape, Sampler, check_inputs, conditioning_on, guide
from distillery.sampling.noise import NoiseLike, as_noise_source
from distillery.sampling.registry import register_sampler

if TYPE_CHECKING:
    from distillery.models.base import Conditioning, ModelBase


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"sampler pdd_fused: {key} must be an integer >= 1, got {value!r}")
    return value


@register_sampler("pdd_fused")
class PDDFusedSampler(Sampler):
    """Contract: ``{"sampler": "pdd_fused", "shift", "num_train_timesteps", "pdd_steps"[, "block_size_max",
    "num_steps", "guidance_scale"]}`` (``block_size_max`` default: ``pdd_steps``). Runs without gradients."""

    option_keys = ("pdd_steps", "block_size_max")
    default_num_steps = 4

    def configure(self, options: dict[str, Any]) -> None:
        if options.get("pdd_steps") is None:
            raise UserError("sampler pdd_fused: the contract must name pdd_steps (the student's fine-grid intervals)")
        self.pdd_steps = _positive_int(options["pdd_steps"], "pdd_steps")
        self.block_size_max = _positive_int(options.get("block_size_max", self.pdd_steps), "block_size_max")
        if self.num_steps is not None:
            self.partition(self.num_steps)

    def model_options(self) -> dict[str, Any]:
        return {"pdd_steps": self.pdd_steps}

    def partition(self, num_steps: int) -> list[int]:
        """Fine-grid node indices ``[num_steps + 1]`` of the blocks a ``num_steps``-NFE call advances by
        (:class:`UserError` when the grid cannot be split so, or a block is wider than trained)."""
        if not 1 <= num_steps <= self.pdd_steps:
            raise UserError(f"sampler pdd_fused: {num_steps} steps cannot split the {self.pdd_steps}-interval grid "
                            f"(1 … {self.pdd_steps})")
        nodes = block_partition(self.pdd_steps, num_steps)
        if widest_block(nodes) > self.block_size_max:
            raise UserError(f"sampler pdd_fused: {num_steps} steps need a {widest_block(nodes)}-interval block of the "
                            f"{self.pdd_steps}-interval grid; the student was trained on blocks of at most "
                            f"{self.block_size_max} (pdd.block_size_max)")
        return nodes

    def resolve_steps(self, num_steps: int | None) -> int:
        steps = super().resolve_steps(num_steps)
        self.partition(steps)
        return steps

    @torch.no_grad()
    def sample(
        self,
        model: "ModelBase",
        cond: "Conditioning",
        latent_shape: LatentShape,
        noise: NoiseLike,
        *,
        num_steps: int | None = None,
        guidance_scale: float | None = None,
        initial: torch.Tensor | None = None,
        guidance_scale_2: float | None = None,
    ) -> torch.Tensor:
        batch = check_inputs(cond, latent_shape, initial)
        from distillery.models.base import PDDModelBase

        if not isinstance(model, PDDModelBase):
            raise UserError(f"sampler pdd_fused needs a PDD model (a head bank); {type(model).__name__} is not one")
        if int(model.pdd_steps) != self.pdd_steps:
            raise UserError(f"sampler pdd_fused: the contract's pdd_steps {self.pdd_steps} differs from the model's "
                            f"{model.pdd_steps}")
        steps, guidance = self.resolve_steps(num_steps), self.expert_guidance(model, guidance_scale, guidance_scale_2)
        nodes = self.partition(steps)
        device = model.device
        schedule = self.schedule_for(model)
        sigmas = schedule.inference_sigmas(self.pdd_steps).to(device)  # the fine grid [P + 1], 1 → 0
        source = as_noise_source(noise)
        x = initial.to(device, torch.float32) if initial is not None else source.randn((batch, *latent_shape), device)
        cond = conditioning_on(cond, device)
        for a, b in zip(nodes, nodes[1:]):
            t = (sigmas[a] * schedule.num_train_timesteps).expand(batch)
            v = guide(lambda conditional: model.predict_pdd_fused(x, t, cond, a, b, conditional=conditional), guidance.scale,
                      guidance.scale_at(float(t[0])))
            x = x + (sigmas[b] - sigmas[a]) * v
        return x
