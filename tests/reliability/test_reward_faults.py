"""Case 8.10 for reward-driven training (DiffusionNFT): a reward that is wrong ends the run in one line, exit code 2,
and loses nothing — a bad reward ``_target_`` and a reward folder that does not load are refused before any step;
a reward returning NaN stops the run at the rollout that got it, its earlier checkpoints intact and nothing after."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_log, write_config
from test_nft import _preference_folder, grammar_set, nft_config  # noqa: F401  (the module fixture)

pytestmark = pytest.mark.process  # each test runs `python -m distillery.cli.train`
PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


def _train(cfg: dict, path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    out = subprocess.run([sys.executable, "-m", "distillery.cli.train", "--config", str(write_config(path, cfg))],
                         capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    return out, [line for line in out.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.reliability(case="8.10", title="bad reward _target_ (DiffusionNFT)",
                         injected="method.rewards.r._target_ names os.system, then a class that is not a reward",
                         expect="exit 2, one line naming method.rewards.r, before any model loads; no output folder")
def test_a_bad_reward_target_is_one_line_before_any_work(tmp_path, grammar_set, data_lost):  # noqa: F811
    for target, why in (("os.system", "outside the allowed prefixes"), ("distillery.methods.sft.SFTMethod", "not a distillery reward")):
        cfg = nft_config(grammar_set, tmp_path / "run", rewards={"r": {"_target_": target}})
        out, errors = _train(cfg, tmp_path / "c.yaml")
        assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert "method.rewards.r" in errors[0] and why in errors[0]
    data_lost.record(int((tmp_path / "run").exists()), "an output folder made for a refused config")


@pytest.mark.reliability(case="8.10", title="reward folder that does not load (DiffusionNFT)",
                         injected="an image-preference reward whose model.safetensors is garbage",
                         expect="exit 2, one line naming the folder; no checkpoint written")
def test_a_reward_folder_that_does_not_load_is_one_line(tmp_path, grammar_set, data_lost):  # noqa: F811
    folder = _preference_folder(tmp_path / "pref")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors")
    cfg = nft_config(grammar_set, tmp_path / "run", rewards={"r": {
        "_target_": "distillery.rewards.preference.ImagePreferenceReward", "model_from": str(folder), "label": "aesthetic"}})
    out, errors = _train(cfg, tmp_path / "c.yaml")
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "does not load" in errors[0] and str(folder) in errors[0]
    data_lost.record(len(list((tmp_path / "run").glob("checkpoint-*"))), "checkpoints of a run that could not start")


@pytest.mark.reliability(case="8.10", title="reward returning NaN (DiffusionNFT)",
                         injected="a reward plugin that scores the first rollout group and returns NaN for the second",
                         expect="exit 2, one line naming the reward and the prompt, at the second group's first step; "
                                "the first group's checkpoints intact, none after")
def test_a_reward_returning_nan_stops_in_one_line_and_keeps_the_checkpoints(tmp_path, grammar_set, data_lost):  # noqa: F811
    cfg = nft_config(grammar_set, tmp_path / "run", steps=6, save_every=1,
                     rewards={"r": {"_target_": "nan_reward.NaNReward", "good_calls": 1}})  # groups of 3 steps
    env = {"PYTHONPATH": f"{PLUGINS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "DISTILLERY_ALLOWED_TARGET_PREFIXES": "nan_reward"}
    out, errors = _train(cfg, tmp_path / "c.yaml", env)
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "reward r returned nan for the sample of prompt" in errors[0]
    from distillery.components.checkpoint.checksums import verify_checkpoint
    from distillery.components.checkpoint.manager import list_checkpoints

    saved = [s for s, _ in list_checkpoints(tmp_path / "run")]
    assert saved == [1, 2, 3] and [r["step"] for r in read_log(tmp_path / "run")] == [1, 2, 3]
    assert all(verify_checkpoint(path) is None for _, path in list_checkpoints(tmp_path / "run"))
    data_lost.record(0 if saved == [1, 2, 3] else 1, "good checkpoints lost, or one after the NaN")
