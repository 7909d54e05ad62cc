"""Training-method interface: losses, roles, per-role optimizers, backward routing, checkpoint state.

A method receives its role models (``{"student": ..., "teacher": ..., "critic": ...}``) already
built and owns nothing it did not get: teachers and critics come in through ``role_models``. The
trainer calls, per optimizer step::

    for each micro-batch:  out = method.single_train_step(batch, step); method.backward(out, rounds)
    callbacks.on_before_optimizer_step; method.optimizers_step(step); method.zero_grad(step)

and refreshes (compute copies) and averages (EMA) only the roles ``roles_to_step(step)`` names. The micro-batches
are the method's :meth:`TrainingMethod.plan_step`: by default ``training.loop.grad_accum_steps`` calls of
``single_train_step``, each on the next batch. A method whose optimizer cadence is its own (an outer loop of
rollouts, then several updates on them: DiffusionNFT) plans each optimizer step itself — how many forwards it
accumulates, which batches (if any) it draws, what it samples first — while the trainer still runs every update:
the backwards, grad clipping and the other callbacks, the non-finite check, the optimizer step, EMA,
checkpoints and logging (the seam FastVideo calls ``manages_optimization``; there the method also steps its own
optimizers, clips and averages, so callbacks and checkpoints do not see inside its outer step).

Class-level declarations (checked from the config, before any weights load): ``required_roles``,
``optional_roles``, ``trainable_roles`` / ``frozen_roles``, ``role_kinds`` (role → the model base
class it must be, e.g. ``{"student": CausalModelBase}``) and ``data_kind`` (``latents``: collated
latent batches; ``prompts``: prompt embeddings only, for rollouts that never read a video latent). A method
whose need depends on its config says so in :meth:`TrainingMethod.reads_latents` (DMD2, Self-Forcing and PDD
read video latents only with ``rollout: data_latent``); an instance's ``data_kind`` is what its config needs.
Without latents a batch carries ``latent_shape`` (``[C, T, H, W]`` of the samples a rollout generates) and
:meth:`~distillery.models.base.ModelBase.prepare_batch` draws the noise of that shape.

Shadow weights (:mod:`distillery.components.shadow`): a method that reads a target network (a consistency
model's EMA target, an old policy) names it in :meth:`TrainingMethod.shadow_networks` (name → the trainable role
it shadows); the method then holds a frozen twin of that role (``self.twins[name]``, a model to run without
gradient, placed like the role by the builder) whose parameters are the shadow weights ``self.shadows[name]``
(:class:`~distillery.components.shadow.ShadowWeights`, made in :meth:`on_train_start`): the method moves them
towards the role when its algorithm says (``copy_``, ``lerp_``).

Checkpoints (:meth:`checkpoint_state`) are the method's: trainable roles' modules under
``roles.<role>.<module>``, ``optimizers.<role>``, ``schedulers.<role>``, the shadow weights under
``shadows.<name>``, the random stream under ``method.rng``, plus whatever a subclass adds; all DCP. Per-rank state
that is neither sharded nor replicated (PDD's carried trajectories) is :meth:`TrainingMethod.host_state`, saved
beside each rank's process RNGs. Frozen roles are not saved; :meth:`frozen_sources` names them (path + sha256) for
the checkpoint metadata.

Randomness: ``self.rng`` (a :class:`~distillery.components.rng.BatchRNG` on the student's device) is the
only source of random draws in methods, models and samplers; its per-sample draws do not depend on
the number of ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch.distributed.checkpoint.stateful import Stateful

from distillery.common.errors import UserError
from distillery.components.checkpoint.stateful import ModuleState, OptimizerState, RNGState, SchedulerState
from distillery.components.optim import build_role_optimizer
from distillery.components.rng import BatchRNG
from distillery.components.shadow import ShadowWeights
from distillery.config.schema import OptimizerConfig, TrainingConfig
from distillery.models.base import ModelBase


@dataclass
class StepPlan:
    """One optimizer step as the method plans it (:meth:`TrainingMethod.plan_step`): ``micro_steps``, the
    forwards whose gradients accumulate into the update, each called once in order (the trainer scales each
    backward by ``1 / len(micro_steps)``, turns on FSDP2's gradient reduction for the last one and averages their
    losses and metrics over them); ``metrics``, scalars measured while planning (a rollout's rewards), logged with
    the step's."""

    micro_steps: list[Callable[[], "StepOutput"]]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepOutput:
    """What one micro-batch step returns: losses (``total_loss`` is backpropagated), the context the
    backward needs, and extra scalar metrics (tensors; read on the host once per optimizer step)."""

    losses: dict[str, torch.Tensor]
    backward_ctx: Any = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class TrainingMethod(ABC):
    """Base class of SFT, DFSFT, DMD2, Self-Forcing, PDD (class attributes: see the module doc)."""

    component_kind: ClassVar[str] = "method"
    config_class: ClassVar[type]
    required_roles: ClassVar[tuple[str, ...]] = ("student",)
    optional_roles: ClassVar[tuple[str, ...]] = ()
    trainable_roles: ClassVar[tuple[str, ...]] = ("student",)
    frozen_roles: ClassVar[tuple[str, ...]] = ()
    role_kinds: ClassVar[dict[str, type]] = {}
    data_kind: ClassVar[Literal["latents", "prompts"]] = "latents"
    #: Whether the method runs under sequence parallelism (``training.distributed.sp_size`` > 1). A method that
    #: reaches models only through :class:`~distillery.models.base.ModelBase` takes it (inputs and outputs stay
    #: whole on every rank of a group, the data and draws are per data rank); one that cannot says False.
    sequence_parallel: ClassVar[bool] = True
    #: Likewise for tensor parallelism (``training.distributed.tp_size`` > 1): the blocks are split inside the model.
    tensor_parallel: ClassVar[bool] = True

    def __init__(
        self,
        config: Any,
        role_models: dict[str, ModelBase],
        training: TrainingConfig,
        rank: int = 0,
        optimizer_configs: dict[str, OptimizerConfig] | None = None,
        roles_checked: bool = False,
    ) -> None:
        """``rank``: this rank's index among the data-parallel ranks (its slice of every global draw; the ranks of a
        sequence-parallel group share one); ``optimizer_configs``: each trainable role's resolved optimizer (default: ``training.optimizer``);
        ``roles_checked``: the roles were checked from the config already (a run built by
        :func:`distillery.engine.builder.build_run`); otherwise they are checked here."""
        self.config = config
        self.data_kind = "latents" if self.reads_latents(config) else "prompts"  # what this config needs (module doc)
        self.training = training
        self.rank = rank
        if not roles_checked:
            self.check_roles(role_models)
        self.role_models = dict(role_models)
        self.student = role_models["student"]
        self.rng = BatchRNG(training.loop.seed)
        self.optimizer_configs = {role: (optimizer_configs or {}).get(role, training.optimizer)
                                  for role, model in role_models.items() if model.trainable}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.lr_schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler] = {}
        self.twin_roles = dict(self.shadow_networks(config))
        self.twins: dict[str, ModelBase] = {}
        for name, role in self.twin_roles.items():
            model = self.role_models.get(role)
            if model is None or not model.trainable:
                raise UserError(f"config error: models: {type(self).__name__} reads a shadow of the {role} ({name}); "
                                f"the {role} must be a trainable role of this run")
            self.twins[name] = model.twin(name)
        self.shadows: dict[str, ShadowWeights] = {}

    @classmethod
    def parallel_problem(cls, config: Any, kind: str) -> str | None:
        """Why the method with ``config`` cannot run under ``kind`` (``sequence`` | ``tensor``) parallelism (one
        phrase), or None: by default :attr:`sequence_parallel` / :attr:`tensor_parallel` decides."""
        del config
        return None if getattr(cls, f"{kind}_parallel") else f"{cls.__name__} does not take {kind} parallelism"

    @classmethod
    def shadow_networks(cls, config: Any) -> dict[str, str]:
        """The target networks this method reads with ``config``: name → the trainable role whose shadow weights
        they compute with (module doc). Default: none."""
        del config
        return {}

    def twins_of(self, role: str) -> list["ModelBase"]:
        """The frozen twins of ``role`` (what the builder places beside it, in name order)."""
        return [self.twins[name] for name in sorted(self.twins) if self.twin_roles[name] == role]

    @classmethod
    def reads_latents(cls, config: Any) -> bool:
        """Whether the method, with ``config``, reads video latents (False: prompt embeddings and the batch's
        ``latent_shape`` only, so it trains on a prompt-only set too). Default: ``data_kind == "latents"``."""
        del config
        return cls.data_kind == "latents"

    @classmethod
    def check_roles(cls, role_models: dict[str, Any]) -> None:
        """Raise a UserError unless the roles fit this method (names, trainability and, for model
        objects, kinds), once per run: from its config before any weights load
        (:func:`distillery.engine.builder.check_roles_early`, with :meth:`check_role_kind` per role's
        model class), or, for a method constructed without that, by its ``__init__``."""
        name = cls.__name__
        missing = [r for r in cls.required_roles if r not in role_models]
        allowed = set(cls.required_roles) | set(cls.optional_roles)
        extra = [r for r in role_models if r not in allowed]
        if missing or extra:
            raise UserError(
                f"config error: models: {name} needs roles {', '.join(cls.required_roles)}"
                + (f" (optional: {', '.join(cls.optional_roles)})" if cls.optional_roles else "")
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; unexpected {', '.join(extra)}" if extra else "")
            )
        for role in cls.trainable_roles:
            if role in role_models and not _is_trainable(role_models[role]):
                raise UserError(f"config error: models.{role}.trainable: {name} trains the {role}; set it to true")
        for role in cls.frozen_roles:
            if role in role_models and _is_trainable(role_models[role]):
                raise UserError(f"config error: models.{role}.trainable: {name} keeps the {role} frozen; set it to false")
        for role, model in role_models.items():
            if isinstance(model, ModelBase):
                cls.check_role_kind(role, type(model))

    @classmethod
    def check_role_kind(cls, role: str, model_cls: type) -> None:
        """A UserError unless ``model_cls`` is the kind of model ``role_kinds`` asks for ``role``."""
        kind = cls.role_kinds.get(role)
        if kind is not None and not (isinstance(model_cls, type) and issubclass(model_cls, kind)):
            raise UserError(f"config error: models.{role}._target_: {cls.__name__} needs a {kind.__name__} as its {role}; "
                            f"{model_cls.__module__}.{model_cls.__qualname__} is not one")

    # -- set-up ---------------------------------------------------------------------------
    def on_train_start(self, device: torch.device, world_size: int = 1) -> None:
        """Create the random stream on ``device`` (seeded with the run seed, sliced by data rank over ``world_size``
        data ranks) and pair each twin with its role in a :class:`~distillery.components.shadow.ShadowWeights` (after
        placement: the parameters are the placed ones)."""
        self.rng = BatchRNG(self.training.loop.seed, self.rank, world_size, device)
        self.shadows = {name: ShadowWeights.of_twin(self.role_models[self.twin_roles[name]].trainable_modules(),
                                                    twin.trainable_modules(), twin.refresh_compute_weights)
                        for name, twin in self.twins.items()}

    def build_optimizers(self) -> None:
        """One AdamW + LR schedule per trainable role over its ``trainable_modules()``, from that
        role's optimizer config (``models.<role>.optimizer`` over ``training.optimizer``); call after
        the modules are placed (sharded). Each role's schedule spans its own number of updates
        (:meth:`role_updates`), so a decay reaches its end at the run's last step for every role."""
        for role, cfg in self.optimizer_configs.items():
            updates = self.role_updates(role, self.training.loop.max_train_steps)
            built = build_role_optimizer(self.role_models[role].trainable_modules(), cfg, updates)
            self.optimizers[role] = built.optimizer
            self.lr_schedulers[role] = built.scheduler

    def role_updates(self, role: str, max_steps: int) -> int:
        """How many of the run's ``max_steps`` optimizer steps update ``role`` (its scheduler steps only
        on those, :meth:`optimizers_step`), the horizon of its LR schedule: every step by default; a
        method whose :meth:`roles_to_step` skips a role on some steps overrides this to match."""
        del role
        return max_steps

    # -- per step -------------------------------------------------------------------------
    def plan_step(self, batches: Iterator[dict[str, Any]], step: int) -> StepPlan:
        """The forwards of optimizer step ``step`` (module doc): by default ``training.loop.grad_accum_steps``
        calls of :meth:`single_train_step`, each drawing the next batch of ``batches`` when it runs. A method with
        a cadence of its own overrides this (it may draw several batches, or none, and do work without gradients
        first); what it keeps across steps for that goes in its checkpoint state (:meth:`checkpoint_state`,
        :meth:`host_state`), so a run stopped between any two steps resumes bit for bit."""

        def micro() -> StepOutput:
            return self.single_train_step(next(batches), step)

        return StepPlan([micro] * self.training.loop.grad_accum_steps)

    def samples_per_step(self, world_size: int) -> int:
        """Samples the optimizer step trains on over all ``world_size`` data ranks (the logged ``samples_per_s``): by
        default ``batch_size · grad_accum_steps · world_size``."""
        return self.training.data.batch_size * self.training.loop.grad_accum_steps * world_size

    @abstractmethod
    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        """Forward one micro-batch and return its losses (``total_loss`` required)."""

    def backward(self, output: StepOutput, grad_accum_rounds: int = 1) -> None:
        """Default routing: the student's backward on ``total_loss``."""
        self.student.backward(output.losses["total_loss"], output.backward_ctx, grad_accum_rounds)

    def roles_to_step(self, step: int) -> list[str]:
        """Trainable roles whose optimizers step at ``step`` (override for alternating updates).
        Grad clipping, EMA and compute-copy refreshes follow this list."""
        del step
        return list(self.optimizers)

    def optimizers_step(self, step: int) -> None:
        for role in self.roles_to_step(step):
            self.optimizers[role].step()
            self.lr_schedulers[role].step()

    def zero_grad(self, step: int) -> None:
        del step
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)

    def learning_rates(self) -> dict[str, float]:
        return {role: sched.get_last_lr()[0] for role, sched in self.lr_schedulers.items()}

    # -- what the artifact and the checkpoint carry ----------------------------------------
    def sampling_contract(self) -> dict[str, Any]:
        """How to sample the trained student (the artifact's ``sampling.json``): the sampler's
        registry name and its settings. Default: many-step Euler on the student's schedule."""
        schedule = self.student.schedule
        return {"sampler": "euler", **schedule.contract()}

    def checkpoint_state(self) -> dict[str, Stateful]:
        """DCP state by conventional key (see the module doc); subclasses add their own keys."""
        state: dict[str, Stateful] = {}
        for role, optimizer in self.optimizers.items():
            modules = self.role_models[role].trainable_modules()
            lora = getattr(self.role_models[role], "lora", None) is not None  # the adapter is what trains: the checkpoint holds it alone
            for name, module in modules.items():
                state[f"roles.{role}.{name}"] = ModuleState(module, adapters_only=lora and name == "transformer")
            state[f"optimizers.{role}"] = OptimizerState(modules, optimizer)
            state[f"schedulers.{role}"] = SchedulerState(self.lr_schedulers[role], optimizer)
        for name, shadow in self.shadows.items():
            state[f"shadows.{name}"] = shadow
        state["method.rng"] = RNGState(self.rng)
        return state

    def host_state(self) -> dict[str, Any] | None:
        """This rank's own state that is not the same on every rank and not a sharded tensor (e.g.
        PDD's carried trajectories): a tree of dicts, lists, scalars and tensors, saved per rank in
        every checkpoint beside the process RNGs (``rng/rank-<r>``). None (default): nothing."""
        return None

    def load_host_state(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`host_state` after a resume (``state`` None: the checkpoint holds none for
        this rank, e.g. it was saved by fewer ranks)."""
        del state

    def frozen_sources(self) -> dict[str, dict[str, Any]]:
        """Frozen role → where its weights came from (``path``, ``sha256``); recorded in checkpoint
        metadata so a resume against a changed teacher is refused."""
        return {role: model.source() for role, model in self.role_models.items() if not model.trainable}


def _is_trainable(model: Any) -> bool:
    if isinstance(model, ModelBase):
        return model.trainable
    return bool(getattr(getattr(model, "config", model), "trainable", False))


def causal_contract(student: Any) -> dict[str, Any]:
    """The sampling-contract keys of a causal student (a :class:`~distillery.models.base.CausalModelBase`):
    ``chunk_size``, and ``given_first_frame: true`` for an image-to-video one (its latent frame 0 is the given frame:
    validate and export read the layout from the artifact); ``{}`` for another student."""
    from distillery.models.base import CausalModelBase

    if not isinstance(student, CausalModelBase):
        return {}
    out: dict[str, Any] = {"chunk_size": int(student.chunk_size)}
    if student.given_first_frame:
        out["given_first_frame"] = True
    return out


def flow_matching_loss(
    pred_velocity: torch.Tensor,
    batch: Any,
    precondition_outputs: bool,
) -> torch.Tensor:
    """Per-element squared error ``[B, C, T, H, W]`` of the velocity (or of x0 when preconditioned)."""
    if precondition_outputs:
        from distillery.models.schedule import x0_from_velocity

        pred_x0 = x0_from_velocity(batch.noisy_latents, pred_velocity, batch.sigmas)
        return (pred_x0 - batch.latents.float()) ** 2
    target = batch.noise.float() - batch.latents.float()
    return (pred_velocity - target) ** 2


def teacher_scales(model: ModelBase, timesteps: torch.Tensor, scale: float, scale_2: float | None) -> float | torch.Tensor:
    """The CFG scale of each sample of a teacher's guided prediction at ``timesteps`` ``[B]``: ``scale`` — or, where
    ``model`` is two experts and ``scale_2`` is set, ``scale_2`` for the samples below its ``boundary_timestep`` (the
    low-noise expert's, as diffusers' ``WanPipeline`` gives ``guidance_scale_2`` to ``transformer_2``): a float when
    every sample shares one, else float32 ``[B]``."""
    boundary = model.boundary_timestep
    if scale_2 is None or boundary is None:
        return float(scale)
    low = timesteps.reshape(timesteps.shape[0], -1)[:, 0] < boundary
    return torch.where(low, torch.tensor(float(scale_2), device=timesteps.device),
                       torch.tensor(float(scale), device=timesteps.device)).float()


def guided_by_scales(predict: Callable[[bool], torch.Tensor], scales: float | torch.Tensor) -> torch.Tensor:
    """``u + w (c − u)`` of ``predict(conditional)`` with per-sample ``w`` (:func:`teacher_scales`; ``[B]`` broadcast
    over ``[B, C, T, H, W]``): the conditional call alone when every ``w`` is 1, else the conditional then the
    unconditional call (a training target's rule: 1 is the conditional teacher)."""
    c = predict(True)
    if bool((torch.as_tensor(scales) == 1.0).all()):
        return c
    u = predict(False)
    w = scales if isinstance(scales, float) else scales.view(-1, *([1] * (c.ndim - 1)))
    return u + w * (c - u)


def check_second_scale(model: ModelBase, role: str, key: str, scale_2: float | None) -> None:
    """A second (low-noise expert's) guidance scale needs a two-expert ``role``: a one-line :class:`UserError` otherwise."""
    if scale_2 is not None and model.boundary_timestep is None:
        raise UserError(f"config error: method.{key}: the low-noise expert's guidance scale; models.{role} is a model of "
                        f"one expert (Wan 2.2 A14B has two): remove it")


def require_empty_prompt(cond: Any, needed_by: str, training: TrainingConfig | None = None) -> None:
    """A :class:`UserError` (one line) unless ``cond`` (a batch or :class:`~distillery.models.base.Conditioning`)
    carries the empty prompt's embedding, which a latent set holds as ``empty_prompt.safetensors``
    (the latents stage writes it). Nothing falls back to zeros: an all-zero sequence is not what the
    text encoder makes of "", so a CFG target or a dropped caption built on it would train toward
    another model. ``needed_by``: the setting that asks for the unconditional forward; ``training``: the
    run's, to name its latent set."""
    if getattr(cond, "negative_text_embeds", None) is None:
        where = training.data.path if training is not None else "training.data.path"
        raise UserError(f"{where}: the latent set has no empty_prompt.safetensors, the empty prompt's embedding "
                        f"that {needed_by} needs (zeros are not it); rerun the latents stage, which writes it")


def apply_caption_dropout(batch: Any, probability: float, rng: BatchRNG) -> None:
    """Replace each sample's prompt embedding by the empty prompt's with ``probability`` (in place);
    a latent set without the empty prompt's embedding is refused (:func:`require_empty_prompt`)."""
    if probability <= 0:
        return
    require_empty_prompt(batch, f"caption dropout ({probability})")
    b = batch.text_embeds.shape[0]
    drop = rng.rand((b,)).to(batch.text_embeds.device) < probability
    empty = batch.negative_text_embeds
    batch.text_embeds = torch.where(drop[:, None, None], empty.to(batch.text_embeds.dtype), batch.text_embeds)
