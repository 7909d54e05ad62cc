"""Two trainable roles on alternating schedules, a frozen third (tests/plugins/two_role_method.py).

- each trainable role runs the optimizer its config gives it (``models.<role>.optimizer`` over
  ``training.optimizer``);
- on the steps the student does not update, its weights and optimizer state stay bit-identical;
- a checkpoint saved on 2 ranks resumes on 1, and one saved on 1 (before the student ever had a
  gradient: no optimizer state yet) resumes on 2, with the losses of an uninterrupted run;
- the frozen teacher is not saved, its source is, and a changed teacher is refused on resume.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import PLUGINS, dcp_tensors, plugin_env, plugins_allowed, read_log, run_config, train_in_process, write_config
from safetensors.torch import load_file, save_file
from torchrun_each import torchrun_each

from distillery.common.errors import UserError

pytestmark = pytest.mark.slow
STEPS = 6
CRITIC_LR, STUDENT_LR = 2e-4, 1e-3


def _config(base: Path, data: Path, out: Path, batch_size: int, teacher: Path | None = None) -> dict:
    cfg = run_config(base, data, out, method="two_role_method.TwoRoleMethod", steps=STEPS, batch_size=batch_size,
                     lr=STUDENT_LR, save_every=1, callbacks={
                         "grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0,
                                       "per_role": {"critic": 0.5}},
                         "ema": {"_target_": "distillery.callbacks.ema.EMACallback", "decay": 0.9, "roles": ["student", "critic"]},
                     })
    cfg["method"]["generator_update_interval"] = 2
    wan = "distillery.models.wan.WanModel"
    cfg["models"]["critic"] = {"_target_": wan, "init_from": str(base),
                               "optimizer": {"learning_rate": CRITIC_LR, "betas": [0.0, 0.999]}}
    cfg["models"]["teacher"] = {"_target_": wan, "init_from": str(teacher or base), "trainable": False}
    cfg["training"]["optimizer"].update(lr_scheduler="cosine", warmup_steps=1, min_lr_ratio=0.5)
    return cfg


def _train(cfg: dict, path: Path) -> None:
    """One run of ``cfg`` on 1 rank, in this process (the Trainer a worker builds, without paying the imports again)."""
    write_config(path, cfg)
    with _plugins():
        train_in_process(cfg)


def _accum(base: Path, data: Path, out: Path, batch_size: int) -> dict:
    """Two micro-batches per step, 3 steps (test_gradient_accumulation_on_two_ranks_matches_one)."""
    c = _config(base, data, out, batch_size)
    c["training"]["loop"].update(max_train_steps=3, grad_accum_steps=2)
    c["training"]["checkpoint"]["save_every"] = 0
    return c


def _plugins():
    """The test plugins importable and allowed as `_target_`s in this process."""
    return plugins_allowed("two_role_method")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_base, latent_set):
    """The 1-rank runs in this process; every 2-rank run in one torchrun launch (tests/torchrun_each.py)."""
    root = tmp_path_factory.mktemp("roles")
    _train(_config(tiny_base, latent_set, root / "single", 4), root / "single.yaml")  # the uninterrupted reference
    one = _config(tiny_base, latent_set, root / "one_to_two", 4)  # saved on 1 rank at step 1 (student never stepped) ...
    one["training"]["loop"]["stop_at_step"] = 1
    _train(one, root / "one_to_two.yaml")
    two = _config(tiny_base, latent_set, root / "two_to_one", 2)  # saved on 2 ranks at step 3 ...
    two["training"]["loop"]["stop_at_step"] = 3
    torchrun_each([(two, root / "two_to_one-stopped.yaml"),
                   (_config(tiny_base, latent_set, root / "one_to_two", 2), root / "one_to_two-resumed.yaml"),  # ... resumed on 2
                   (_accum(tiny_base, latent_set, root / "accum_two", 1), root / "accum_two.yaml")],  # 2 ranks × 1 sample × 2
                  env=plugin_env("two_role_method"))  # the test's method plugin on the workers' path
    _train(_config(tiny_base, latent_set, root / "two_to_one", 4), root / "two_to_one.yaml")  # ... resumed on 1
    return root


def test_each_role_runs_its_own_optimizer(runs):
    log = read_log(runs / "single")
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    for r in log:  # cosine from the role's own peak rate; the student's schedule advances only when it steps
        assert 0.5 * CRITIC_LR - 1e-12 <= r["lr/critic"] <= CRITIC_LR + 1e-12
        assert 0.5 * STUDENT_LR - 1e-12 <= r["lr/student"] <= STUDENT_LR + 1e-12
    assert log[0]["lr/critic"] == pytest.approx(CRITIC_LR) and log[0]["lr/student"] == pytest.approx(STUDENT_LR)
    assert log[-1]["lr/critic"] < log[0]["lr/critic"]
    assert all("grad_norm/critic" in r for r in log)
    assert [("grad_norm/student" in r) for r in log] == [s % 2 == 0 for s in range(1, STEPS + 1)]
    assert [("student_loss" in r) for r in log] == [s % 2 == 0 for s in range(1, STEPS + 1)]
    # betas (0, 0.999) for the critic: its first moment is the last gradient itself
    opt = dcp_tensors(runs / "single" / "checkpoint-1", ("optimizers.critic.state.",))
    assert opt and all(torch.isfinite(t).all() for t in opt.values())


def test_student_state_is_untouched_on_steps_it_does_not_update(runs):
    prefixes = ("roles.student.", "optimizers.student.", "schedulers.student.", "callbacks.ema.student.")
    for step in range(2, STEPS, 2):  # step is an update step, step + 1 is not
        before = dcp_tensors(runs / "single" / f"checkpoint-{step}", prefixes)
        after = dcp_tensors(runs / "single" / f"checkpoint-{step + 1}", prefixes)
        assert before.keys() == after.keys() and any(k.startswith("optimizers.student.") for k in before)
        assert all(torch.equal(before[k], after[k]) for k in before), step
        critic = ("roles.critic.",)
        moved = dcp_tensors(runs / "single" / f"checkpoint-{step}", critic)
        assert any(not torch.equal(v, dcp_tensors(runs / "single" / f"checkpoint-{step + 1}", critic)[k]) for k, v in moved.items())
    first = dcp_tensors(runs / "single" / "checkpoint-1", ("optimizers.student.",))
    assert first == {}, "the student has not stepped at step 1: no optimizer state"


@pytest.mark.parametrize("name", ["two_to_one", "one_to_two"])
def test_resume_on_another_world_size_has_the_uninterrupted_losses(runs, name):
    ref = {r["step"]: r for r in read_log(runs / "single")}
    got = read_log(runs / name)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r in got:
        for key in ("total_loss", "critic_loss", "student_loss", "grad_norm/critic", "lr/student"):
            if key in ref[r["step"]]:
                assert r[key] == pytest.approx(ref[r["step"]][key], rel=1e-5, abs=1e-7), (name, r["step"], key)
    meta = json.loads((runs / name / f"checkpoint-{STEPS}" / "metadata.json").read_text())
    assert meta["roles"] == ["critic", "student"]
    assert set(meta["frozen_roles"]) == {"teacher"} and len(meta["frozen_roles"]["teacher"]["sha256"]) == 64
    keys = dcp_tensors(runs / name / f"checkpoint-{STEPS}", ("roles.",)).keys()
    assert not [k for k in keys if k.startswith("roles.teacher.")]  # frozen roles are not saved


def test_a_changed_teacher_is_refused_on_resume(runs, tiny_base, latent_set, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_base, teacher)
    weights = next((teacher / "transformer").glob("*.safetensors"))
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights)
    run = tmp_path / "run"
    shutil.copytree(runs / "single", run)
    cfg = _config(tiny_base, latent_set, run, 4, teacher=teacher)
    cfg["training"]["loop"]["max_train_steps"] = STEPS + 1
    with _plugins(), pytest.raises(UserError, match="the frozen teacher changed since this checkpoint was saved"):
        train_in_process(cfg)


def test_wrong_role_kind_and_frozen_optimizer_are_config_errors(tiny_base, latent_set, tmp_path):
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.engine.builder import check_roles_early, role_optimizer_configs

    cfg = _config(tiny_base, latent_set, tmp_path / "run", 4)
    cfg["models"]["teacher"]["optimizer"] = {"learning_rate": 1e-5}
    sys.path.insert(0, str(PLUGINS))
    try:
        config = load_run_config(raw=cfg, prefixes=allowed_prefixes(["two_role_method"]))
        with pytest.raises(UserError, match="models.teacher.optimizer: the teacher is frozen"):
            check_roles_early(config)
        cfg["models"]["teacher"].pop("optimizer")
        resolved = role_optimizer_configs(load_run_config(raw=cfg, prefixes=allowed_prefixes(["two_role_method"])))
        assert set(resolved) == {"student", "critic"}
        assert (resolved["critic"].learning_rate, tuple(resolved["critic"].betas)) == (CRITIC_LR, (0.0, 0.999))
        assert (resolved["student"].learning_rate, tuple(resolved["student"].betas)) == (STUDENT_LR, (0.9, 0.999))
        assert resolved["critic"].lr_scheduler == resolved["student"].lr_scheduler == "cosine"  # not overridden: inherited
        cfg["models"]["critic"]["optimizer"] = {"betas": [0.0, 0.999], "momentum": 0.9}
        with pytest.raises(UserError, match=r"models\.critic\.optimizer\.momentum"):
            load_run_config(raw=cfg, prefixes=allowed_prefixes(["two_role_method"]))
    finally:
        sys.path.remove(str(PLUGINS))


def test_gradient_accumulation_on_two_ranks_matches_one(runs, tmp_path, tiny_base, latent_set):
    """Two micro-batches per step: FSDP2 on 2 ranks reduces gradients once, after the second
    (``set_requires_gradient_sync``), and follows the one-rank trajectory with the same micro-batches."""
    two_dir = runs / "accum_two"  # 2 ranks × 1 sample × 2 micro-batches (the fixture's launch)
    _train(_accum(tiny_base, latent_set, tmp_path / "one", 2), tmp_path / "one.yaml")  # 1 rank × 2 samples × 2: the same samples and draws
    two, one = read_log(two_dir), read_log(tmp_path / "one")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(two, one):
        for key in ("total_loss", "critic_loss", "grad_norm/critic"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    wa = dcp_tensors(two_dir / "checkpoint-3", ("roles.critic.", "roles.student."))
    wb = dcp_tensors(tmp_path / "one" / "checkpoint-3", ("roles.critic.", "roles.student."))
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-5) for k in wa)


def test_a_prompts_only_method_gets_prompt_batches(tiny_base, latent_set, tmp_path):
    """``data_kind = "prompts"``: the trainer reads prompt embeddings only (no latent columns)."""
    from distillery.data import LatentDataset

    cfg = run_config(tiny_base, latent_set, tmp_path / "run", method="prompt_method.PromptRolloutMethod", steps=2)
    with plugins_allowed("prompt_method"):
        result = train_in_process(cfg)
    assert result.final_step == 2 and all(r["total_loss"] > 0 for r in result.history)
    prompts, full = LatentDataset(latent_set, with_latents=False), LatentDataset(latent_set)
    assert "latents" not in prompts[0] and torch.equal(prompts[0]["text_embedding"], full[0]["text_embedding"])
