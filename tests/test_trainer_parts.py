"""The objects the trainer is assembled from, each on its own: the callback list, the one-step-late
metric pipe (and its wiring in a real trainer run: read once the next step has run) and the run
logger (JSONL + MLflow across a kill and a resume)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_config

from distillery.callbacks.base import Callback, CallbackContext, CallbackList


class Recording(Callback):
    """Appends ``(name, hook, step)`` to a shared list and returns ``metrics`` from the metric hooks."""

    def __init__(self, name: str, calls: list, metrics: dict[str, float], state: dict | None = None) -> None:
        super().__init__(None, name)
        self.calls, self.metrics, self.state = calls, metrics, state or {}

    def on_train_start(self, ctx):
        self.calls.append((self.name, "train_start", None))

    def on_loop_start(self, ctx, step):
        self.calls.append((self.name, "loop_start", step))

    def on_before_optimizer_step(self, ctx, step):
        self.calls.append((self.name, "before_optimizer_step", step))
        return {k: torch.tensor(v) for k, v in self.metrics.items()}

    def on_training_step_end(self, ctx, step):
        self.calls.append((self.name, "training_step_end", step))
        return {f"end/{k}": torch.tensor(v) for k, v in self.metrics.items()}

    def on_train_end(self, ctx, step):
        self.calls.append((self.name, "train_end", step))

    def state_dict(self):
        return self.state


def test_callback_list_calls_every_callback_in_order_and_merges_their_metrics():
    calls: list = []
    first = Recording("a", calls, {"grad_norm/student": 1.0, "shared": 1.0}, state={"x": torch.zeros(1)})
    second = Recording("b", calls, {"shared": 2.0})
    callbacks = CallbackList([first, second])
    ctx = CallbackContext(roles={}, rank=0, world_size=1, max_train_steps=3)
    callbacks.on_train_start(ctx)
    callbacks.on_loop_start(ctx, 0)
    before = callbacks.on_before_optimizer_step(ctx, 1)
    end = callbacks.on_training_step_end(ctx, 1)
    callbacks.on_train_end(ctx, 1)
    assert calls == [(n, hook, step) for hook, step in [("train_start", None), ("loop_start", 0), ("before_optimizer_step", 1),
                                                         ("training_step_end", 1), ("train_end", 1)] for n in ("a", "b")]
    assert {k: float(v) for k, v in before.items()} == {"grad_norm/student": 1.0, "shared": 2.0}  # the later callback wins
    assert {k: float(v) for k, v in end.items()} == {"end/grad_norm/student": 1.0, "end/shared": 2.0}
    assert callbacks.stateful() == {"callbacks.a": first}  # only callbacks with tensors to checkpoint
    assert list(callbacks) == [first, second] and len(CallbackList()) == 0


def test_step_metrics_are_read_one_step_late_with_the_step_s_own_timing():
    from distillery.engine.step_metrics import StepMetrics

    pipe = StepMetrics(torch.device("cpu"), samples_per_step=8, learning_rates=lambda: {"student": 0.5})
    assert pipe.read() is None  # nothing pending
    clock = pipe.clock()
    pipe.stage(1, {"total_loss": torch.tensor(2.0), "a": torch.tensor(1.0)}, clock)
    row = pipe.read(finished=clock.started + 2.0)
    assert row.step == 1 and row.values == {"a": 1.0, "total_loss": 2.0}
    assert row.metrics == {"a": 1.0, "total_loss": 2.0, "step_time_s": 2.0, "samples_per_s": 4.0, "lr/student": 0.5}
    assert pipe.read() is None  # read once


class LogWatcher(Callback):
    """Records, when each step's work has run (forward and backward done, before its optimizer step),
    how many steps the trainer had read and logged by then (rows of ``train_log.jsonl``)."""

    def __init__(self, log_path) -> None:
        super().__init__(None, "watcher")
        self.log_path, self.logged_before = log_path, {}

    def on_before_optimizer_step(self, ctx, step):
        rows = self.log_path.read_text().splitlines() if self.log_path.is_file() else []
        self.logged_before[step] = [json.loads(r)["step"] for r in rows]
        return {}


def test_the_trainer_reads_a_step_s_metrics_once_the_next_step_has_run_or_at_once_to_save_or_end(tmp_path, tiny_base, latent_set):
    """A real trainer on the tiny Wan: step N's metrics are read (the step's one device→host sync) only
    after step N+1's forward and backward were issued, so the device never idles while the host
    waits — except a checkpoint's step and the last, read at once. An every-step read logs step N
    before step N+1 runs and fails here."""
    from distillery.components.distributed import init_distributed, shutdown
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.assemble import build_trainer

    config = load_run_config(raw=run_config(tiny_base, latent_set, tmp_path / "run", steps=6, save_every=3), prefixes=allowed_prefixes())
    env = init_distributed(config.training.distributed)
    try:
        trainer = build_trainer(config, env)
        watcher = LogWatcher(trainer.logger.log_path)
        trainer.callbacks.append(watcher)
        result = trainer.fit()
    finally:
        shutdown()
    assert watcher.logged_before == {1: [], 2: [], 3: [1], 4: [1, 2, 3], 5: [1, 2, 3], 6: [1, 2, 3, 4]}
    assert [row["step"] for row in result.history] == [1, 2, 3, 4, 5, 6]  # each step read once, in order


@pytest.fixture
def logger_run(tmp_path, tiny_base, latent_set):
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.run_log import RunLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_run_config(raw=run_config(tiny_base, latent_set, tmp_path / "run", steps=6, tracker="mlflow", tracking_uri=uri),
                             prefixes=allowed_prefixes())
    t = config.training

    def make() -> RunLogger:
        return RunLogger(t.checkpoint.output_dir, t.tracker, t.loop, is_main=True)

    return config, make, uri


def test_run_logger_logs_each_step_once_across_a_kill_after_a_checkpoint(tmp_path, logger_run):
    """A run checkpointed at step 4 and killed while step 5 was logged: MLflow had steps 1-2 only
    (4 was saved, not yet flushed), the JSONL 1-5. The resume at step 4 trims the JSONL to 1-4 and
    catches MLflow up with 3-4; after it, both hold steps 1-6 exactly once."""
    from mlflow.tracking import MlflowClient

    config, make, uri = logger_run
    first = make()
    with pytest.raises(KeyboardInterrupt), first.session(0, None, config):
        for step in range(1, 6):
            first.log_step(step, {"total_loss": float(step)})
            if step == 2:
                first.flush()  # checkpoint-2 covers steps 1-2
        raise KeyboardInterrupt  # killed after checkpoint-4 was written, before its flush
    client = MlflowClient(tracking_uri=uri)
    run_id = first.run_id
    assert client.get_run(run_id).info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(run_id, "total_loss")] == [1, 2]

    second = make()
    with second.session(4, run_id, config):
        assert [json.loads(line)["step"] for line in second.log_path.read_text().splitlines()] == [1, 2, 3, 4]
        for step in (5, 6):
            second.log_step(step, {"total_loss": float(step)})
        second.flush()
    assert second.run_id == run_id and client.get_run(run_id).info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "total_loss"))
    assert history == [(s, float(s)) for s in range(1, 7)]
    assert [json.loads(line) for line in second.log_path.read_text().splitlines()] == \
        [{"step": s, "total_loss": float(s)} for s in range(1, 7)]
    assert second.history == [{"step": 5, "total_loss": 5.0}, {"step": 6, "total_loss": 6.0}]  # this invocation's rows

    second.write_summary(6, tmp_path / "run" / "checkpoint-6", "m.M", {"sampler": "euler"})
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["loss"] == [{"step": s, "loss": float(s)} for s in range(1, 7)]
    assert (summary["final_step"], summary["checkpoint"], summary["mlflow_run_id"]) == (6, "checkpoint-6", run_id)
    assert summary["last_metrics"] == {"total_loss": 6.0} and summary["timing"] is None  # no step times in these rows
