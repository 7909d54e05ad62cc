"""The training loop: gradient accumulation, callbacks, one host sync per step, checkpoints.

``Trainer(config, env).fit()`` trains ``training.loop.max_train_steps`` optimizer steps,
resuming from the newest checkpoint in ``training.checkpoint.output_dir`` when one exists
(``resume: latest``), and returns a :class:`TrainResult`.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distillery.callbacks.base import CallbackContext
from distillery.common.errors import UserError
from distillery.common.fsutil import write_text_atomic
from distillery.common.log import get_logger, quiet_library_progress
from distillery.common.procutil import exclusive_lock
from distillery.common.progress import Progress
from distillery.components.checkpoint.manager import METHOD_HOST_KEY, CheckpointManager, CheckpointPayload, capture_rng, list_checkpoints
from distillery.components.checkpoint.stateful import CallbackState, ScalarState
from distillery.components.distributed import DistEnv, all_reduce_mean, broadcast_object
from distillery.components.timing import summarize_step_times
from distillery.components.tracking import build_tracker
from distillery.config.loader import dump_run_config
from distillery.config.schema import RunConfig
from distillery.data import LatentBatchLoader, LatentDataset, ShardedBatchSampler, pad_prompt_embedding, read_empty_prompt_embedding
from distillery.engine.builder import build_run, check_data_path, check_output_dir, seed_everything

log = get_logger("trainer")


class NonFiniteError(UserError):
    """A loss or gradient norm became NaN/Inf: training stops at that step, nothing after the last
    good checkpoint is saved (a rerun resumes from it)."""


@dataclass
class PendingMetrics:
    """One step's metrics on their way to the host (see :meth:`Trainer._stage_metrics`)."""

    step: int
    names: list[str]
    values: torch.Tensor | None  # [len(names)] fp32 on the host once ``event`` has completed
    event: Any  # torch.cuda.Event, or None on CPU (values are ready)
    started: float  # perf_counter() when the step began
    learning_rates: dict[str, float]  # per role, after the step's schedule update
    gpu_started: Any = None  # torch.cuda.Event recorded in the stream when the step was launched (CUDA only)


@dataclass
class TrainResult:
    final_step: int
    checkpoint: Path | None
    history: list[dict[str, float]] = field(default_factory=list)  # per logged step: metrics
    mlflow_run_id: str | None = None


class Trainer:
    def __init__(self, config: RunConfig, env: DistEnv) -> None:
        quiet_library_progress()
        self.config = config
        self.env = env
        t = config.training
        check_output_dir(t.checkpoint.output_dir)  # a plain mistake (a file, /dev/null) before any model is loaded
        seed_everything(t.loop.seed)
        self.run = build_run(config, env)
        self.method = self.run.method
        data_root = check_data_path(t.data.path)
        # the data the method declared: collated latent batches, or prompt embeddings only
        dataset = LatentDataset(data_root, t.data.split, with_latents=self.method.data_kind == "latents")
        sampler = ShardedBatchSampler(len(dataset), t.data.batch_size, env.rank, env.world_size, t.loop.seed, t.data.drop_last)
        # on CUDA, batches are collated into page-locked memory: their copy to the GPU does not wait for queued work
        self.loader = LatentBatchLoader(dataset, sampler, t.data.text_max_length, pin_memory=env.device.type == "cuda")
        empty = read_empty_prompt_embedding(data_root)
        self.empty_text = pad_prompt_embedding(empty, t.data.text_max_length) if empty is not None else None
        if self.empty_text is not None:  # constant: on the device once, not copied every step
            self.empty_text = self.empty_text.to(env.device, torch.float32)
        self.ctx = CallbackContext(roles=self.run.models, rank=env.rank, world_size=env.world_size,
                                   max_train_steps=t.loop.max_train_steps, roles_to_step=self.method.roles_to_step,
                                   sampling=self.method.sampling_contract())
        self.step = 0  # the last completed optimizer step (what a checkpoint records)
        # frozen roles' sources (path + sha256 of their weights), hashed once on rank 0
        self.frozen_sources = broadcast_object(self.method.frozen_sources() if env.is_main else None)
        self.ckpt = CheckpointManager(t.checkpoint.output_dir, t.checkpoint.keep_last, env.rank, env.world_size)
        self.samples_per_step = t.data.batch_size * t.loop.grad_accum_steps * env.world_size

    # -- checkpoint payload ---------------------------------------------------------------
    def _trainer_position(self) -> dict[str, int]:
        return {"step": self.step, **{f"data_{k}": int(v) for k, v in self.loader.state_dict().items()}}

    def _set_trainer_position(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.loader.load_state_dict({k[len("data_"):]: v for k, v in state.items() if k.startswith("data_")})

    def _payload(self) -> CheckpointPayload:
        """The method's state (roles, optimizers, schedulers, its own), the trainer's position and
        the callbacks' tensors — all DCP — plus this rank's process RNGs and the metadata."""
        dcp_state: dict[str, Any] = dict(self.method.checkpoint_state())
        dcp_state["trainer"] = ScalarState(self._trainer_position, self._set_trainer_position)
        for cb in self.run.callbacks:
            if cb.state_dict():
                dcp_state[f"callbacks.{cb.name}"] = CallbackState(cb)
        role_configs = {role: model.transformer_config() for role, model in self.run.models.items() if model.trainable}
        run_id = getattr(self, "tracker", None) and self.tracker.run_id
        meta = {"method": self.config.method.target, "mlflow_run_id": run_id}
        host = capture_rng()
        method_host = self.method.host_state()
        if method_host is not None:
            host[METHOD_HOST_KEY] = method_host
        return CheckpointPayload(dcp_state, host, role_configs, self.frozen_sources, meta)

    def _resume(self) -> tuple[int, str | None]:
        path = self.ckpt.resume_path(self.config.training.checkpoint.resume)
        if path is None:
            return 0, None
        # verified by resume_path; a rank the checkpoint has no RNG file for gets rank 0's
        meta = self.ckpt.load(path, self._payload())
        self.method.load_host_state(meta.pop("method_host_state", None))
        self._refresh_compute_weights(list(self.method.optimizers))
        log.info("resumed from %s at step %d", path, self.step)
        return self.step, meta.get("mlflow_run_id")

    def _refresh_compute_weights(self, roles: list[str]) -> None:
        """Rewrite the compute copies of ``roles`` (those whose master weights changed)."""
        for role in roles:
            self.run.models[role].refresh_compute_weights()

    # -- one optimizer step -----------------------------------------------------------------
    def _next_batch(self) -> dict[str, Any]:
        batch = next(self.loader)
        if self.empty_text is not None:
            batch["empty_text_embeds"] = self.empty_text
        return batch

    def _train_step(self, step: int) -> dict[str, torch.Tensor]:
        accum = self.config.training.loop.grad_accum_steps
        sums: dict[str, torch.Tensor] = {}
        for micro in range(accum):
            self._set_gradient_sync(micro == accum - 1)  # FSDP2: reduce gradients once, after the last micro-batch
            out = self.method.single_train_step(self._next_batch(), step)
            self.method.backward(out, grad_accum_rounds=accum)
            for model in self.run.models.values():
                model.collect_grads()
            for k, v in {**out.losses, **out.metrics}.items():
                sums[k] = sums.get(k, 0) + v.detach().float() / accum
        for cb in self.run.callbacks:
            sums.update(cb.on_before_optimizer_step(self.ctx, step))
        if self.config.training.loop.skip_nonfinite_steps and not self._all_finite(sums):
            self.skipped_nonfinite += 1
            if self.skipped_nonfinite > self.config.training.loop.skip_nonfinite_steps:
                raise NonFiniteError(self._nonfinite_message(step, sums, f"more than training.loop.skip_nonfinite_steps="
                                                                       f"{self.config.training.loop.skip_nonfinite_steps} such steps"))
            log.warning("step %d: non-finite loss or gradient; skipped without an update (%d of %d allowed)", step,
                        self.skipped_nonfinite, self.config.training.loop.skip_nonfinite_steps)
            self.method.zero_grad(step)  # no update: the weights stay those of the last good step
            return {"skipped_nonfinite": torch.ones(())}  # the step's non-finite values are not logged
        stepped = self.method.roles_to_step(step)
        self.method.optimizers_step(step)
        self.method.zero_grad(step)
        self._refresh_compute_weights(stepped)  # a role that did not step keeps its compute copy
        for cb in self.run.callbacks:
            sums.update(cb.on_training_step_end(self.ctx, step))
        return sums

    def _set_gradient_sync(self, enabled: bool) -> None:
        """FSDP2 modules of trainable roles reduce-scatter gradients only when ``enabled`` (the last
        micro-batch of an accumulation; the others accumulate unsharded gradients locally)."""
        if self.config.training.loop.grad_accum_steps == 1:
            return
        from torch.distributed.fsdp import FSDPModule

        for model in self.run.models.values():
            if model.trainable:
                for module in model.trainable_modules().values():
                    if isinstance(module, FSDPModule):
                        module.set_requires_gradient_sync(enabled)

    def _all_finite(self, tensors: dict[str, torch.Tensor]) -> bool:
        """One host sync: are this step's losses and grad norms finite on every rank?"""
        if not tensors:
            return True
        stacked = torch.stack([t.to(self.env.device, torch.float32).reshape(()) for t in tensors.values()])
        return bool(torch.isfinite(all_reduce_mean(stacked)).all().item())

    def _nonfinite_message(self, step: int, metrics: dict[str, Any], why: str = "") -> str:
        bad = [f"{k}={float(v):g}" for k, v in sorted(metrics.items()) if not math.isfinite(float(v))]
        found = next(reversed(list_checkpoints(Path(self.config.training.checkpoint.output_dir))), (None, None))[1]
        keep = f"the last good checkpoint is {found}" if found else "no checkpoint was written yet"
        return (f"training diverged at step {step}: {', '.join(bad) or 'a non-finite value'}{' (' + why + ')' if why else ''}; "
                f"stopped without saving; {keep}; lower training.optimizer.learning_rate (or allow "
                f"training.loop.skip_nonfinite_steps) and rerun")

    def _gpu_mark(self) -> Any:
        """A timing CUDA event recorded now in the current stream (None on CPU): where a step's work
        begins on the GPU timeline, whatever the host is doing."""
        if self.env.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _stage_metrics(self, step: int, tensors: dict[str, torch.Tensor], started: float,
                       gpu_started: Any = None) -> PendingMetrics:
        """Queue the step's one device→host copy: stack, average over ranks, copy without waiting."""
        names = sorted(tensors)
        values = None
        if names:
            stacked = torch.stack([tensors[n].to(self.env.device, torch.float32).reshape(()) for n in names])
            values = all_reduce_mean(stacked).to("cpu", non_blocking=True)
        event = None
        if self.env.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=gpu_started is not None)
            event.record()
        return PendingMetrics(step, names, values, event, started, self.method.learning_rates(), gpu_started)

    def _read_metrics(self, pending: PendingMetrics, finished: float) -> dict[str, float]:
        """The step's host sync: wait for its copied metrics. ``finished``: when the next step
        started (or now, for a step nothing follows), so ``step_time_s`` is the step's share of
        wall time. On CUDA, ``gpu_step_time_s`` is the step's span on the GPU timeline (CUDA events
        around its queued work): unlike the host interval it does not shift with where the host
        happened to wait, so a step's own cost reads right even on the first steps."""
        if pending.event is not None:
            pending.event.synchronize()
        metrics = dict(zip(pending.names, pending.values.tolist())) if pending.values is not None else {}
        elapsed = max(finished - pending.started, 1e-9)
        metrics.update({"step_time_s": elapsed, "samples_per_s": self.samples_per_step / elapsed})
        if pending.gpu_started is not None:
            metrics["gpu_step_time_s"] = pending.gpu_started.elapsed_time(pending.event) / 1000.0
        metrics.update({f"lr/{role}": lr for role, lr in pending.learning_rates.items()})
        return metrics

    # -- the per-step log (rank 0): <output_dir>/train_log.jsonl, one JSON object per logged step --
    @property
    def log_path(self) -> Path:
        return Path(self.config.training.checkpoint.output_dir) / "train_log.jsonl"

    def _append_log(self, row: dict[str, float]) -> None:
        if self.env.is_main:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")

    def _trim_log(self, start_step: int) -> None:
        """Drop rows past the resumed step (left by a run killed after its last checkpoint)."""
        if self.env.is_main and self.log_path.is_file():
            rows = [line for line in self.log_path.read_text().splitlines() if line.strip()]
            kept = [line for line in rows if json.loads(line)["step"] <= start_step]
            self.log_path.write_text("".join(line + "\n" for line in kept))

    def _catch_up_tracker(self, start_step: int) -> None:
        """A resumed run: log to MLflow the checkpointed steps it does not have yet (a kill right
        after a checkpoint, before its rows reached MLflow), from train_log.jsonl."""
        if not self.log_path.is_file():
            return
        rows = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r["step"] <= start_step]
        if not rows:
            return
        key = next((k for k in rows[-1] if k != "step"), None)
        last = self.tracker.last_logged_step(key) if key else None
        for r in rows:
            if last is None or r["step"] > last:
                self.tracker.log_metrics({k: v for k, v in r.items() if k != "step"}, int(r["step"]))

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train to ``max_train_steps`` holding the output folder's writer lock (one writer per folder)."""
        with contextlib.ExitStack() as stack:
            self._lock_output(stack)
            return self._fit()

    def _lock_output(self, stack: contextlib.ExitStack) -> None:
        """Rank 0 takes ``<output_dir>/.lock``; every rank learns whether it got it (no rank hangs)."""
        out = Path(self.config.training.checkpoint.output_dir)
        problem = None
        if self.env.is_main:
            try:
                stack.enter_context(exclusive_lock(out / ".lock", f"training output folder {out}"))
            except UserError as exc:
                problem = str(exc)
        problem = broadcast_object(problem)
        if problem:
            raise UserError(problem)

    def _fit(self) -> TrainResult:
        t = self.config.training
        self.skipped_nonfinite = 0
        self.method.on_train_start(self.env.device, self.env.world_size)
        for cb in self.run.callbacks:
            cb.on_train_start(self.ctx)
        self.tracker = None
        start_step, run_id = self._resume()
        self._trim_log(start_step)
        self.tracker = build_tracker(t.tracker, self.env.is_main, run_id)
        self.ctx.tracker = self.tracker
        if start_step == 0:
            self.tracker.log_params(self.config.to_plain())
            self.tracker.log_text(dump_run_config(self.config), "config.yaml")
        else:
            self._catch_up_tracker(start_step)
        result = TrainResult(final_step=start_step, checkpoint=None, mlflow_run_id=self.tracker.run_id)
        for cb in self.run.callbacks:
            cb.on_loop_start(self.ctx, start_step)
        # rank 0: a bar on a terminal, else a log line per 10 % / minute (never a flood in DVC's or Prefect's logs)
        bar = Progress(t.loop.max_train_steps, "train", "step", initial=start_step,
                       enabled=self.env.is_main and t.loop.progress_bar and start_step < t.loop.max_train_steps)
        status = "FAILED"
        pending: PendingMetrics | None = None
        # MLflow gets a step's metrics once a checkpoint covers it, so a killed run's history never
        # holds steps its resume redoes (train_log.jsonl has them at once and is trimmed on resume).
        unflushed: list[tuple[int, dict[str, float]]] = []

        def flush_tracker() -> None:
            for logged_step, logged in unflushed:
                self.tracker.log_metrics(logged, logged_step)
            unflushed.clear()

        def finish(row: PendingMetrics, finished: float) -> None:
            metrics = self._read_metrics(row, finished)
            values = {k: v for k, v in metrics.items() if k in row.names}
            if not all(math.isfinite(v) for v in values.values()):  # before any checkpoint of this step or later
                raise NonFiniteError(self._nonfinite_message(row.step, values))
            if row.step % t.loop.log_every == 0 or row.step == t.loop.max_train_steps:
                unflushed.append((row.step, metrics))
                result.history.append({"step": row.step, **metrics})
                self._append_log({"step": row.step, **metrics})
            bar.update(1, loss=metrics.get("total_loss", float("nan")))

        try:
            # Step N's metrics are read after step N+1 is launched, so the device never idles
            # while the host reads them; a checkpoint or the end of the run reads them at once.
            for step in range(start_step + 1, t.loop.max_train_steps + 1):
                started = time.perf_counter()
                gpu_started = self._gpu_mark()
                tensors = self._train_step(step)
                self.step = step
                if pending is not None:
                    finish(pending, started)
                pending = self._stage_metrics(step, tensors, started, gpu_started)
                result.final_step = step
                every = t.checkpoint.save_every
                stopping = step == t.loop.stop_at_step
                saving = (every and step % every == 0) or stopping or (step == t.loop.max_train_steps and t.checkpoint.save_final)
                if saving or step == t.loop.max_train_steps:
                    finish(pending, time.perf_counter())
                    pending = None
                if saving:
                    result.checkpoint = self.ckpt.save(step, self._payload())
                    flush_tracker()
                if stopping:
                    log.info("stopping at step %d as asked (training.loop.stop_at_step); rerun to continue", step)
                    break
            flush_tracker()
            for cb in self.run.callbacks:
                cb.on_train_end(self.ctx, result.final_step)
            status = "FINISHED"
        finally:
            bar.close()
            self.tracker.finish(status if status == "FINISHED" else "KILLED")
        if result.checkpoint is None and start_step == t.loop.max_train_steps:
            found = self.ckpt.resume_path("latest")
            result.checkpoint = found
        self._write_run_summary(result)
        return result

    # -- the run's public summary (rank 0): <output_dir>/run_summary.json ----------------------
    def _write_run_summary(self, result: TrainResult) -> None:
        """What a pipeline stage needs from a finished invocation, so it never parses logs or
        checkpoint internals: ``format``, ``final_step``, ``checkpoint`` (folder name in the output
        dir, or null), ``mlflow_run_id``, ``method`` (its ``_target_``), ``last_metrics`` (the last
        logged row), ``loss`` (``[{"step", "loss"}]``: total_loss of every logged step of the run,
        resumed parts included), ``sampling`` (the method's sampling contract) and ``timing`` (this
        invocation's step times without its warm-up steps: :func:`summarize_step_times`, or null)."""
        if not self.env.is_main:
            return
        rows = []
        if self.log_path.is_file():
            rows = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]
        summary = {
            "format": 1,
            "final_step": result.final_step,
            "checkpoint": result.checkpoint.name if result.checkpoint is not None else None,
            "mlflow_run_id": result.mlflow_run_id,
            "method": self.config.method.target,
            "last_metrics": {k: v for k, v in rows[-1].items() if k != "step"} if rows else {},
            "loss": [{"step": r["step"], "loss": r["total_loss"]} for r in rows if "total_loss" in r],
            "sampling": self.method.sampling_contract(),
            "timing": summarize_step_times(result.history),  # this invocation's steady steps, warm-up dropped
        }
        write_text_atomic(Path(self.config.training.checkpoint.output_dir) / "run_summary.json", json.dumps(summary, indent=2))
