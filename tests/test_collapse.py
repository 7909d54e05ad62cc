"""Training that notices collapse (src/distillery/callbacks/collapse.py), with a collapse injected on purpose.

DMD2 on the tiny Wan (tests/plugins/lr_jump.py: the generator's learning rate ×100 after step 6), the collapse watch
checking every 2 steps against the teacher's samples: the student's samples lose their diversity within a few steps of
the jump; the run stops at the collapse, and the checkpoint ``run_summary.json`` names — what a stage publishes — is
the best healthy one from before the jump, said in the log and in ``selection``; the watch's measures sit beside the
loss in the step log and in MLflow; a rerun stays stopped. A run without the jump is not stopped. The measures
themselves are checked on made-up videos.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from helpers import plugins_allowed, read_log, run_config, train_in_process

from distillery.callbacks.collapse import CollapseWatchCallback, CollapseWatchConfig, video_metrics

JUMP, STEPS, EVERY = 6, 20, 2


def test_the_measures_on_made_up_videos():
    g = torch.Generator().manual_seed(0)
    videos = torch.rand(4, 3, 5, 8, 8, generator=g) * 1.6 - 0.8  # 2 seeds × 2 prompts, inside the range
    plain = video_metrics(videos, 2, None)
    assert plain["saturation"] == 0.0 and plain["diversity"] > 0 and plain["motion"] > 0 and math.isnan(plain["teacher_distance"])
    clipped = videos.clone()
    clipped[0, :, :, :4] = 3.0  # half of one video's rows beyond the range
    assert video_metrics(clipped, 2, None)["saturation"] == pytest.approx(0.5 / 4)
    same = videos[:2].repeat(2, 1, 1, 1, 1)  # both seeds alike: no diversity
    assert video_metrics(same, 2, None)["diversity"] == 0.0
    still = videos[:, :, :1].expand(-1, -1, 5, -1, -1)  # one frame held: no motion
    assert video_metrics(still, 2, None)["motion"] == 0.0
    assert video_metrics(videos, 2, videos.clamp(-1, 1))["teacher_distance"] == 0.0


def test_the_rule_against_the_baseline(tiny_base, latent_set):
    watch = CollapseWatchCallback(CollapseWatchConfig(data_path=str(latent_set), vae_from=str(tiny_base)), "collapse")
    watch.baseline = torch.tensor([0.01, 0.2, 0.1, 0.05], dtype=torch.float64)
    ok = {"saturation": 0.05, "diversity": 0.11, "motion": 0.06, "teacher_distance": 0.09}
    assert watch.alarms(ok) == []
    bad = {"saturation": 0.07, "diversity": 0.09, "motion": 0.04, "teacher_distance": 0.11}
    assert [a.split()[0] for a in watch.alarms(bad)] == ["saturation", "diversity", "motion", "teacher"]


def _config(base: Path, data: Path, out: Path, jump_factor: float, uri: str | None = None) -> dict:
    cfg = run_config(base, data, out, method="lr_jump.LRJumpDMD2", steps=STEPS, batch_size=4, lr=1e-4, save_every=0,
                     tracker="mlflow" if uri else "none", tracking_uri=uri,
                     method_knobs={"jump_step": JUMP, "jump_factor": jump_factor, "generator_update_interval": 1,
                                   "real_score_guidance_scale": 2.0})
    cfg["training"]["checkpoint"]["keep_last"] = 1  # the selected checkpoint is kept all the same
    wan = "distillery.models.wan.WanModel"
    cfg["models"]["teacher"] = {"_target_": wan, "init_from": str(base), "trainable": False}
    cfg["models"]["critic"] = {"_target_": wan, "init_from": str(base)}
    cfg["callbacks"] = {"collapse": {"_target_": "distillery.callbacks.collapse.CollapseWatchCallback", "data_path": str(data),
                                     "vae_from": str(base), "every_steps": EVERY, "teacher": "teacher", "teacher_steps": 8,
                                     "text_max_length": 8}}
    return cfg


@pytest.fixture(scope="module")
def collapsed(tmp_path_factory, tiny_base, latent_set):
    root = tmp_path_factory.mktemp("collapse")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    cfg = _config(tiny_base, latent_set, root / "run", 100.0, uri)
    handler, logger = _Lines(), logging.getLogger("distillery")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # as the CLI's rank 0 logs
    try:
        with plugins_allowed("lr_jump"):
            first = train_in_process(cfg)
            again = train_in_process(cfg)  # a rerun of the stopped run
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {"root": root, "uri": uri, "first": first, "again": again, "lines": handler.lines}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_an_injected_collapse_stops_the_run_and_the_pre_collapse_best_is_the_runs_checkpoint(collapsed):
    run = collapsed["root"] / "run"
    summary = json.loads((run / "run_summary.json").read_text())
    selection = summary["selection"]
    stop = selection["collapse_step"]
    assert JUMP < stop < STEPS and summary["final_step"] == stop == collapsed["first"].final_step, "stopped at the collapse"
    best = selection["step"]
    assert 0 < best <= JUMP and best % EVERY == 0, "the best is a healthy check from before the jump"
    assert summary["checkpoint"] == selection["checkpoint"] == f"checkpoint-{best}" and (run / f"checkpoint-{best}").is_dir()
    assert collapsed["first"].checkpoint == run / f"checkpoint-{best}"
    assert "nearest the teacher's samples" in selection["reason"] and f"collapse at step {stop}: diversity" in selection["reason"]
    assert any(f"stopping at step {stop}: collapse at step {stop}" in line for line in collapsed["lines"])
    assert any(f"the run's checkpoint: checkpoint-{best}" in line for line in collapsed["lines"])
    assert (run / f"checkpoint-{stop}").is_dir()  # the stop's own checkpoint (keep_last 1 pruned the others)
    assert sorted(p.name for p in run.glob("checkpoint-*")) == sorted({f"checkpoint-{best}", f"checkpoint-{stop}"})


def test_the_measures_are_logged_beside_the_loss(collapsed):
    from mlflow.tracking import MlflowClient

    run = collapsed["root"] / "run"
    rows = [r for r in read_log(run) if "collapse/diversity" in r]
    assert [r["step"] for r in rows] == list(range(EVERY, collapsed["first"].final_step + 1, EVERY))
    assert all("total_loss" in r and "collapse/teacher_distance" in r for r in rows)
    client = MlflowClient(tracking_uri=collapsed["uri"])
    run_id = json.loads((run / "run_summary.json").read_text())["mlflow_run_id"]
    assert [m.step for m in client.get_metric_history(run_id, "collapse/diversity")] == [r["step"] for r in rows]


def test_a_rerun_of_a_stopped_run_stays_stopped(collapsed):
    again = collapsed["again"]
    assert again.final_step == collapsed["first"].final_step and again.checkpoint == collapsed["first"].checkpoint
    assert any("not training past step" in line for line in collapsed["lines"])


def test_a_healthy_run_is_not_stopped(tmp_path, tiny_base, latent_set):
    cfg = _config(tiny_base, latent_set, tmp_path / "run", 1.0)
    cfg["training"]["loop"]["max_train_steps"] = 8
    with plugins_allowed("lr_jump"):
        result = train_in_process(cfg)
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert result.final_step == 8 and summary["selection"]["collapse_step"] is None
    assert summary["checkpoint"] == summary["selection"]["checkpoint"]
