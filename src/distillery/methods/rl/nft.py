"""DiffusionNFT: reward-driven post-training of a teacher or a distilled student, on its own sampling schedule.

Roles: ``student`` (trainable; any bidirectional model: the teacher, a fine-tuned base, a DMD2 or PDD student).
Two more policies are shadow weights of the student (:mod:`distillery.components.shadow`: frozen twins placed like
the student, their fp32 parameters checkpointed under ``shadows.<name>``): the **old policy** (``old``), which
samples the rollouts and anchors the objective, and the **reference** (``reference``, with ``kl_beta > 0``), the
student's weights when the run started (the KL term's anchor). Rewards are plugins the run config names
(``rewards: {name: {_target_, weight, knobs}}``, :mod:`distillery.methods.rl.rewards`).

**Cadence** (the method plans every optimizer step itself, :meth:`DiffusionNFTMethod.plan_step`; the trainer still
clips, skips a non-finite step, steps the optimizer, averages EMA, checkpoints and logs each one):

1. **Rollout group** (when the last group's updates are done): the old policy moves toward the student
   (``old ← d · old + (1 − d) · θ``, ``d`` from ``old_decay_*``, :func:`~distillery.methods.rl.objective.old_policy_decay`;
   not before the first group: the old policy starts as the student); one batch of ``P`` prompts
   (``training.data.batch_size`` per rank) is drawn, each repeated ``K = samples_per_prompt`` times, and the old policy
   samples the ``P·K`` videos with the student's sampling contract (``sampling``: the input artifact's
   ``sampling.json``; null: Euler on the student's schedule; ``rollout_steps`` / ``rollout_guidance_scale``: that
   sampler's steps and CFG), from the run's random stream. The latents are decoded with ``vae_from``'s VAE (null:
   the student's own folder's) and scored by every reward (uint8 frames and the prompts; a non-finite score on any
   rank stops the run in one line before anything is saved); their weighted sum's K values per prompt give the
   advantages (:func:`~distillery.methods.rl.objective.group_advantages`). The group (latents, conditioning,
   advantages, sample orders) is this rank's host state: a run stopped mid-group resumes it bit for bit.
2. **Updates**: the group's ``P·K`` samples are split into ``M = P·K / minibatch_size`` minibatches per inner
   epoch (``inner_epochs`` of them, each in a fresh order: each prompt's K samples shuffled, sample ``i`` of the
   epoch's order in minibatch ``i mod M``); an optimizer step takes ``grad_accum_steps`` minibatches and, for each,
   every training timestep (:func:`~distillery.methods.rl.policy.train_points`: those the student's sampler visits,
   the first ``timestep_fraction`` of them) as one micro-step: fresh noise, ``x_t``, the old policy's and the
   reference's velocities (no gradient), the student's (with it), the objective
   (:func:`~distillery.methods.rl.objective.nft_loss`). A group lasts ``inner_epochs · M / grad_accum_steps`` steps.

**Ranks**: every draw is the global batch's (:class:`~distillery.components.rng.BatchRNG`): a prompt's K rollouts
live on the rank that drew it, its advantages are its own, and minibatch ``m`` holds the same global samples in the
same order on any number of ranks (``P·K`` per rank is a multiple of ``M``), so 2 ranks train what 1 rank trains.
Resumed on another world size, the group is dropped (its samples are per-rank) and a new one is drawn at the next
step (one warning line; deterministic, not the uninterrupted run's continuation).

The artifact samples as the student did: :meth:`sampling_contract` is ``sampling`` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.components.distributed import all_reduce_mean
from distillery.config.typed import bounded, check_fields
from distillery.methods.base import StepOutput, StepPlan, TrainingMethod, require_empty_prompt
from distillery.methods.rl.objective import AdvantageMode, clip_advantages, group_advantages, nft_loss, old_policy_decay
from distillery.methods.rl.policy import TrainPoint, train_points
from distillery.methods.rl.rewards import RewardSet
from distillery.models.base import Conditioning, ModelBase, batch_latent_shape
from distillery.models.schedule import renoise

log = get_logger("nft")
COND_FIELDS = ("text_embeds", "first_frame", "image_embeds")  # a group's per-sample conditioning


@dataclass
class DiffusionNFTConfig:
    component_fields: ClassVar[dict[str, str]] = {"rewards": "reward"}  # built as reward components (config loader)

    rewards: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {_target_: <a Reward>, weight, knobs}
    samples_per_prompt: int = bounded(4, 2, 1024)  # K rollouts of each prompt (its advantage group)
    minibatch_size: int | None = bounded(None, 1, 1 << 16)  # samples per rank in one minibatch; null: training.data.batch_size
    inner_epochs: int = bounded(1, 1, 1000)  # passes over a rollout group
    sampling: dict[str, Any] | None = None  # the student's sampling contract (its sampling.json); null: Euler, own schedule
    rollout_steps: int | None = bounded(None, 1, 1000)  # the contract sampler's steps for rollouts; null: the contract's
    rollout_guidance_scale: float | None = bounded(None, 0.0, 100.0)  # the rollouts' CFG; null: the contract's
    timestep_fraction: float = bounded(0.99, 0.0, 1.0)  # train at the first int(n · this) of the sampler's n timesteps
    beta: float = bounded(0.1, 1e-6, 1000.0)  # β of the implicit positive / negative policies
    kl_beta: float = bounded(1e-4, 0.0, 1e6)  # weight of the KL term to the reference (0: no reference forward)
    adv_clip_max: float = bounded(5.0, 1e-6, 1e6)  # advantages clipped to ±this
    adv_mode: AdvantageMode = "all"  # all | positive_only | negative_only | one_only | binary
    old_decay_flat: int = bounded(0, 0, 1 << 20)  # rollout groups before the old policy starts to lag (decay 0)
    old_decay_rate: float = bounded(0.001, 0.0, 1.0)  # the old policy's decay grows by this per group ...
    old_decay_max: float = bounded(0.5, 0.0, 1.0)  # ... up to this
    vae_from: str | None = None  # diffusers folder whose vae/ decodes rollouts for the rewards; null: the student's folder

    def __post_init__(self) -> None:
        check_fields(self, "method")
        if self.timestep_fraction <= 0:
            raise ValueError("timestep_fraction must be > 0")
        if self.sampling is not None and "sampler" not in self.sampling:
            raise ValueError("sampling must be a sampling contract naming its sampler (an artifact's sampling.json)")


@dataclass
class RolloutGroup:
    """One rank's rollout group: ``x0`` float32 ``[N, C, T, H, W]`` (N = P·K, prompt-major), its conditioning
    (``cond``: :data:`COND_FIELDS` present, ``[N, ...]``), ``advantages`` float32 ``[N]``, ``orders`` int64
    ``[inner_epochs, N]`` (each epoch's sample order), its number ``index`` (1-based) and the updates done on it."""

    x0: torch.Tensor
    cond: dict[str, torch.Tensor]
    advantages: torch.Tensor
    orders: torch.Tensor
    index: int
    updates: int = 0

    def conditioning(self, rows: torch.Tensor) -> Conditioning:
        picked = {k: v[rows] for k, v in self.cond.items()}
        return Conditioning(picked["text_embeds"], None, picked.get("first_frame"), picked.get("image_embeds"))

    def state(self) -> dict[str, Any]:
        return {"x0": self.x0, "cond": dict(self.cond), "advantages": self.advantages, "orders": self.orders,
                "index": self.index, "updates": self.updates}


class DiffusionNFTMethod(TrainingMethod):
    """DiffusionNFT (module doc): rollouts, group-normalised rewards, the NFT objective with its KL term."""

    config_class = DiffusionNFTConfig
    required_roles = ("student",)
    trainable_roles = ("student",)
    data_kind = "prompts"
    #: Not run under sequence parallelism yet: its decoding and rewards would run on every rank of a group, and no test
    #: holds it to the one-process run there (training.distributed.sp_size > 1 is refused in one line).
    sequence_parallel = False
    tensor_parallel = False  # (likewise under training.distributed.tp_size > 1)

    @classmethod
    def shadow_networks(cls, config: DiffusionNFTConfig) -> dict[str, str]:
        """The old policy, and the reference when the KL term is on: shadows of the student."""
        return {"old": "student", **({"reference": "student"} if config.kl_beta > 0 else {})}

    def __init__(self, config: DiffusionNFTConfig, role_models: dict[str, ModelBase], training: Any, rank: int = 0,
                 plugins: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(config, role_models, training, rank, **kwargs)
        self.rewards = RewardSet((plugins or {}).get("rewards") or {})
        student = self.student
        self.contract = dict(config.sampling) if config.sampling is not None else super().sampling_contract()
        self.points: list[TrainPoint] = train_points(self.contract, student, config.rollout_steps, config.timestep_fraction)
        k, b, accum = config.samples_per_prompt, training.data.batch_size, training.loop.grad_accum_steps
        self.group_size = b * k
        self.minibatch = config.minibatch_size or b
        if self.group_size % self.minibatch:
            raise UserError(f"config error: method.minibatch_size: {self.minibatch} does not divide a rank's rollout group of "
                            f"{self.group_size} (training.data.batch_size {b} × samples_per_prompt {k})")
        self.minibatches = self.group_size // self.minibatch  # M per inner epoch
        if self.minibatches % accum:
            raise UserError(f"config error: training.loop.grad_accum_steps: {accum} does not divide the {self.minibatches} "
                            f"minibatches of a rollout group's epoch (its {self.group_size} samples / minibatch_size "
                            f"{self.minibatch})")
        self.updates_per_group = config.inner_epochs * self.minibatches // accum
        self.vae_from = self._vae_folder()
        self.group: RolloutGroup | None = None
        self.groups = 0  # rollout groups drawn so far (the last one's index)
        self.decoder: Any = None

    def _vae_folder(self) -> Path:
        folder = Path(self.config.vae_from or getattr(self.student.config, "init_from", "") or "")
        if not (folder / "vae").is_dir():
            where = "method.vae_from" if self.config.vae_from else "method.vae_from (null: the student's init_from)"
            raise UserError(f"config error: {where}: {folder} has no vae/ folder to decode rollouts for the rewards; "
                            "name a diffusers folder holding one (the base)")
        return folder

    # -- what the run records ---------------------------------------------------------------
    def sampling_contract(self) -> dict[str, Any]:
        return dict(self.contract)

    def samples_per_step(self, world_size: int) -> int:
        return self.minibatch * self.training.loop.grad_accum_steps * world_size

    def frozen_sources(self) -> dict[str, dict[str, Any]]:
        """The frozen roles' and each reward model's."""
        return {**super().frozen_sources(), **self.rewards.sources()}

    # -- set-up ---------------------------------------------------------------------------
    def on_train_start(self, device: torch.device, world_size: int = 1) -> None:
        """The random stream and the shadows (the old policy and the reference: the student's initial weights, until a
        resume loads theirs), the rewards and the decoder, on ``device``."""
        from distillery.data.encoders import BaseEncoders

        super().on_train_start(device, world_size)
        self.rewards.load(device)
        # on a GPU the decoder's calls are sized to its memory (the same function, other rounding); on CPU frame by frame
        self.decoder = BaseEncoders(self.vae_from, device, text_encoder=False,
                                    decode=(None if device.type == "cuda" else 1, False))

    # -- the cadence ----------------------------------------------------------------------
    def plan_step(self, batches: Any, step: int) -> StepPlan:
        """A new rollout group when the last one is used up (its rewards are the plan's metrics), then this step's
        micro-steps: ``grad_accum_steps`` minibatches × the training timesteps (module doc)."""
        metrics: dict[str, torch.Tensor] = {}
        if self.group is None or self.group.updates >= self.updates_per_group:
            if self.group is not None:  # the old policy follows the student after each group's updates
                self.shadows["old"].lerp_(1.0 - old_policy_decay(self.group.index, self.config.old_decay_flat,
                                                      self.config.old_decay_rate, self.config.old_decay_max))
            metrics = self._new_group(next(batches))
        group = self.group
        accum = self.training.loop.grad_accum_steps
        epoch, first = divmod(group.updates * accum, self.minibatches)
        order = group.orders[epoch]
        micro_steps = []
        for m in range(first, first + accum):
            rows = order[torch.arange(m, self.group_size, self.minibatches, device=order.device)]
            micro_steps += [self._micro(group, rows, point) for point in self.points]
        group.updates += 1
        metrics["rollout_group"] = torch.tensor(float(group.index))
        return StepPlan(micro_steps, metrics)

    def single_train_step(self, batch: dict[str, Any], step: int) -> StepOutput:
        raise RuntimeError("DiffusionNFTMethod plans its own steps (plan_step)")

    def _micro(self, group: RolloutGroup, rows: torch.Tensor, point: TrainPoint) -> Any:
        def forward() -> StepOutput:
            student, n = self.student, self.student.schedule.num_train_timesteps
            x0 = group.x0[rows]
            cond = group.conditioning(rows)
            t = torch.full((x0.shape[0],), point.t, dtype=torch.float32, device=x0.device)
            sigma = t / n
            x_t = renoise(x0, self.rng.randn(x0.shape).to(x0.device), sigma)
            with torch.no_grad():
                v_old = point.velocity(self.twins["old"], x_t, t, cond)
                v_ref = point.velocity(self.twins["reference"], x_t, t, cond) if "reference" in self.twins else v_old
            v = point.velocity(student, x_t, t, cond)
            weight = clip_advantages(group.advantages[rows], self.config.adv_clip_max, self.config.adv_mode)
            losses = nft_loss(x0, x_t, sigma, v, v_old, v_ref, weight, self.config.beta, self.config.adv_clip_max,
                              self.config.kl_beta)
            return StepOutput(losses=losses, metrics={"train_timestep": t.mean()})

        return forward

    # -- rollouts -------------------------------------------------------------------------
    @torch.no_grad()
    def _new_group(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Sample, decode and score this rank's next rollout group (module doc, step 1); returns its reward metrics."""
        from distillery.sampling import build_sampler

        k, device = self.config.samples_per_prompt, self.student.device
        guidance = self.config.rollout_guidance_scale
        sampler = build_sampler(self.contract)
        repeat = torch.arange(batch["text_embeds"].shape[0]).repeat_interleave(k)
        prepared = self.student.prepare_batch(_rows_of(batch, repeat), self.rng, torch.zeros(len(repeat)))
        cond = Conditioning(prepared.text_embeds, prepared.negative_text_embeds, prepared.first_frame, prepared.image_embeds)
        if sampler.resolve_guidance(guidance) > 1.0:
            require_empty_prompt(cond, f"rollouts with CFG {sampler.resolve_guidance(guidance)}", self.training)
        shape = tuple(batch_latent_shape(batch)[1:])
        with torch.no_grad():  # from the prepared batch's noise (the run's stream, drawn for the global batch)
            x0 = sampler.sample(self.twins["old"], cond, shape, self.rng, num_steps=self.config.rollout_steps,
                                guidance_scale=guidance, initial=prepared.noise).float()
        prompts = [str(batch["captions"][int(i)]) for i in repeat]
        videos = np.concatenate([self.decoder.decode_latents(x0[i:i + 1]) for i in range(x0.shape[0])])
        scores = self.rewards.score(videos, prompts)
        self._refuse_nonfinite(scores, prompts)
        total = torch.tensor(scores["total"], dtype=torch.float32, device=device).view(-1, k)
        advantages = group_advantages(total).view(-1)
        keys = self.rng.rand((total.shape[0], self.config.inner_epochs, k)).to(device)  # each prompt's order per epoch
        within = keys.argsort(dim=2) + (torch.arange(total.shape[0], device=device) * k).view(-1, 1, 1)
        orders = within.permute(1, 0, 2).reshape(self.config.inner_epochs, -1)
        self.groups += 1
        self.group = RolloutGroup(x0, {f: getattr(prepared, f) for f in COND_FIELDS if getattr(prepared, f) is not None},
                                  advantages, orders, self.groups)
        std = total.std(dim=1, unbiased=False)
        metrics = {"reward": total.mean(), "reward_group_std": std.mean(), "reward_flat_groups": (std == 0).float().mean()}
        metrics.update({f"reward/{name}": torch.tensor(float(np.mean(v)), device=device)
                        for name, v in scores.items() if name != "total"})
        return metrics

    def _refuse_nonfinite(self, scores: dict[str, np.ndarray], prompts: list[str]) -> None:
        """Every rank learns whether any rank's rewards are not finite, and then all stop (one line)."""
        problem = self.rewards.nonfinite(scores, prompts)
        flag = torch.tensor([0.0 if problem is None else 1.0], device=self.student.device)
        if float(all_reduce_mean(flag)) > 0:
            raise UserError(f"method.rewards: {problem or 'a reward returned a non-finite value on another rank'}; "
                            "stopped before the step, nothing saved after the last checkpoint")

    # -- per-rank host state: the rollout group --------------------------------------------
    def host_state(self) -> dict[str, Any] | None:
        return {"groups": self.groups, "world_size": int(self.rng.world_size),
                "group": None if self.group is None else self.group.state()}

    def load_host_state(self, state: dict[str, Any] | None) -> None:
        """Restore the rollout group; another world size (or none for this rank) drops it (module doc)."""
        if not state:
            self.group = None
            return
        self.groups = int(state["groups"])
        saved = state.get("group")
        if int(state.get("world_size", -1)) != int(self.rng.world_size) and saved is not None:
            if self.rank == 0:
                log.warning("nft: the checkpoint's rollout group was sampled on %d rank(s), this run has %d: a new group "
                            "is drawn at the next step (not the uninterrupted run's continuation)",
                            int(state.get("world_size", -1)), int(self.rng.world_size))
            saved = None
        if saved is None:
            self.group = None
            return
        device = self.student.device
        self.group = RolloutGroup(saved["x0"].to(device), {k: v.to(device) for k, v in saved["cond"].items()},
                                  saved["advantages"].to(device), saved["orders"].to(device), int(saved["index"]),
                                  int(saved["updates"]))


def _rows_of(batch: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """``batch`` with its per-sample tensors indexed by ``rows`` (a prompt batch repeated K times)."""
    out = dict(batch)
    for key in ("text_embeds", "negative_text_embeds", "first_frame", "image_embeds"):
        if batch.get(key) is not None:
            out[key] = batch[key][rows]
    return out
