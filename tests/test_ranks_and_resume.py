"""Causal consistency distillation, Teacher-Forcing SFT, and DMD2 and Self-Forcing with the GAN term, through the real
trainer (``build_trainer(...).fit()``).

For each, 4 steps with a checkpoint after every step: 2 ranks (torchrun, gloo, FSDP2) follow 1 rank with the same
global batch (losses and weights, fp32 tolerance), and a 2-rank run stopped after step 2 and resumed ends bit for bit
where the uninterrupted 2-rank run ends — the trained roles (the critic's discriminator head included), their optimizer
state and (causal CD) the target network's shadow weights, saved under ``shadows.target``. All 2-rank runs share one
torchrun launch (tests/torchrun_each.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import dcp_tensors, read_log, run_config, train_in_process
from torchrun_each import torchrun_each

pytestmark = pytest.mark.slow
STEPS = 4
METHODS = {"causal_cd": "distillery.methods.causal_cd.CausalCDMethod", "tfsft": "distillery.methods.tfsft.TFSFTMethod",
           "dmd2_gan": "distillery.methods.dmd2.DMD2Method", "self_forcing_gan": "distillery.methods.self_forcing.SelfForcingMethod"}
GAN = {"gan_weight": 0.1, "gan_discriminator_weight": 0.5, "generator_update_interval": 2, "real_score_guidance_scale": 2.0}
KNOBS = {"causal_cd": {"num_discrete_steps": 8, "guidance_scale": 2.0, "target_decay": 0.5, "target_start_step": 2},
         "tfsft": {"chunk_size": 1}, "dmd2_gan": GAN, "self_forcing_gan": GAN}
LOSS = {"causal_cd": "consistency_loss", "tfsft": "flow_loss", "dmd2_gan": "gan_discriminator_loss",
        "self_forcing_gan": "gan_discriminator_loss"}
STATE = ("roles.", "optimizers.", "shadows.")


def _config(base: Path, data: Path, out: Path, method: str, batch_size: int, **loop: int) -> dict:
    cfg = run_config(base, data, out, method=METHODS[method], method_knobs=KNOBS[method], steps=STEPS,
                     batch_size=batch_size, lr=1e-3, save_every=1)
    wan, causal = "distillery.models.wan.WanModel", "distillery.models.wan.CausalWanModel"
    if method != "dmd2_gan":
        cfg["models"]["student"] = {"_target_": causal, "init_from": str(base), "chunk_size": 1}
    if method != "tfsft":
        cfg["models"]["teacher"] = {"_target_": causal if method == "causal_cd" else wan, "init_from": str(base),
                                    "trainable": False, **({"chunk_size": 1} if method == "causal_cd" else {})}
    if method.endswith("_gan"):
        cfg["models"]["critic"] = {"_target_": wan, "init_from": str(base), "optimizer": {"learning_rate": 2e-4}}
    cfg["training"]["loop"].update(loop)
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_base, latent_set):
    root = tmp_path_factory.mktemp("consistency")
    launch = []
    for method in METHODS:
        train_in_process(_config(tiny_base, latent_set, root / method / "one", method, 4))
        launch += [(_config(tiny_base, latent_set, root / method / "two", method, 2), root / f"{method}-two.yaml"),
                   (_config(tiny_base, latent_set, root / method / "stopped", method, 2, stop_at_step=2),
                    root / f"{method}-stopped-1.yaml"),
                   (_config(tiny_base, latent_set, root / method / "stopped", method, 2), root / f"{method}-stopped-2.yaml")]
    torchrun_each(launch)
    return root


@pytest.mark.parametrize("method", list(METHODS))
def test_two_ranks_follow_one(runs, method):
    one, two = read_log(runs / method / "one"), read_log(runs / method / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
    loss = LOSS[method]
    for a, b in [(a, b) for a, b in zip(one, two) if loss in a]:
        assert a[loss] > 0 and a[loss] == pytest.approx(b[loss], rel=1e-5, abs=1e-7), (a["step"], loss)
    wa = dcp_tensors(runs / method / "one" / f"checkpoint-{STEPS}", ("roles.", "shadows."))
    wb = dcp_tensors(runs / method / "two" / f"checkpoint-{STEPS}", ("roles.", "shadows."))
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-4) for k in wa)  # < 1/10 of a step
    assert any(k.startswith("shadows.target.") for k in wa) == (method == "causal_cd")
    assert any(k.startswith("roles.critic.discriminator.") for k in wa) == method.endswith("_gan")


@pytest.mark.parametrize("method", list(METHODS))
def test_a_stopped_run_resumes_bit_for_bit(runs, method):
    final = f"checkpoint-{STEPS}"
    whole = dcp_tensors(runs / method / "two" / final, STATE)
    resumed = dcp_tensors(runs / method / "stopped" / final, STATE)
    assert whole.keys() == resumed.keys() and any(k.startswith("optimizers.student.") for k in whole)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert [r["step"] for r in read_log(runs / method / "stopped")] == list(range(1, STEPS + 1))
