"""Shadow weights (src/distillery/components/shadow.py): EMA copies and target networks.

- the updates are ``torch.lerp`` / copy on the trained parameters only, bit for bit, and a shadow's state round-trips;
- a method's target network (tests/plugins/target_method.py: a frozen twin of the student whose parameters are the
  shadow) computes with the shadow, in the student's compute precision (a one-rank bf16 compute copy refreshed after
  each update);
- through the real trainer: the target in each checkpoint (``shadows.target``) is the average of the student's saved
  weights written out by hand, bit for bit; 2 ranks (FSDP2, gloo) follow 1 rank; a 2-rank run stopped mid-way resumes
  to the uninterrupted run's student and target bit for bit.

The EMA callback, which keeps its shadows with this component, is tested in tests/test_callbacks.py (its averages,
bit for bit, through the trainer).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import dcp_tensors, plugin_env, plugins_allowed, read_log, run_config, train_in_process
from torchrun_each import torchrun_each

from distillery.components.shadow import ShadowWeights
from distillery.config import allowed_prefixes, load_run_config

TARGET = "target_method.TargetNetworkMethod"
DECAY, STEPS = 0.5, 4


def _modules() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    net[1].bias.requires_grad_(False)  # not trained: no shadow
    return {"transformer": net}


def test_updates_are_lerp_and_copy_on_the_trained_parameters_bit_for_bit():
    modules = _modules()
    shadow = ShadowWeights.detached(modules)
    assert sorted(shadow.tensors["transformer"]) == ["0.bias", "0.weight", "1.weight"]
    params = dict(modules["transformer"].named_parameters())
    start = {n: t.clone() for n, t in shadow.tensors["transformer"].items()}
    with torch.no_grad():
        for p in modules["transformer"].parameters():
            p.add_(1.0)
    shadow.lerp_(0.25)
    for n, t in shadow.tensors["transformer"].items():
        assert torch.equal(t, torch.lerp(start[n], params[n].detach(), 0.25)), n
    refreshed = []
    state = {m: {n: t.clone() for n, t in d.items()} for m, d in shadow.state_dict().items()}
    shadow.copy_()
    assert all(torch.equal(t, params[n]) for n, t in shadow.tensors["transformer"].items())
    shadow.refresh = lambda: refreshed.append(True)
    shadow.load_state_dict(state)
    assert refreshed and all(torch.equal(t, state["transformer"][n]) for n, t in shadow.tensors["transformer"].items())


def test_a_shadow_needs_the_roles_trained_parameters_in_fp32_and_its_shape():
    modules = _modules()
    twin = {"transformer": torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 3))}
    with pytest.raises(ValueError, match=r"1\.weight"):
        ShadowWeights.of_twin(modules, twin)
    with pytest.raises(ValueError, match="one tensor per trained parameter"):
        ShadowWeights(ShadowWeights.detached(modules).sources, {"transformer": {}})


@pytest.fixture(scope="module")
def training(tiny_base, latent_set):
    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def _plugins():
    return plugins_allowed("target_method")


def test_the_twin_is_a_frozen_copy_that_computes_with_the_shadow(tiny_base, training):
    from distillery.models.wan import WanModel, WanModelConfig

    with _plugins():
        from target_method import TargetConfig, TargetNetworkMethod

        student = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=True), "student")
        method = TargetNetworkMethod(TargetConfig(), {"student": student}, training)
    twin = method.twins["target"]
    assert twin.role == "student.target" and not twin.transformer.training and twin.transformer is not student.transformer
    method.on_train_start(torch.device("cpu"))
    shadow = method.shadows["target"]
    assert shadow.tensors["transformer"]["proj_out.weight"] is dict(twin.transformer.named_parameters())["proj_out.weight"]
    with torch.no_grad():
        student.transformer.proj_out.weight.add_(0.5)
    shadow.copy_()
    assert torch.equal(twin.transformer.proj_out.weight, student.transformer.proj_out.weight)
    from distillery.common.errors import UserError

    with _plugins(), pytest.raises(UserError, match="reads a shadow of the student"):
        frozen = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=False), "student")
        TargetNetworkMethod(TargetConfig(), {"student": frozen}, training, roles_checked=True)


def _config(base: Path, data: Path, out: Path, batch_size: int, **loop: int) -> dict:
    cfg = run_config(base, data, out, method=TARGET, method_knobs={"decay": DECAY}, steps=STEPS, batch_size=batch_size,
                     lr=1e-3, save_every=1)
    cfg["training"]["loop"].update(loop)
    return cfg


def test_the_target_follows_a_bf16_students_master_weights(tiny_base, latent_set, tmp_path):
    """One rank, bf16 compute (compute copies): the shadow averages the fp32 masters and the twin's bf16 copy is
    rewritten from it after each update."""
    cfg = _config(tiny_base, latent_set, tmp_path / "run", 4)
    cfg["training"]["loop"]["max_train_steps"] = 2
    cfg["training"]["distributed"] = {"mixed_precision": "bf16"}
    with _plugins():
        from distillery.components.distributed import init_distributed, shutdown
        from distillery.engine.assemble import build_trainer

        config = load_run_config(raw=cfg, prefixes=allowed_prefixes())
        env = init_distributed(config.training.distributed)
        try:
            trainer = build_trainer(config, env)
            trainer.fit()
        finally:
            shutdown()
    twin, shadow = trainer.method.twins["target"], trainer.method.shadows["target"]
    assert twin.compute_copy is not None
    copy = dict(twin.compute_copy.module.named_parameters())
    moved = 0
    for n, t in shadow.tensors["transformer"].items():
        assert t.dtype == torch.float32 and torch.equal(copy[n], t.to(torch.bfloat16)), n
        moved += not torch.equal(t, trainer.method.student.transformer.state_dict()[n])
    assert moved, "the target lags the student (decay 0.5): it must differ from the weights"


def _hand_average(run: Path) -> dict[str, torch.Tensor]:
    """The target written out by hand from each checkpoint's student weights: s_0 = w_0 (the init), s_k = lerp(s_{k-1},
    w_k, 1 − decay) in fp32, as torch.lerp computes it."""
    from helpers import role_state

    from distillery.models.wan import WanModel, WanModelConfig

    init = WanModel(WanModelConfig(init_from=str(run.parent / "base")), "student").transformer.state_dict()
    average = {n: t.float().clone() for n, t in init.items()}
    for k in range(1, STEPS + 1):
        w = role_state(run / f"checkpoint-{k}")
        average = {n: torch.lerp(average[n], w[n].float(), 1.0 - DECAY) for n in average}
    return average


@pytest.mark.slow
def test_target_through_the_trainer_on_one_and_two_ranks_and_resumed(tiny_base, latent_set, tmp_path):
    import shutil

    shutil.copytree(tiny_base, tmp_path / "base")
    with _plugins():
        train_in_process(_config(tiny_base, latent_set, tmp_path / "one", 4))
    env = plugin_env("target_method")
    torchrun_each([(_config(tiny_base, latent_set, tmp_path / "two", 2), tmp_path / "two.yaml"),
                   (_config(tiny_base, latent_set, tmp_path / "stopped", 2, stop_at_step=2), tmp_path / "stopped-1.yaml"),
                   (_config(tiny_base, latent_set, tmp_path / "stopped", 2), tmp_path / "stopped-2.yaml")], env=env)
    final = f"checkpoint-{STEPS}"
    one = dcp_tensors(tmp_path / "one" / final, ("roles.student.", "shadows.target."))
    shadow = {k[len("shadows.target.transformer."):]: v for k, v in one.items() if k.startswith("shadows.target.")}
    hand = _hand_average(tmp_path / "one")
    assert shadow.keys() == hand.keys()
    assert all(torch.equal(shadow[n], hand[n]) for n in hand), "the saved target is the hand-written average, bitwise"
    two = dcp_tensors(tmp_path / "two" / final, ("roles.student.", "shadows.target."))
    resumed = dcp_tensors(tmp_path / "stopped" / final, ("roles.student.", "shadows.target."))
    assert two.keys() == one.keys() == resumed.keys()
    assert all(torch.allclose(two[k], one[k], rtol=0, atol=1e-5) for k in one), "2 ranks follow 1 rank"
    assert all(torch.equal(resumed[k], two[k]) for k in two), "stopped at step 2 and resumed: bitwise the uninterrupted run"
    losses = [r["target_loss"] for r in read_log(tmp_path / "one")]
    assert losses[0] == 0.0 and all(v > 0 for v in losses[1:]), "the target starts as the student and then lags it"
