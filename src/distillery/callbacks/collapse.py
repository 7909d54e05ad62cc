"""Training that notices collapse: every few steps, sample the few-step student and watch the samples, not the loss.

At step 0 (the student as the run got it: the **baseline**) and every ``every_steps`` optimizer steps, the callback
samples ``num_prompts`` fixed prompts of a latent set (the validation callback's :class:`ValidationPrompts`) with
``seeds_per_prompt`` seeds each (prompt i, seed j: the generator seed :meth:`ValidationSampling.generator_seed`),
through the student's own sampler (the method's sampling contract), decodes the videos with ``vae_from``'s VAE and
measures, on rank 0 (the values broadcast, so every rank decides alike):

- ``collapse/saturation`` — the fraction of decoded pixel values at or beyond the VAE's range ±1 (clipped pixels);
- ``collapse/diversity`` — per prompt, the mean absolute pixel difference between its seeds' videos (pairs), / 2;
- ``collapse/motion`` — the mean absolute difference between consecutive frames, / 2;
- ``collapse/teacher_distance`` — with ``teacher`` (a role of the run): the mean absolute pixel difference to the
  teacher's samples of the same prompts and seeds (its many-step Euler, ``teacher_steps``, once per process);

(pixels clamped to ±1 for the last three) and returns them as the step's metrics, so they sit beside the loss in
``train_log.jsonl`` and MLflow.

**The rule** on their trend against the baseline: a check *alarms* when saturation rose by more than
``max_saturation_rise``, diversity or motion fell below ``min_diversity_ratio`` / ``min_motion_ratio`` of the
baseline's, or the teacher distance grew beyond ``max_distance_ratio`` times the baseline's; ``patience`` alarming
checks in a row are a **collapse**: with ``stop`` the run ends there (a checkpoint is written at that step; a rerun
stays stopped), without it the collapse is logged and the run goes on.

**The selection**: every check after step 0 that does not alarm, before any collapse, is a candidate; the best is the
one nearest the teacher's samples (without a teacher: the latest). A new best gets a checkpoint at its step, kept from
``keep_last`` pruning, and becomes the run's checkpoint in ``run_summary.json`` with ``selection`` saying which, why,
and where the run collapsed (:class:`~distillery.callbacks.base.RunControl`); a run that collapsed before any healthy
check selects no checkpoint (``checkpoint`` null: nothing is fit to publish). The callback's state (the baseline, the
best, the streak, the collapse) is checkpointed as ``callbacks.<name>`` and resumed bit for bit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from distillery.callbacks.base import Callback, CallbackContext
from distillery.callbacks.validation import ValidationPrompts, VideoScorer, eval_mode
from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.components.distributed import broadcast_object
from distillery.config.typed import bounded
from distillery.config.validation import MAX_PROMPTS, ValidationSampling

if TYPE_CHECKING:
    from distillery.models.base import Conditioning, ModelBase

log = get_logger("callbacks.collapse")
METRICS = ("saturation", "diversity", "motion", "teacher_distance")


@dataclass
class CollapseWatchConfig(ValidationSampling):
    """The prompts (``num_prompts``, ``seed``) as the validation callback's; the rest is the watch's own."""

    where: ClassVar[str] = "callbacks.collapse"

    num_prompts: int = bounded(2, 1, MAX_PROMPTS)  # the first this-many rows of the split are the fixed prompts
    seeds_per_prompt: int = bounded(2, 2, 64)  # seeds per prompt (diversity is measured across them)
    data_path: str = ""  # latent set folder whose prompts and text embeddings are sampled
    split: str | None = None  # null: "validation" when it exists, else "train"
    text_max_length: int = bounded(512, 1, 4096)  # as training.data.text_max_length
    every_steps: int = bounded(50, 1, 10**9)  # check at step 0 and every this many optimizer steps
    role: str = "student"  # the role sampled (with the method's sampling contract)
    num_steps: int | None = bounded(None, 1, 1000)  # its sampler's steps; null: the contract's
    guidance_scale: float | None = None  # its CFG; null: the contract's
    teacher: str | None = None  # a frozen role whose samples the distance is measured to; null: no distance
    teacher_steps: int = bounded(20, 1, 1000)  # the teacher's Euler steps
    teacher_guidance_scale: float = 1.0  # the teacher's CFG (1: none); of two experts the high-noise expert's
    teacher_guidance_scale_2: float | None = None  # a two-expert teacher's low-noise expert's CFG; null: the same
    vae_from: str = ""  # diffusers folder whose vae/ decodes the samples (required: the metrics are on pixels)
    max_saturation_rise: float = 0.05  # alarm: saturation above the baseline's + this
    min_diversity_ratio: float = 0.5  # alarm: diversity below this share of the baseline's
    min_motion_ratio: float = 0.5  # alarm: motion below this share of the baseline's
    max_distance_ratio: float = 2.0  # alarm: teacher distance above this multiple of the baseline's
    patience: int = bounded(2, 1, 1000)  # alarming checks in a row that make a collapse
    stop: bool = True  # end the run at a collapse (params.yaml: <stage>.stop_on_collapse)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.data_path or not self.vae_from:
            raise ValueError("data_path (the prompts' latent set) and vae_from (the VAE that decodes) are required")
        if not (0 <= self.max_saturation_rise <= 1 and 0 < self.min_diversity_ratio <= 1 and 0 < self.min_motion_ratio <= 1
                and self.max_distance_ratio >= 1):
            raise ValueError("need 0 <= max_saturation_rise <= 1, 0 < min_diversity_ratio, min_motion_ratio <= 1, "
                             "max_distance_ratio >= 1")


def video_metrics(videos: torch.Tensor, seeds: int, teacher: torch.Tensor | None) -> dict[str, float]:
    """The module doc's measures of ``videos`` ``float32 [S·P, 3, T, H, W]`` as decoded (seed-major: video ``j·P + i``
    is prompt i, seed j) and the teacher's videos of the same layout (clamped), or None."""
    clamped = videos.clamp(-1, 1)
    by_seed = clamped.unflatten(0, (seeds, -1))  # [S, P, 3, T, H, W]
    pairs = [(by_seed[a] - by_seed[b]).abs().mean() / 2 for a, b in itertools.combinations(range(seeds), 2)]
    out = {"saturation": float((videos.abs() >= 1.0).float().mean()),
           "diversity": float(torch.stack(pairs).mean()),
           "motion": float((clamped[:, :, 1:] - clamped[:, :, :-1]).abs().mean() / 2) if videos.shape[2] > 1 else 0.0,
           "teacher_distance": math.nan}
    if teacher is not None:
        out["teacher_distance"] = float((clamped - teacher).abs().mean() / 2)
    return out


def _repeated(cond: "Conditioning", times: int) -> "Conditioning":
    """``cond`` of P prompts as ``times`` · P (seed-major), for one sampler call."""
    def rep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat(times, *([1] * (t.ndim - 1)))
    return replace(cond, text_embeds=rep(cond.text_embeds), negative_text_embeds=rep(cond.negative_text_embeds),
                   first_frame=rep(cond.first_frame), image_embeds=rep(cond.image_embeds))


class CollapseWatchCallback(Callback):
    """Samples the student every ``every_steps``, tracks its samples against the baseline, stops a collapse and selects
    the run's checkpoint (module doc)."""

    config_class = CollapseWatchConfig
    role_fields = ("role", "teacher")  # roles of the run, checked before any model loads

    def __init__(self, config: CollapseWatchConfig, name: str) -> None:
        super().__init__(config, name)
        nan = [math.nan] * len(METRICS)
        self.baseline = torch.tensor(nan, dtype=torch.float64)
        self.best = torch.tensor([-1.0, *nan], dtype=torch.float64)  # [step, metrics]; step -1: none yet
        self.collapse = torch.tensor([-1.0, *nan], dtype=torch.float64)  # [step, metrics] of the collapse; -1: none
        self.counts = torch.zeros(2, dtype=torch.int64)  # [alarming checks in a row, healthy checks after step 0]
        self._prompts: ValidationPrompts | None = None
        self._scorer: VideoScorer | None = None
        self._teacher_videos: torch.Tensor | None = None  # rank 0: the teacher's decoded samples
        self._teacher_sampled = False  # every rank: the teacher sampled once (collectively) in this process

    # -- hooks ----------------------------------------------------------------------------------
    def on_loop_start(self, ctx: CallbackContext, step: int) -> None:
        if step == 0:
            metrics = self._measure(ctx)
            self.baseline = torch.tensor([metrics[k] for k in METRICS], dtype=torch.float64)
            if ctx.rank == 0:
                log.info("collapse watch: baseline at step 0: %s", _line(metrics))
        self._steer(ctx)  # a resumed run: its selection, kept checkpoint and stop as they were

    def on_training_step_end(self, ctx: CallbackContext, step: int) -> dict[str, torch.Tensor]:
        if step % self.config.every_steps:
            return {}
        metrics = self._measure(ctx)
        alarms = self.alarms(metrics)
        healthy = not alarms and self.collapse[0] < 0
        self.counts[0] = self.counts[0] + 1 if alarms else 0
        if healthy:
            self.counts[1] += 1
            if self._better(metrics):
                self.best = torch.tensor([float(step), *(metrics[k] for k in METRICS)], dtype=torch.float64)
                ctx.control.save = True  # the new best gets its checkpoint now
        if self.collapse[0] < 0 and self.counts[0] >= self.config.patience:
            self.collapse = torch.tensor([float(step), *(metrics[k] for k in METRICS)], dtype=torch.float64)
        if ctx.rank == 0:
            log.info("collapse watch at step %d: %s%s", step, _line(metrics), f"; alarm: {'; '.join(alarms)}" if alarms else "")
        self._steer(ctx)
        out = {f"collapse/{k}": torch.tensor(v) for k, v in metrics.items() if not math.isnan(v)}
        out["collapse/alarms"] = torch.tensor(float(len(alarms)))
        return out

    # -- the rule ---------------------------------------------------------------------------------
    def alarms(self, metrics: dict[str, float]) -> list[str]:
        """What in ``metrics`` breaks the rule against the baseline (module doc), one phrase each."""
        cfg, base = self.config, dict(zip(METRICS, self.baseline.tolist()))
        out = []
        if metrics["saturation"] > base["saturation"] + cfg.max_saturation_rise:
            out.append(f"saturation {metrics['saturation']:.4g} > {base['saturation']:.4g} + {cfg.max_saturation_rise:g}")
        if metrics["diversity"] < cfg.min_diversity_ratio * base["diversity"]:
            out.append(f"diversity {metrics['diversity']:.4g} < {cfg.min_diversity_ratio:g} x {base['diversity']:.4g}")
        if metrics["motion"] < cfg.min_motion_ratio * base["motion"]:
            out.append(f"motion {metrics['motion']:.4g} < {cfg.min_motion_ratio:g} x {base['motion']:.4g}")
        td, td0 = metrics["teacher_distance"], base["teacher_distance"]
        if not math.isnan(td) and td > cfg.max_distance_ratio * td0:
            out.append(f"teacher distance {td:.4g} > {cfg.max_distance_ratio:g} x {td0:.4g}")
        return out

    def _better(self, metrics: dict[str, float]) -> bool:
        """Whether this healthy check beats the best so far: nearer the teacher's samples (ties and no teacher: the
        later check)."""
        if self.best[0] < 0 or math.isnan(metrics["teacher_distance"]):
            return True
        return metrics["teacher_distance"] <= float(self.best[1 + METRICS.index("teacher_distance")])

    def _steer(self, ctx: CallbackContext) -> None:
        """The loop's :class:`~distillery.callbacks.base.RunControl` from the state: the best checkpoint kept and
        selected, the stop of a collapse."""
        best, collapse = int(self.best[0]), int(self.collapse[0])
        if best < 0 and collapse < 0:
            return
        reason = ""
        if best >= 0:
            metrics = dict(zip(METRICS, self.best[1:].tolist()))
            ctx.control.keep = {best}
            reason = (f"the healthy check nearest the teacher's samples (distance {metrics['teacher_distance']:.4g}) of "
                      f"{int(self.counts[1])}" if not math.isnan(metrics["teacher_distance"])
                      else f"the last healthy check of {int(self.counts[1])}")
        if collapse >= 0:
            alarms = self.alarms(dict(zip(METRICS, self.collapse[1:].tolist())))
            what = f"collapse at step {collapse}: {'; '.join(alarms)} ({self.config.patience} checks in a row)"
            reason = f"{reason}; {what}" if reason else f"{what}, before any healthy check: no checkpoint is fit to publish"
            if self.config.stop:
                ctx.control.stop = what
        ctx.control.selection = {"step": best if best >= 0 else None, "checkpoint": f"checkpoint-{best}" if best >= 0 else None,
                                 "reason": reason, "by": self.name,
                                 "metrics": {k: v for k, v in zip(METRICS, self.best[1:].tolist()) if not math.isnan(v)},
                                 "collapse_step": collapse if collapse >= 0 else None}

    # -- sampling and measuring -------------------------------------------------------------------
    def _measure(self, ctx: CallbackContext) -> dict[str, float]:
        """Sample the student (every rank), decode and measure (rank 0), the values on every rank."""
        cfg = self.config
        if self._prompts is None:
            self._prompts = ValidationPrompts.read(Path(cfg.data_path), cfg.split, cfg.num_prompts, cfg.text_max_length)
        contract = ctx.sampling if ctx.sampling is not None else {"sampler": "euler"}
        videos = self._sample(ctx, self._role(ctx, cfg.role), contract, cfg.num_steps, cfg.guidance_scale, None)
        if cfg.teacher is not None and not self._teacher_sampled:  # once, on every rank alike (its forwards are collective)
            self._teacher_sampled = True
            teacher = self._role(ctx, cfg.teacher)
            euler = {"sampler": "euler", "shift": teacher.schedule.shift, "num_train_timesteps": teacher.schedule.num_train_timesteps}
            decoded = self._sample(ctx, teacher, euler, cfg.teacher_steps, cfg.teacher_guidance_scale,
                                   cfg.teacher_guidance_scale_2)
            self._teacher_videos = decoded.clamp(-1, 1) if decoded is not None else None
        metrics = video_metrics(videos, cfg.seeds_per_prompt, self._teacher_videos) if ctx.rank == 0 else None
        return broadcast_object(metrics)  # type: ignore[return-value]

    def _sample(self, ctx: CallbackContext, model: "ModelBase", contract: dict[str, Any], steps: int | None,
                guidance: float | None, guidance_2: float | None) -> torch.Tensor | None:
        """P prompts × S seeds through ``contract``'s sampler (every rank; ``guidance`` / ``guidance_2``: the CFG scales of
        the high- and low-noise experts, as the samplers take them), decoded on rank 0 (``float32 [S·P, 3, T, H, W]``
        on the CPU); None on the other ranks."""
        from distillery.sampling import build_sampler

        cfg, prompts = self.config, self._prompts
        sampler = build_sampler(contract)
        count, seeds = len(prompts.captions), cfg.seeds_per_prompt
        generators = [torch.Generator().manual_seed(cfg.generator_seed(i, j)) for j in range(seeds) for i in range(count)]
        with eval_mode(model), torch.no_grad():
            latents = sampler.sample(model, _repeated(prompts.conditioning(), seeds), prompts.latent_shape, generators,
                                     num_steps=steps, guidance_scale=guidance, guidance_scale_2=guidance_2)
        if ctx.rank != 0:
            return None
        if self._scorer is None:
            self._scorer = VideoScorer(Path(cfg.vae_from), model.device)
        return torch.cat([self._scorer.decode_raw(latents[k: k + 1]).cpu() for k in range(latents.shape[0])])

    def _role(self, ctx: CallbackContext, role: str) -> "ModelBase":
        if role not in ctx.roles:
            raise UserError(f"callbacks.{self.name}: {role!r} is not a role of this run; valid: {', '.join(sorted(ctx.roles))}")
        return ctx.roles[role]

    # -- checkpoint ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "best": self.best, "collapse": self.collapse, "counts": self.counts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.baseline, self.best = state["baseline"].clone(), state["best"].clone()
        self.collapse, self.counts = state["collapse"].clone(), state["counts"].clone()


def _line(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not math.isnan(v))
