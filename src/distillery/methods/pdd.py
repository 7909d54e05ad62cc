"""PDD: parallel decoding distillation of a many-step teacher into a block-parallel student.

Roles: ``student`` (trainable :class:`~distillery.models.base.PDDModelBase`, e.g. Wan's
:class:`~distillery.models.wan.pdd.PDDWanModel`: the teacher's network
with one output head per interval of a fine σ grid of ``P = pdd_steps`` intervals, ``σ_0 = 1 > … >
σ_P = 0``, the ``P``-step Euler grid of its shifted schedule) and ``teacher`` (frozen). The
student samples a block ``[n, n + L)`` in one forward at ``x_n`` (:mod:`distillery.sampling.pdd`):
``x_{n+L} = x_n + Σ_k Δ_k head_k(x_n)``, ``Δ_k = σ_{k+1} − σ_k``.

One micro-batch (step numbers start at 1):

1. **Block start and supervised head.** A block start ``n`` and a head ``k`` with
   ``n ≤ k < min(n + block_size_max, P)``; ``n`` is a multiple of ``block_size_min``.
   ``data_latent``: ``n`` uniform over those multiples; the data latents noised to ``σ_n``
   (``x_n = (1 − σ_n) x0 + σ_n ε``). ``simulate``: ``n`` is the rung of a carried trajectory (below).
   ``n`` and ``k`` are one draw per micro-batch from the BatchRNG's generator, identical on every
   rank (so every rank supervises the same head: under FSDP2 the set of parameters with a gradient
   must agree; a per-sample draw would not).
2. **Student.** One trunk forward at ``(x_n, t_n)``. Head ``k``'s velocity keeps its graph; heads
   ``n … k − 1`` (and, in ``simulate``, the carried block's heads) are projected from the detached
   trunk states without gradients and advance ``x_n`` to ``x̄_k = x_n + Σ_{j=n}^{k−1} Δ_j head_j``.
3. **Target** (no gradients; ``x̄_k`` is detached): the teacher's mean velocity over
   ``[σ_k, σ_{k+1}]`` at ``x̄_k`` — ``euler``: ``v_T(x̄_k, t_k)``; ``midpoint``: ``v_T(x̄_k + (σ_m − σ_k)
   v_T(x̄_k, t_k), t_m)`` with ``σ_m = (σ_k + σ_{k+1}) / 2`` (two teacher calls). ``v_T`` is guided,
   ``u + w (c − u)``, when ``teacher_guidance_scale`` w > 1 (the unconditional forward on the
   negative / empty-prompt embeddings), else conditional only.
4. **Loss**: ``mean((head_k − target)²)``. Gradients reach head ``k`` and the trunk only: the other
   heads get no ``.grad`` (and so no optimizer state until they are supervised), the frozen
   ``proj_out`` none, the teacher none.

**Carried trajectories** (``simulate``): one on-policy trajectory per gradient-accumulation slot
(``training.loop.grad_accum_steps`` slots; call ``c`` uses slot ``c mod slots``) walks the finest
partition (blocks of ``block_size_min``: nodes ``0, b, 2b, …, P``) one rung per call. An empty slot
starts from fresh noise at ``σ_0 = 1`` with the incoming batch's prompt; a carried slot keeps its
prompt and ignores the batch's. After the loss, the rung's block is integrated with the same
forward's heads (no grad) and carried to the next call; the last rung releases the slot. The
slots (states, prompts, rungs) and the call count are this rank's host state in every checkpoint
(:meth:`host_state`), so a resumed run continues them bit for bit. Resumed on another world size
(or another slot count), every rank drops them — a rank's trajectory is its slice of the global
batch, and the slices changed — and restarts from noise at the next call with the call count at 0
on every rank (a rank the checkpoint has no state for starts there too); one warning line says so.
That restart is deterministic and the same on any world size (the fresh noise and prompts come from
the checkpointed generator, drawn for the global batch), but it is not the uninterrupted run's
continuation (docs/gpus.md).

Validation at load time (:class:`UserError`): ``block_size_min ≤ block_size_max ≤ P``; the contract's
``sampling_steps`` and every ``validation_steps`` NFE partition the grid into blocks no wider than
``block_size_max`` (:func:`~distillery.models.schedule.block_partition`); teacher and student share
their schedule. The artifact's contract is ``pdd_fused`` over the grid at ``sampling_steps`` NFE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.config.typed import bounded
from distillery.methods.base import StepOutput, TrainingMethod
from distillery.models.base import Conditioning, HeadGroup, ModelBase, PDDModelBase
from distillery.sampling.base import guided_velocity
from distillery.sampling.pdd import PDDFusedSampler

log = get_logger("pdd")


@dataclass
class PDDConfig:
    block_size_min: int = bounded(1, 1, 1000)  # block starts are multiples of this; the carried trajectory's block width
    block_size_max: int = bounded(8, 1, 1000)  # widest block trained (and sampled): head k is supervised from starts k − this + 1 … k
    rollout: Literal["data_latent", "simulate"] = "data_latent"  # noised data at x_n, or carried on-policy trajectories
    integrator: Literal["euler", "midpoint"] = "euler"  # the teacher's target over one interval: 1 or 2 teacher calls
    teacher_guidance_scale: float = 1.0  # CFG w of the teacher's target velocity (> 1: an unconditional forward too)
    sampling_steps: int = bounded(4, 1, 1000)  # the NFE of the artifact's sampling contract (its default)
    validation_steps: list[int] = bounded(low=1, high=1000, default_factory=list)  # NFEs the student will be sampled at (checked now)

    def __post_init__(self) -> None:
        if self.block_size_min < 1 or self.block_size_max < self.block_size_min:
            raise ValueError(f"need 1 <= block_size_min <= block_size_max, got {self.block_size_min}, {self.block_size_max}")
        if self.rollout not in ("data_latent", "simulate"):
            raise ValueError(f"rollout must be data_latent or simulate, got {self.rollout!r}")
        if self.integrator not in ("euler", "midpoint"):
            raise ValueError(f"integrator must be euler or midpoint, got {self.integrator!r}")
        if not self.teacher_guidance_scale > 0:
            raise ValueError("teacher_guidance_scale must be > 0")
        if self.sampling_steps < 1:
            raise ValueError("sampling_steps must be >= 1")
        self.validation_steps = [int(n) for n in self.validation_steps]


@dataclass
class _Carry:
    """One slot's on-policy trajectory: its state at fine-grid node ``nodes[rung]`` and its prompt."""

    state: torch.Tensor  # x at the rung's node, float32 [B, C, T, H, W] (this rank's samples)
    rung: int
    text_embeds: torch.Tensor  # [B, L, D]
    negative_text_embeds: torch.Tensor | None

    def cond(self) -> Conditioning:
        return Conditioning(self.text_embeds, self.negative_text_embeds)


@dataclass
class PDDStep:
    """What :meth:`PDDMethod.pdd_step` computed for one micro-batch."""

    loss: torch.Tensor  # the head regression, mean((head_k − target)²), with graph
    metrics: dict[str, torch.Tensor]  # pdd_block_start, pdd_head (and rollout_rung)
    extra: list[torch.Tensor]  # the extra head groups' outputs, float32 [B, m, C, T, H, W] each
    x_n: torch.Tensor  # the trunk's input at the block start (before the carried slot advanced)
    n: int  # the block start (a fine-grid node)
    cond: Any  # the conditioning of the forward


class PDDMethod(TrainingMethod):
    """Parallel decoding distillation (see the module doc)."""

    config_class = PDDConfig
    required_roles = ("student", "teacher")
    trainable_roles = ("student",)
    frozen_roles = ("teacher",)
    role_kinds = {"student": PDDModelBase}
    data_kind = "latents"

    def __init__(self, config: PDDConfig, role_models: dict[str, ModelBase], training: Any, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(config, role_models, training, rank, **kwargs)
        self.teacher = role_models["teacher"]
        student: PDDModelBase = self.student
        self.pdd_steps = int(student.pdd_steps)
        p = self.pdd_steps
        if config.block_size_max > p:
            raise UserError(f"config error: method.block_size_max: {config.block_size_max} exceeds the student's "
                            f"pdd_steps={p} (models.student.pdd_steps)")
        # every NFE the student will be sampled at: the sampler's own partition rule (the one sampling applies)
        contract = self.sampling_contract()
        sampler = PDDFusedSampler({k: v for k, v in contract.items() if k != "num_steps"})
        for key, steps in [("sampling_steps", [config.sampling_steps]), ("validation_steps", config.validation_steps)]:
            for n in steps:
                try:
                    sampler.partition(n)
                except UserError as exc:
                    raise UserError(f"config error: method.{key}: {n}: {exc}") from None
        if self.teacher.schedule != student.schedule:
            raise UserError(f"config error: models.teacher: its schedule {self.teacher.schedule} differs from the student's "
                            f"{student.schedule}; the fine grid is one for both")
        self.rung_nodes = list(range(0, p, config.block_size_min)) + [p]  # the carried (finest) partition
        self.num_slots = max(1, int(training.loop.grad_accum_steps))
        self.calls = 0  # single_train_step calls so far (the carried slot of a call: calls mod slots)
        self.slots: list[_Carry | None] = [None] * self.num_slots

    def sampling_contract(self) -> dict[str, Any]:
        schedule = self.student.schedule
        return {"sampler": "pdd_fused", "shift": schedule.shift, "num_train_timesteps": schedule.num_train_timesteps,
                "pdd_steps": self.pdd_steps, "block_size_max": self.config.block_size_max,
                "num_steps": self.config.sampling_steps, "guidance_scale": 1.0}

    # -- draws ------------------------------------------------------------------------------
    def draw_head(self, start: int) -> int:
        """The supervised head ``k`` for block start ``start``: uniform in ``[start, min(start + block_size_max, P))``."""
        return start + self.rng.shared_randint(min(self.config.block_size_max, self.pdd_steps - start))

    # -- the teacher's target ---------------------------------------------------------------
    def teacher_velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Any) -> torch.Tensor:
        """The (guided) teacher velocity at ``x`` and scalar σ (float32, no gradients)."""
        t = (sigma * self.teacher.schedule.num_train_timesteps).expand(x.shape[0]).float()
        return guided_velocity(self.teacher, x, t, cond, self.config.teacher_guidance_scale)

    @torch.no_grad()
    def target_velocity(self, x_k: torch.Tensor, k: int, sigmas: torch.Tensor, cond: Any) -> torch.Tensor:
        """The teacher's mean velocity over ``[σ_k, σ_{k+1}]`` from ``x_k`` (module doc, step 3)."""
        v = self.teacher_velocity(x_k, sigmas[k], cond)
        if self.config.integrator == "euler":
            return v
        mid = 0.5 * (sigmas[k] + sigmas[k + 1])
        return self.teacher_velocity(x_k + (mid - sigmas[k]) * v, mid, cond)

    # -- one micro-batch ----------------------------------------------------------------------
    def _inputs(self, batch: dict[str, Any]) -> tuple[torch.Tensor, int, Any, _Carry | None, int]:
        """``(x_n, n, conditioning, carried slot or None, slot index)`` of this call (module doc, step 1)."""
        student = self.student
        sigmas = student.fine_sigmas(student.device)
        b = batch["latents"].shape[0]
        if self.config.rollout == "data_latent":
            n = self.config.block_size_min * self.rng.shared_randint(len(self.rung_nodes) - 1)
            t = (sigmas[n] * student.schedule.num_train_timesteps).expand(b).float()
            tb = student.prepare_batch(batch, self.rng, timesteps=t)
            return tb.noisy_latents, n, tb, None, -1
        slot = self.calls % self.num_slots
        carry = self.slots[slot]
        if carry is None:
            tb = student.prepare_batch(batch, self.rng, timesteps=torch.full((b,), float(student.schedule.num_train_timesteps)))
            carry = _Carry(tb.noise.float(), 0, tb.text_embeds, tb.negative_text_embeds)  # σ_0 = 1: x = ε
        return carry.state, self.rung_nodes[carry.rung], carry.cond(), carry, slot

    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        del step
        step_ = self.pdd_step(batch)
        return StepOutput(losses={"total_loss": step_.loss, "pdd_loss": step_.loss.detach()}, metrics=step_.metrics)

    def pdd_step(self, batch: dict[str, Any], extra: Callable[[int], list[HeadGroup]] | None = None) -> "PDDStep":
        """Steps 1–4 of the module doc for one micro-batch (the carried slot advanced); its one trunk
        forward also projects the head groups ``extra(n)`` gives for the block start ``n`` (DM-PDD's
        x̂0); returns the loss, metrics and those groups' outputs."""
        student: PDDModelBase = self.student
        sigmas = student.fine_sigmas(student.device)
        x_n, n, cond, carry, slot = self._inputs(batch)
        self.calls += 1
        k = self.draw_head(n)
        t_n = (sigmas[n] * student.schedule.num_train_timesteps).expand(x_n.shape[0]).float()
        next_node = self.rung_nodes[carry.rung + 1] if carry is not None else n
        window = list(range(n, max(k, next_node)))  # the heads that advance x_n (to x̄_k, and the carried block)
        groups = [HeadGroup([k])] + ([HeadGroup(window, detached=True)] if window else [])
        added = extra(n) if extra is not None else []
        outs = student.predict_head_groups(x_n, t_n, cond, groups + added)  # one trunk forward
        head_k = outs[0][:, 0]  # keeps its graph: head k and the trunk
        heads = outs[1] if window else None  # [B, m, C, T, H, W], no graph
        with torch.no_grad():

            def advance(to: int) -> torch.Tensor:
                x = x_n.float()
                for j in range(n, to):
                    x = x + (sigmas[j + 1] - sigmas[j]) * heads[:, j - n]
                return x

            x_k = advance(k)
            target = self.target_velocity(x_k, k, sigmas, cond)
        loss = F.mse_loss(head_k, target)
        metrics = {"pdd_block_start": torch.tensor(float(n)), "pdd_head": torch.tensor(float(k))}
        x_start = x_n
        if carry is not None:
            with torch.no_grad():
                carry.state = advance(next_node)
            metrics["rollout_rung"] = torch.tensor(float(carry.rung))
            carry.rung += 1
            self.slots[slot] = carry if carry.rung < len(self.rung_nodes) - 1 else None
        return PDDStep(loss, metrics, outs[len(groups):], x_start, n, cond)

    # -- per-rank host state: the carried trajectories ----------------------------------------
    def host_state(self) -> dict[str, Any] | None:
        """This rank's carried trajectories and call count (``simulate``), or None (``data_latent``)."""
        if self.config.rollout != "simulate":
            return None
        slots = [None if c is None else {"state": c.state, "rung": c.rung, "text_embeds": c.text_embeds,
                                         "negative_text_embeds": c.negative_text_embeds} for c in self.slots]
        return {"calls": self.calls, "slots": slots, "world_size": int(self.rng.world_size)}

    def load_host_state(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`host_state`; None (no state for this rank), another slot count or another
        world size: every trajectory restarts from noise with the call count at 0 (module doc)."""
        if self.config.rollout != "simulate" or not state:
            self.calls, self.slots = 0, [None] * self.num_slots
            return
        slots, saved_world = state["slots"], int(state.get("world_size", -1))
        if len(slots) != self.num_slots or saved_world != int(self.rng.world_size):
            if self.rank == 0:
                log.warning("pdd: the checkpoint's carried trajectories were made by %d rank(s) with %d slot(s), this run "
                            "has %d rank(s) and %d slot(s): every trajectory restarts from noise at the next call (the same "
                            "on any world size; not the uninterrupted run's continuation)", saved_world, len(slots),
                            int(self.rng.world_size), self.num_slots)
            self.calls, self.slots = 0, [None] * self.num_slots
            return
        self.calls = int(state["calls"])
        device = self.student.device

        def on(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        self.slots = [None if s is None else _Carry(on(s["state"]), int(s["rung"]), on(s["text_embeds"]),
                                                    on(s["negative_text_embeds"])) for s in slots]
