"""DiffusionNFT through the real trainer (``build_trainer(config, env).fit()``, what ``distillery.cli.train`` runs):

- 1 rank × 2 prompts and 2 ranks × 1 prompt (torchrun, gloo, FSDP2) sample, score and train the same global rollout
  groups: the same rewards and losses at every step;
- a 2-rank run stopped in the middle of a rollout group (after step 2 of its 3 updates) resumes from its checkpoint
  to bitwise the weights, optimizer state, old policy and EMA of the uninterrupted 2-rank run, through the next
  group (whose old policy moved toward the student after the resume);
- grad clipping, EMA, validation (sampling the student by its contract and scoring it with the analyzer) and the run
  log work through the method's own cadence: a rollout step logs the group's rewards, every step its losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import dcp_tensors, read_log, train_in_process
from test_clip_scores import make_clip_folder
from test_nft import grammar_set, nft_config  # noqa: F401  (the module fixture and the config builder)
from torchrun_each import torchrun_each

from distillery.tinybase.shipped import shipped_tiny_base

pytestmark = pytest.mark.slow
STEPS, STOP = 5, 2  # groups of 3 updates: group 1 at steps 1–3 (stopped after 2), group 2 from step 4


def _config(data: Path, out: Path, batch_size: int, clip: Path, validation: bool = False, **kw) -> dict:
    """Two rewards: the analyzer's adherence (a group of rollouts often scores all alike on it: no advantage) and CLIP
    text–video similarity with a tiny random CLIP (continuous: every group ranks its rollouts)."""
    callbacks = {"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0},
                 "ema": {"_target_": "distillery.callbacks.ema.EMACallback", "decay": 0.9}}
    if validation:
        callbacks["validation"] = {"_target_": "distillery.callbacks.validation.ValidationCallback", "data_path": str(data),
                                   "split": "train", "num_prompts": 2, "every_steps": 3, "text_max_length": 32,
                                   "vae_from": str(shipped_tiny_base()), "scorer": "distillery.clips.analyzer.folder_scorer"}
    rewards = {"adherence": {"_target_": "distillery.rewards.adherence.AdherenceReward", "folder": str(shipped_tiny_base())},
               "clip": {"_target_": "distillery.rewards.clip.ClipTextReward", "model_from": str(clip), "weight": 2.0}}
    return nft_config(data, out, batch_size=batch_size, steps=STEPS, save_every=1, callbacks=callbacks, rewards=rewards, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, grammar_set):  # noqa: F811
    root = tmp_path_factory.mktemp("nft-runs")
    clip = make_clip_folder(root / "clip", 0)
    train_in_process(_config(grammar_set, root / "one", 2, clip, validation=True, tracker="mlflow",  # 1 rank × 2 prompts
                             tracking_uri=f"sqlite:///{root / 'mlflow.db'}"))
    stopped = _config(grammar_set, root / "resumed", 1, clip)
    stopped["training"]["loop"]["stop_at_step"] = STOP
    torchrun_each([(_config(grammar_set, root / "two", 1, clip), root / "two.yaml"),  # 2 ranks × 1 prompt × 3 rollouts
                   (stopped, root / "stopped.yaml"),
                   (_config(grammar_set, root / "resumed", 1, clip), root / "resumed.yaml")])
    return root


def test_two_ranks_sample_score_and_train_what_one_rank_does(runs):
    one, two = read_log(runs / "one"), read_log(runs / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert [r["rollout_group"] for r in one] == [1, 1, 1, 2, 2]
    assert [("reward" in r) for r in one] == [True, False, False, True, False]  # a rollout step logs its group's rewards
    for a, b in zip(two, one):
        assert a.keys() == b.keys()
        for key in ("reward", "reward/adherence", "reward/clip", "reward_group_std", "total_loss", "policy_loss", "kl_loss",
                    "old_deviation", "train_timestep"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert all("grad_norm/student" in r for r in one)
    assert one[3]["old_deviation"] > 0 and one[0]["old_deviation"] == 0.0  # the old policy lags after group 1
    assert one[0]["reward_group_std"] > 0 and one[0]["grad_norm/student"] > 1e-3  # the groups rank their rollouts


def test_a_run_stopped_mid_group_resumes_bit_for_bit(runs):
    ref, got = read_log(runs / "two"), read_log(runs / "resumed")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["total_loss"] for r in got] == [r["total_loss"] for r in ref]
    assert [r.get("reward") for r in got] == [r.get("reward") for r in ref]
    prefixes = ("roles.", "optimizers.", "schedulers.", "shadows.", "method.", "callbacks.")
    a = dcp_tensors(runs / "two" / f"checkpoint-{STEPS}", prefixes)
    b = dcp_tensors(runs / "resumed" / f"checkpoint-{STEPS}", prefixes)
    assert any(k.startswith("shadows.old.") for k in a) and any(k.startswith("shadows.reference.") for k in a)
    assert any(k.startswith("callbacks.ema.") for k in a)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]


def test_validation_and_the_callbacks_run_through_the_cadence(runs):
    import json

    from mlflow.tracking import MlflowClient

    log = read_log(runs / "one")
    assert all(r["grad_norm/student"] > 0 for r in log)
    summary = json.loads((runs / "one" / "run_summary.json").read_text())
    assert summary["sampling"] == nft_config(Path("."), Path("."))["method"]["sampling"]  # the artifact samples as before
    client = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    history = client.get_metric_history(summary["mlflow_run_id"], "val/adherence")
    assert [m.step for m in history] == [0, 3]  # validated at step 0 and every 3 steps, scored by the analyzer
    rewards = client.get_metric_history(summary["mlflow_run_id"], "reward")
    assert [m.step for m in rewards] == [1, 4]
    ema = dcp_tensors(runs / "one" / f"checkpoint-{STEPS}", ("callbacks.ema.student.transformer.",))
    weights = dcp_tensors(runs / "one" / f"checkpoint-{STEPS}", ("roles.student.transformer.",))
    pairs = [(v, weights["roles.student.transformer." + k.split("callbacks.ema.student.transformer.", 1)[1]]) for k, v in ema.items()]
    assert pairs and any(not torch.equal(a, b) for a, b in pairs)  # the average lags the weights
