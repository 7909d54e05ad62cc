"""PDD: parallel decoding distillation of a many-step teacher into a block-parallel student.

Roles: ``student`` (trainable :class:`~distillery.models.base.PDDModelBase`, e.g. Wan's
:class:`~distillery.models.wan.pdd.PDDWanModel`: the teacher's network
with one output head per interval of a fine σ grid of ``P = pdd_steps`` intervals, ``σ_0 = 1 > … >
σ_P = 0``, the ``P``-step Euler grid of its shifted schedule) and ``teacher`` (frozen). The
student samples a block ``[n, n + L)`` in one forward at ``x_n`` (:mod:`distillery.sampling.pdd`):
``x_{n+L} = x_n + Σ_k Δ_k head_k(x_n)``, ``Δ_k = σ_{k+1} − σ_k``.

One micro-batch (step numbers start at 1). Each row of the batch (sample) has its own block start;
quantities per row are written with an index ``i``:

1. **Block starts and supervised heads.** Per row a block start ``n_i`` (a multiple of
   ``block_size_min``) and a head ``k_i``, uniform in ``n_i ≤ k_i < min(n_i + block_size_max, P)``.
   ``data_latent``: ``n_i`` uniform over those multiples, the row's data latent noised to ``σ_{n_i}``
   (``x_n = (1 − σ_n) x0 + σ_n ε``). ``simulate``: ``n_i`` is the rung of the row's carried trajectory
   (below). The uniforms are drawn for the *global* batch from the BatchRNG's generator, which every
   rank holds identically, so every rank knows every row's ``n`` and ``k``: the heads a forward
   projects with a gradient are the set ``K`` of the global batch's ``k`` (the same on every rank: under
   FSDP2 the set of parameters with a gradient, and the head bank's calls per forward, must agree), and
   a row's loss reads its own head from them. A head of ``K`` that none of this rank's rows supervises
   gets a zero gradient here and its real one from the ranks whose rows do (the all-reduce sums them),
   so 2 ranks train what 1 rank trains on the same global batch.
2. **Student.** One trunk forward at ``(x_n, t_n)`` (per-row timesteps). The heads of ``K`` keep their
   graph; the heads ``n_i … k_i − 1`` (and, in ``simulate``, the carried block's) are projected from the
   detached trunk states without gradients and advance each row: ``x̄_{k,i} = x_{n,i} + Σ_{j=n_i}^{k_i−1}
   Δ_j head_j``.
3. **Target** (no gradients; ``x̄_k`` is detached): the teacher's mean velocity over
   ``[σ_k, σ_{k+1}]`` at ``x̄_k``, per row — ``euler``: ``v_T(x̄_k, t_k)``; ``midpoint``: ``v_T(x̄_k +
   (σ_m − σ_k) v_T(x̄_k, t_k), t_m)`` with ``σ_m = (σ_k + σ_{k+1}) / 2`` (two teacher calls). ``v_T`` is
   guided, ``u + w (c − u)``, when ``teacher_guidance_scale`` w > 1 (the unconditional forward on the
   latent set's empty-prompt embedding; a set without one is refused), else the conditional teacher.
   w < 1 is refused at config time: every sampler here (and WanPipeline) reads w ≤ 1 as "no guidance",
   so a target guided with w = 0.5 would train toward something no sampler reproduces, and the same w
   is DM-PDD's real-score guidance; one rule — 1 is the conditional teacher, > 1 is CFG.
4. **Loss**: ``mean_i mean((head_{k_i} − target_i)²)``. Gradients reach the heads of ``K`` and the trunk
   only: the other heads get no ``.grad`` (and so no optimizer state until they are supervised), the
   frozen ``proj_out`` none, the teacher none.

**Carried trajectories** (``simulate``): one slot per gradient-accumulation call
(``training.loop.grad_accum_steps`` slots; call ``c`` uses slot ``c mod slots``) holds one on-policy
trajectory per row; each walks the finest partition (blocks of ``block_size_min``: ``R`` rungs, nodes
``0, b, 2b, …, P``) one rung per call of its slot. The rows are **staggered**: global row ``g`` of slot
``s`` (of ``G`` global rows) starts at rung ``o = (s·G + g) mod R`` and is at rung ``(o + u) mod R``
after its slot's ``u``-th call, so one optimizer step trains ``min(R, slots·G)`` distinct rungs rather
than one (without the stagger every row started together and a step trained a single rung, cycling
``0, 1, …, R − 1`` step by step). A slot's first call starts every row from fresh noise at ``σ_0 = 1``
with the incoming batch's prompts and walks them under ``no_grad`` to their offsets (``max o`` extra
student forwards, once per slot, the same count on every rank); after it, a row that finished its last
rung restarts from fresh noise with the incoming batch's prompt for that row, the others keep theirs
and ignore the batch's. Every call draws the batch noise (``prepare_batch``) whether or not a row
restarts, so the random stream advances the same way on every call. After the loss each row's block is
integrated with the same forward's heads (no grad) and carried to the slot's next call. The slots
(states, prompts, call counts) and the call count are this rank's host state in every checkpoint
(:meth:`host_state`), so a resumed run continues them bit for bit. Resumed on another world size (or
another slot count, or from a checkpoint of the earlier unstaggered walk), every rank drops them — a
rank's trajectory is its slice of the global batch, and the slices changed — and restarts from noise
at the next call with the call count at 0 on every rank (a rank the checkpoint has no state for
starts there too); one warning line says so. That restart is deterministic and the same on any world
size (the fresh noise and prompts come from the checkpointed generator, drawn for the global batch),
but it is not the uninterrupted run's continuation (docs/gpus.md).

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
from distillery.config.typed import bounded, check_fields
from distillery.methods.base import (
    StepOutput,
    TrainingMethod,
    check_second_scale,
    guided_by_scales,
    require_empty_prompt,
    teacher_scales,
)
from distillery.models.base import Conditioning, HeadGroup, ModelBase, PDDModelBase, batch_latent_shape
from distillery.sampling.base import cfg_enabled, guided_velocity
from distillery.sampling.pdd import PDDFusedSampler

log = get_logger("pdd")


@dataclass
class PDDConfig:
    block_size_min: int = bounded(1, 1, 1000)  # block starts are multiples of this; the carried trajectory's block width
    block_size_max: int = bounded(8, 1, 1000)  # widest block trained (and sampled): head k is supervised from starts k − this + 1 … k
    rollout: Literal["data_latent", "simulate"] = "data_latent"  # noised data at x_n, or carried on-policy trajectories
    integrator: Literal["euler", "midpoint"] = "euler"  # the teacher's target over one interval: 1 or 2 teacher calls
    teacher_guidance_scale: float = 1.0  # CFG w of the teacher's target velocity: 1 conditional only, > 1 u + w(c − u); < 1 refused
    teacher_guidance_scale_2: float | None = None  # a two-expert teacher's low-noise expert's w (t below its boundary); null: the same
    sampling_steps: int = bounded(4, 1, 1000)  # the NFE of the artifact's sampling contract (its default)
    validation_steps: list[int] = bounded(low=1, high=1000, default_factory=list)  # NFEs the student will be sampled at (checked now)

    def __post_init__(self) -> None:
        check_fields(self, "method")  # the declared ranges, for a config built in Python
        if self.block_size_max < self.block_size_min:
            raise ValueError(f"need 1 <= block_size_min <= block_size_max, got {self.block_size_min}, {self.block_size_max}")
        if self.rollout not in ("data_latent", "simulate"):
            raise ValueError(f"rollout must be data_latent or simulate, got {self.rollout!r}")
        if self.integrator not in ("euler", "midpoint"):
            raise ValueError(f"integrator must be euler or midpoint, got {self.integrator!r}")
        if not self.teacher_guidance_scale >= 1.0:  # module doc, step 3: one rule for the target and DM-PDD's real score
            raise ValueError(f"teacher_guidance_scale must be >= 1 (1: the conditional teacher; > 1: CFG u + w(c − u)), got "
                             f"{self.teacher_guidance_scale}; the samplers read w <= 1 as no guidance")
        if self.teacher_guidance_scale_2 is not None and not self.teacher_guidance_scale_2 >= 1.0:
            raise ValueError(f"teacher_guidance_scale_2 must be >= 1 (1: the conditional teacher), got "
                             f"{self.teacher_guidance_scale_2}")
        self.validation_steps = [int(n) for n in self.validation_steps]


@dataclass
class _Carry:
    """One slot's on-policy trajectories, one per row: their states and prompts, and the slot's calls so
    far (a row's rung follows from it and the row's stagger offset, module doc)."""

    state: torch.Tensor  # x of each row at its rung's node, float32 [B, C, T, H, W] (this rank's rows)
    uses: int  # calls of this slot since it was filled
    text_embeds: torch.Tensor  # [B, L, D]
    negative_text_embeds: torch.Tensor | None
    first_frame: torch.Tensor | None = None  # image-to-video: each row's first-frame condition, carried with its prompt
    image_embeds: torch.Tensor | None = None  # image-to-video: each row's image embeddings

    def cond(self) -> Conditioning:
        return Conditioning(self.text_embeds, self.negative_text_embeds, self.first_frame, self.image_embeds)


@dataclass
class Plan:
    """The block starts, heads and advance ends of one call for every row of the global batch (the same
    lists on every rank; module doc, step 1) and this rank's slice of them."""

    nodes: list[int]  # n_g: each global row's block start (a fine-grid node)
    heads: list[int]  # k_g: each global row's supervised head
    ends: list[int]  # the node each global row's state is carried to (simulate: the next rung's; else n_g)
    rungs: list[int] | None  # simulate: each global row's rung
    first: int  # this rank's first global row
    rows: int  # this rank's rows

    def local(self, values: list[int]) -> list[int]:
        return values[self.first:self.first + self.rows]

    @property
    def supervised(self) -> list[int]:
        """``K``: the heads trained this call (sorted, the same on every rank)."""
        return sorted(set(self.heads))

    @property
    def window(self) -> list[int]:
        """The heads the rows advance by (to ``k_g``, and to ``ends``), without gradients (every rank's)."""
        return list(range(min(self.nodes), max(max(k, e) for k, e in zip(self.heads, self.ends))))


@dataclass
class PDDStep:
    """What :meth:`PDDMethod.pdd_step` computed for one micro-batch."""

    loss: torch.Tensor  # the head regression, mean((head_k − target)²), with graph
    metrics: dict[str, torch.Tensor]  # pdd_block_start, pdd_head (and rollout_rung): means over the global batch
    extra: list[torch.Tensor]  # the extra head groups' outputs, float32 [B, m, C, T, H, W] each
    x_n: torch.Tensor  # the trunk's input at the block starts (before the carried slot advanced)
    nodes: list[int]  # this rank's rows' block starts (fine-grid nodes)
    cond: Any  # the conditioning of the forward


class PDDMethod(TrainingMethod):
    """Parallel decoding distillation (see the module doc)."""

    config_class = PDDConfig
    required_roles = ("student", "teacher")
    trainable_roles = ("student",)
    frozen_roles = ("teacher",)
    role_kinds = {"student": PDDModelBase}
    data_kind = "latents"

    @classmethod
    def reads_latents(cls, config: PDDConfig) -> bool:
        """Only ``data_latent`` noises the data's latents; ``simulate`` carries trajectories from noise of the batch's
        shape (it trains on a prompt-only set)."""
        return config.rollout == "data_latent"

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
        check_second_scale(self.teacher, "teacher", "teacher_guidance_scale_2", config.teacher_guidance_scale_2)
        if self.teacher.schedule != student.schedule:
            raise UserError(f"config error: models.teacher: its schedule {self.teacher.schedule} differs from the student's "
                            f"{student.schedule}; the fine grid is one for both")
        self.rung_nodes = list(range(0, p, config.block_size_min)) + [p]  # the carried (finest) partition
        self.num_slots = max(1, int(training.loop.grad_accum_steps))
        self.calls = 0  # single_train_step calls so far (the carried slot of a call: calls mod slots)
        self.slots: list[_Carry | None] = [None] * self.num_slots

    @property
    def num_rungs(self) -> int:
        """``R``: the rungs of the carried partition (the block starts ``data_latent`` draws from)."""
        return len(self.rung_nodes) - 1

    def sampling_contract(self) -> dict[str, Any]:
        schedule = self.student.schedule
        return {"sampler": "pdd_fused", **schedule.contract(),
                "pdd_steps": self.pdd_steps, "block_size_max": self.config.block_size_max,
                "num_steps": self.config.sampling_steps, "guidance_scale": 1.0}

    # -- draws ------------------------------------------------------------------------------
    def global_uniforms(self, rows: int) -> list[float]:
        """Uniforms in [0, 1) for every row of the global batch (``rows`` per rank): the draw
        ``self.rng.rand`` makes and slices, kept whole — the same list on every rank (one host sync)."""
        full = torch.rand((rows * self.rng.world_size,), generator=self.rng.generator, device=self.rng.device)
        return [float(u) for u in full.cpu().tolist()]

    def draw_heads(self, starts: list[int]) -> list[int]:
        """Each global row's supervised head ``k``: uniform in ``[n, min(n + block_size_max, P))`` for its start ``n``."""
        us = self.global_uniforms(len(starts) // self.rng.world_size)
        return [n + int(u * min(self.config.block_size_max, self.pdd_steps - n)) for n, u in zip(starts, us)]

    def stagger_offsets(self, slot: int, global_rows: int) -> list[int]:
        """Each global row's starting rung in ``slot`` (module doc): ``(slot · G + g) mod R``."""
        return [(slot * global_rows + g) % self.num_rungs for g in range(global_rows)]

    # -- the teacher's target ---------------------------------------------------------------
    def teacher_velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Any) -> torch.Tensor:
        """The (guided) teacher velocity at ``x`` and σ (a scalar or one per row, ``[B]``), float32, no gradients; of a
        two-expert teacher, each row guided by its expert's scale (``teacher_guidance_scale_2`` below the boundary)."""
        cfg = self.config
        if cfg_enabled(cfg.teacher_guidance_scale) or (cfg.teacher_guidance_scale_2 or 1.0) > 1.0:
            require_empty_prompt(cond, f"method.teacher_guidance_scale {cfg.teacher_guidance_scale}", self.training)
        t = (sigma * self.teacher.schedule.num_train_timesteps).expand(x.shape[0]).float()
        if cfg.teacher_guidance_scale_2 is None:
            return guided_velocity(self.teacher, x, t, cond, cfg.teacher_guidance_scale)
        return guided_by_scales(lambda conditional: self.teacher.predict_noise(x, t, cond, conditional=conditional),
                                teacher_scales(self.teacher, t, cfg.teacher_guidance_scale, cfg.teacher_guidance_scale_2))

    @torch.no_grad()
    def target_velocity(self, x_k: torch.Tensor, k: torch.Tensor, sigmas: torch.Tensor, cond: Any) -> torch.Tensor:
        """The teacher's mean velocity over ``[σ_k, σ_{k+1}]`` from ``x_k``, ``k`` one head per row
        (``[B]``, long, on ``sigmas``' device; module doc, step 3)."""
        sigma_k = sigmas[k]
        v = self.teacher_velocity(x_k, sigma_k, cond)
        if self.config.integrator == "euler":
            return v
        mid = 0.5 * (sigma_k + sigmas[k + 1])
        return self.teacher_velocity(x_k + _rows(mid - sigma_k, x_k) * v, mid, cond)

    # -- one micro-batch ----------------------------------------------------------------------
    def _inputs(self, batch: dict[str, Any]) -> tuple[torch.Tensor, list[int], list[int], list[int] | None, Any, int]:
        """``(x_n, global starts, global ends, global rungs or None, conditioning, carried slot or -1)`` of
        this call (module doc, step 1; the carried slot's restarting rows refilled)."""
        student = self.student
        sigmas = student.fine_sigmas(student.device)
        b = batch_latent_shape(batch)[0]
        first = self.rng.rank * b
        if self.config.rollout == "data_latent":
            starts = [self.rung_nodes[int(u * self.num_rungs)] for u in self.global_uniforms(b)]
            t = sigmas[torch.tensor(starts[first:first + b], device=sigmas.device)] * student.schedule.num_train_timesteps
            tb = student.prepare_batch(batch, self.rng, timesteps=t.float())
            return tb.noisy_latents, starts, starts, None, tb, -1
        slot = self.calls % self.num_slots
        rows = b * self.rng.world_size
        offsets = self.stagger_offsets(slot, rows)
        # fresh rows (σ_0 = 1: x = ε, the batch's prompts), drawn on every call
        tb = student.prepare_batch(batch, self.rng, timesteps=torch.full((b,), float(student.schedule.num_train_timesteps)))
        carry = self.slots[slot]
        if carry is None:
            carry = _Carry(tb.noise.float(), 0, tb.text_embeds, tb.negative_text_embeds, tb.first_frame, tb.image_embeds)
            carry.state = self._walk_to_offsets(carry, offsets[first:first + b], max(offsets))
        else:
            fresh = torch.tensor([(o + carry.uses) % self.num_rungs == 0 for o in offsets[first:first + b]],
                                 device=carry.state.device)
            carry.state = torch.where(_rows(fresh, carry.state), tb.noise.float(), carry.state)
            carry.text_embeds = torch.where(fresh[:, None, None], tb.text_embeds, carry.text_embeds)
            if carry.negative_text_embeds is not None and tb.negative_text_embeds is not None:
                carry.negative_text_embeds = torch.where(fresh[:, None, None], tb.negative_text_embeds,
                                                         carry.negative_text_embeds)
            for name in ("first_frame", "image_embeds"):  # image-to-video: a fresh row takes its new clip's frame
                new, old = getattr(tb, name), getattr(carry, name)
                if new is not None and old is not None:
                    setattr(carry, name, torch.where(_rows(fresh, old), new, old))
        self.slots[slot] = carry
        rungs = [(o + carry.uses) % self.num_rungs for o in offsets]
        starts = [self.rung_nodes[r] for r in rungs]
        ends = [self.rung_nodes[r + 1] for r in rungs]
        return carry.state, starts, ends, rungs, carry.cond(), slot

    @torch.no_grad()
    def _walk_to_offsets(self, carry: _Carry, offsets: list[int], steps: int) -> torch.Tensor:
        """The rows of a freshly filled slot walked from noise to their stagger offsets: ``steps`` (the
        global batch's largest offset, so the same on every rank) student forwards, each advancing one
        rung of the carried partition; a row stops at its own offset."""
        student = self.student
        sigmas = student.fine_sigmas(student.device)
        x = carry.state
        stop = torch.tensor(offsets, device=x.device)
        for r in range(steps):
            a, z = self.rung_nodes[r], self.rung_nodes[r + 1]
            t = (sigmas[a] * student.schedule.num_train_timesteps).expand(x.shape[0]).float()
            heads = student.predict_head_groups(x, t, carry.cond(), [HeadGroup(list(range(a, z)), detached=True)])[0]
            step = x.float()
            for j in range(a, z):
                step = step + (sigmas[j + 1] - sigmas[j]) * heads[:, j - a]
            x = torch.where(_rows(stop > r, x), step, x)
        return x

    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        del step
        step_ = self.pdd_step(batch)
        return StepOutput(losses={"total_loss": step_.loss, "pdd_loss": step_.loss.detach()}, metrics=step_.metrics)

    def pdd_step(self, batch: dict[str, Any], extra: Callable[[Plan], list[HeadGroup]] | None = None) -> "PDDStep":
        """Steps 1–4 of the module doc for one micro-batch (the carried slot advanced); its one trunk
        forward also projects the head groups ``extra(plan)`` gives for this call's :class:`Plan`
        (DM-PDD's x̂0); returns the loss, metrics and those groups' outputs."""
        student: PDDModelBase = self.student
        sigmas = student.fine_sigmas(student.device)
        x_n, starts, ends, rungs, cond, slot = self._inputs(batch)
        self.calls += 1
        b = x_n.shape[0]
        plan = Plan(starts, self.draw_heads(starts), ends, rungs, self.rng.rank * b, b)
        device = x_n.device
        n = torch.tensor(plan.local(plan.nodes), device=device)
        k = torch.tensor(plan.local(plan.heads), device=device)
        t_n = (sigmas[n] * student.schedule.num_train_timesteps).float()
        supervised, window = plan.supervised, plan.window
        groups = [HeadGroup(supervised)] + ([HeadGroup(window, detached=True)] if window else [])
        added = extra(plan) if extra is not None else []
        outs = student.predict_head_groups(x_n, t_n, cond, groups + added)  # one trunk forward
        column = torch.tensor([supervised.index(h) for h in plan.local(plan.heads)], device=device)
        head_k = outs[0][torch.arange(b, device=device), column]  # each row's head k_i, with graph (heads K and the trunk)
        heads = outs[1] if window else None  # [B, m, C, T, H, W], no graph
        deltas = sigmas[1:] - sigmas[:-1]

        def advance(to: torch.Tensor) -> torch.Tensor:
            """Each row from x_n by its heads n_i … to_i − 1 (no grad)."""
            x = x_n.float()
            if heads is None:
                return x
            j = torch.arange(window[0], window[-1] + 1, device=device)
            coeffs = torch.where((j >= n[:, None]) & (j < to[:, None]), deltas[j], torch.zeros((), device=device))
            return x + (coeffs.view(*coeffs.shape, *[1] * (x.ndim - 1)) * heads).sum(1)

        with torch.no_grad():
            x_k = advance(k)
            target = self.target_velocity(x_k, k, sigmas, cond)
        loss = F.mse_loss(head_k, target)
        metrics = {"pdd_block_start": torch.tensor(_mean(plan.nodes)), "pdd_head": torch.tensor(_mean(plan.heads))}
        if slot >= 0:
            carry = self.slots[slot]
            with torch.no_grad():
                carry.state = advance(torch.tensor(plan.local(plan.ends), device=device))
            carry.uses += 1
            metrics["rollout_rung"] = torch.tensor(_mean(plan.rungs))
        return PDDStep(loss, metrics, outs[len(groups):], x_n, plan.local(plan.nodes), cond)

    # -- per-rank host state: the carried trajectories ----------------------------------------
    def host_state(self) -> dict[str, Any] | None:
        """This rank's carried trajectories and call count (``simulate``), or None (``data_latent``)."""
        if self.config.rollout != "simulate":
            return None
        slots = [None if c is None else {"state": c.state, "uses": c.uses, "text_embeds": c.text_embeds,
                                         "negative_text_embeds": c.negative_text_embeds,
                                         **({"first_frame": c.first_frame} if c.first_frame is not None else {}),
                                         **({"image_embeds": c.image_embeds} if c.image_embeds is not None else {})}
                 for c in self.slots]
        return {"calls": self.calls, "slots": slots, "world_size": int(self.rng.world_size)}

    def load_host_state(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`host_state`; None (no state for this rank), another slot count, another world
        size or the unstaggered walk's state (no ``uses``): every trajectory restarts from noise with the
        call count at 0 (module doc)."""
        if self.config.rollout != "simulate" or not state:
            self.calls, self.slots = 0, [None] * self.num_slots
            return
        slots, saved_world = state["slots"], int(state.get("world_size", -1))
        earlier = any(s is not None and "uses" not in s for s in slots)
        if len(slots) != self.num_slots or saved_world != int(self.rng.world_size) or earlier:
            if self.rank == 0:
                made = "the unstaggered walk of an earlier version" if earlier else f"{len(slots)} slot(s)"
                log.warning("pdd: the checkpoint's carried trajectories were made by %d rank(s) with %s, this run "
                            "has %d rank(s) and %d slot(s): every trajectory restarts from noise at the next call (the same "
                            "on any world size; not the uninterrupted run's continuation)", saved_world, made,
                            int(self.rng.world_size), self.num_slots)
            self.calls, self.slots = 0, [None] * self.num_slots
            return
        self.calls = int(state["calls"])
        device = self.student.device

        def on(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        self.slots = [None if s is None else _Carry(on(s["state"]), int(s["uses"]), on(s["text_embeds"]),
                                                    on(s["negative_text_embeds"]), on(s.get("first_frame")),
                                                    on(s.get("image_embeds"))) for s in slots]


def _rows(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row ``[B]`` tensor shaped to broadcast over ``like`` ``[B, ...]``."""
    return values.view(-1, *[1] * (like.ndim - 1))


def _mean(values: list[int] | None) -> float:
    return float(sum(values) / len(values)) if values else 0.0
