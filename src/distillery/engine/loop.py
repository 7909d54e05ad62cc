"""The training loop: gradient accumulation, callbacks, one host sync per step, checkpoints.

``build_trainer(config, env).fit()`` (:mod:`distillery.engine.assemble`) trains
``training.loop.max_train_steps`` optimizer steps, resuming from the newest checkpoint in
``training.checkpoint.output_dir`` when one exists (``resume: latest``), and returns a
:class:`TrainResult`. The :class:`Trainer` is handed everything it trains with — the built run
(models, method, callbacks), its batches, the checkpoint manager and the logger — and only runs the
loop: per optimizer step, forward + backward per micro-batch → callbacks → optimizer step → log →
checkpoint.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distillery.callbacks.base import CallbackContext
from distillery.common.errors import UserError
from distillery.common.log import get_logger
from distillery.common.procutil import exclusive_lock
from distillery.components.checkpoint.manager import METHOD_HOST_KEY, CheckpointManager, CheckpointPayload, capture_rng
from distillery.components.checkpoint.stateful import CallbackState, ScalarState
from distillery.components.distributed import DistEnv, broadcast_object
from distillery.config.schema import RunConfig
from distillery.engine.batches import TrainBatches
from distillery.engine.builder import BuiltRun
from distillery.engine.nonfinite import NonFiniteGuard
from distillery.engine.run_log import RunLogger
from distillery.engine.step_metrics import StepClock, StepMetrics, StepRow

log = get_logger("trainer")


@dataclass
class TrainResult:
    final_step: int
    checkpoint: Path | None
    history: list[dict[str, float]] = field(default_factory=list)  # per logged step: metrics
    mlflow_run_id: str | None = None


class Trainer:
    """The loop over a built run. ``frozen_sources``: frozen role → its source (path + sha256 of its
    weights, the same on every rank), recorded in each checkpoint and checked on resume; ``lora``: LoRA role →
    its adapter spec and base (:func:`distillery.models.lora.lora_records`), likewise."""

    def __init__(self, config: RunConfig, env: DistEnv, *, run: BuiltRun, batches: TrainBatches,
                 checkpoints: CheckpointManager, logger: RunLogger, frozen_sources: dict[str, dict[str, Any]],
                 lora: dict[str, dict[str, Any]] | None = None) -> None:
        t = config.training
        self.config, self.env, self.loop = config, env, t.loop
        self.run, self.method, self.callbacks = run, run.method, run.callbacks
        self.batches, self.ckpt, self.logger, self.frozen_sources = batches, checkpoints, logger, frozen_sources
        self.lora = lora or {}
        self.ctx = CallbackContext(roles=run.models, rank=env.rank, world_size=env.world_size, max_train_steps=t.loop.max_train_steps,
                                   roles_to_step=self.method.roles_to_step, sampling=self.method.sampling_contract())
        self.nonfinite = NonFiniteGuard(t.loop.skip_nonfinite_steps, t.checkpoint.output_dir, env.device)
        self.metrics = StepMetrics(env.device, self.method.samples_per_step(env.data_world), self.method.learning_rates)
        self.step = 0  # the last completed optimizer step (what a checkpoint records)
        self.saved: Path | None = None  # the last checkpoint this invocation wrote

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train to ``max_train_steps`` holding the output folder's writer lock (one writer per folder)."""
        with self._output_lock():
            start, run_id = self._start()
            self._refuse_foreign_targets(start)
            with self.logger.session(start, run_id, self.config) as tracker:
                self.ctx.tracker = tracker
                self.callbacks.on_loop_start(self.ctx, start)
                control = self.ctx.control
                last = self.loop.max_train_steps
                if control.stop:  # a run a callback stopped, resumed: it stays stopped
                    log.warning("not training past step %d: %s", start, control.stop)
                    last = start
                for step in range(start + 1, last + 1):
                    clock = self.metrics.clock()
                    tensors = self.train_step(step)
                    self.step = step
                    saving = self._checkpoint_due(step) or control.save or control.stop is not None
                    self._log(step, tensors, clock, now=saving or step == self.loop.max_train_steps)
                    if saving:
                        self._save_checkpoint(step)
                    if control.stop:
                        log.warning("stopping at step %d: %s", step, control.stop)
                        break
                    if step == self.loop.stop_at_step:
                        log.info("stopping at step %d as asked (training.loop.stop_at_step); rerun to continue", step)
                        break
                self.logger.flush()
                self.callbacks.on_train_end(self.ctx, self.step)
            return self._result(start)

    def train_step(self, step: int) -> dict[str, torch.Tensor]:
        """One optimizer step: forward + backward of every micro-batch, the callbacks before the
        update (clip, read grad norms), the update (skipped for a non-finite step within the
        budget), the callbacks after it (EMA). Returns the step's 0-dim metric tensors (device)."""
        tensors = self._forward_backward(step)
        tensors.update(self.callbacks.on_before_optimizer_step(self.ctx, step))
        if self.nonfinite.skip(step, tensors):
            self.method.zero_grad(step)  # no update: the weights stay those of the last good step
            return {"skipped_nonfinite": torch.ones(())}  # the step's non-finite values are not logged
        self._optimizer_step(step)
        tensors.update(self.callbacks.on_training_step_end(self.ctx, step))
        return tensors

    # -- the pieces of a step -----------------------------------------------------------------
    def _forward_backward(self, step: int) -> dict[str, torch.Tensor]:
        """Each micro-step the method plans for this step (:meth:`~distillery.methods.base.TrainingMethod.plan_step`:
        by default ``grad_accum_steps`` micro-batches): its forward and the method's backward (the loss scaled by
        1/count), the roles' gradients collected; returns the losses and metrics averaged over the micro-steps, with
        the plan's own metrics."""
        plan = self.method.plan_step(self.batches, step)
        accum = len(plan.micro_steps)
        sums: dict[str, torch.Tensor] = {}
        for micro, forward in enumerate(plan.micro_steps):
            self._set_gradient_sync(micro == accum - 1, accum)  # FSDP2: reduce gradients once, after the last micro-step
            out = forward()
            self.method.backward(out, grad_accum_rounds=accum)
            for model in self.run.models.values():
                model.collect_grads()
            for k, v in {**out.losses, **out.metrics}.items():
                sums[k] = sums.get(k, 0) + v.detach().float() / accum
        sums.update(plan.metrics)
        return sums

    def _set_gradient_sync(self, enabled: bool, micro_steps: int) -> None:
        """FSDP2 modules of trainable roles reduce-scatter gradients only when ``enabled`` (the last
        micro-step of an accumulation of ``micro_steps``; the others accumulate unsharded gradients locally)."""
        if micro_steps == 1:
            return
        from torch.distributed.fsdp import FSDPModule

        for model in self.run.models.values():
            if model.trainable:
                for module in model.trainable_modules().values():
                    if isinstance(module, FSDPModule):
                        module.set_requires_gradient_sync(enabled)

    def _optimizer_step(self, step: int) -> None:
        """Step the optimizers (and LR schedules) of the roles that update at ``step``, drop the
        gradients, rewrite those roles' compute copies (a role that did not step keeps its own)."""
        stepped = self.method.roles_to_step(step)
        self.method.optimizers_step(step)
        self.method.zero_grad(step)
        self._refresh_compute_weights(stepped)

    def _refresh_compute_weights(self, roles: list[str]) -> None:
        """Rewrite the compute copies of ``roles`` (those whose master weights changed)."""
        for role in roles:
            self.run.models[role].refresh_compute_weights()

    def _log(self, step: int, tensors: dict[str, torch.Tensor], clock: StepClock, now: bool) -> None:
        """Queue step ``step``'s metrics for the host and log the previous step's (read now that
        this one is on the device); ``now``: read and log this one too (a checkpoint, or the end)."""
        self._record(self.metrics.read(finished=clock.started))
        self.metrics.stage(step, tensors, clock)
        if now:
            self._record(self.metrics.read())

    def _record(self, row: StepRow | None) -> None:
        if row is not None:
            self.nonfinite.check(row.step, row.values)  # before any checkpoint of this step or later
            self.logger.log_step(row.step, row.metrics)

    # -- checkpoints ------------------------------------------------------------------------------
    def _checkpoint_due(self, step: int) -> bool:
        every, last = self.config.training.checkpoint.save_every, self.loop.max_train_steps
        return bool((every and step % every == 0) or step == self.loop.stop_at_step
                    or (step == last and self.config.training.checkpoint.save_final))

    def _refuse_foreign_targets(self, start: int) -> None:
        """Before the first step: a ``checkpoint-N`` in the output folder that no run of this folder wrote (not in its
        record) where this run will save one is one line now — it is never replaced (docs/reliability.md rule 8), so the
        run would otherwise train up to step N and stop there. Rank 0 looks; every rank learns it (no rank hangs)."""
        from distillery.components.checkpoint import record

        problem = None
        if self.env.is_main:
            out = Path(self.config.training.checkpoint.output_dir)
            ours = record.written(out)
            due = [step for step in range(start + 1, self.loop.max_train_steps + 1) if self._checkpoint_due(step)]
            foreign = [out / f"checkpoint-{step}" for step in due if os.path.lexists(out / f"checkpoint-{step}")
                       and f"checkpoint-{step}" not in ours]
            if foreign:
                problem = (f"{foreign[0]} was not written by a run of this folder, and this run saves its step "
                           f"{foreign[0].name.split('-')[1]} there: it would train up to that step and stop (a folder not "
                           f"its own is never replaced); move it away (or choose another training.checkpoint.output_dir) "
                           f"and rerun; nothing was trained" + (f" ({len(foreign)} such)" if len(foreign) > 1 else ""))
        problem = broadcast_object(problem)
        if problem:
            raise UserError(problem)

    def _save_checkpoint(self, step: int) -> None:
        """Save step ``step`` (collective; the checkpoints the callbacks keep are not pruned), then hand MLflow the
        steps it now covers."""
        self.ckpt.keep = set(self.ctx.control.keep)
        self.saved = self.ckpt.save(step, self._payload())
        self.ctx.control.save = False
        self.logger.flush()

    def _position(self) -> dict[str, int]:
        return {"step": self.step, **{f"data_{k}": int(v) for k, v in self.batches.state_dict().items()}}

    def _set_position(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.batches.load_state_dict({k[len("data_"):]: v for k, v in state.items() if k.startswith("data_")})

    def _payload(self) -> CheckpointPayload:
        """The method's state (roles, optimizers, schedulers, its own), the trainer's position and
        the callbacks' tensors — all DCP — plus this rank's process RNGs and the metadata."""
        dcp_state: dict[str, Any] = dict(self.method.checkpoint_state())
        dcp_state["trainer"] = ScalarState(self._position, self._set_position)
        dcp_state.update({key: CallbackState(cb) for key, cb in self.callbacks.stateful().items()})
        role_configs = {role: model.transformer_config() for role, model in self.run.models.items() if model.trainable}
        meta = {"method": self.config.method.target, "mlflow_run_id": self.logger.run_id}
        if self.lora:  # (absent without one: a full-weight checkpoint's metadata is as before)
            meta["lora"] = self.lora
        host = capture_rng()
        method_host = self.method.host_state()
        if method_host is not None:
            host[METHOD_HOST_KEY] = method_host
        return CheckpointPayload(dcp_state, host, role_configs, self.frozen_sources, meta)

    # -- start and end of an invocation -----------------------------------------------------------
    def _start(self) -> tuple[int, str | None]:
        """Create the method's and callbacks' state, then load the checkpoint to resume from (if
        any) into it; returns the step to continue after (0: a fresh run) and the MLflow run the
        checkpoint names (None: a new one)."""
        self.method.on_train_start(self.env.device, self.env.data_world)  # draws per global sample: SP ranks draw alike
        self.callbacks.on_train_start(self.ctx)
        path = self.ckpt.resume_path(self.config.training.checkpoint.resume)
        if path is None:
            return 0, None
        # verified by resume_path; a rank the checkpoint has no RNG file for gets rank 0's
        meta = self.ckpt.load(path, self._payload())
        self.method.load_host_state(meta.pop("method_host_state", None))
        self._refresh_compute_weights(list(self.method.optimizers))
        log.info("resumed from %s at step %d", path, self.step)
        return self.step, meta.get("mlflow_run_id")

    def _result(self, start: int) -> TrainResult:
        """What this invocation trained; also written as ``run_summary.json``. A rerun of a
        finished (or callback-stopped) run trains nothing and returns its newest checkpoint. A checkpoint a callback
        selected (:class:`~distillery.callbacks.base.RunControl`) is the run's checkpoint instead, said once."""
        checkpoint = self.saved
        if checkpoint is None and (start == self.loop.max_train_steps or self.ctx.control.stop):
            checkpoint = self.ckpt.resume_path("latest")
        selection = self.ctx.control.selection
        if selection is not None:
            chosen = selection.get("checkpoint")
            checkpoint = Path(self.config.training.checkpoint.output_dir) / chosen if chosen else None
            log.info("the run's checkpoint: %s (%s)", chosen or "none", selection.get("reason", ""))
        result = TrainResult(self.step, checkpoint, self.logger.history, self.logger.run_id)
        self.logger.write_summary(self.step, checkpoint, self.config.method.target, self.method.sampling_contract(),
                                  selection)
        return result

    @contextlib.contextmanager
    def _output_lock(self) -> Iterator[None]:
        """Rank 0 holds ``<output_dir>/.lock``; every rank learns whether it got it (no rank hangs)."""
        out = Path(self.config.training.checkpoint.output_dir)
        with contextlib.ExitStack() as stack:
            problem = None
            if self.env.is_main:
                try:
                    stack.enter_context(exclusive_lock(out / ".lock", f"training output folder {out}"))
                except UserError as exc:
                    problem = str(exc)
            problem = broadcast_object(problem)
            if problem:
                raise UserError(problem)
            yield
