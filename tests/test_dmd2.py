"""DMD2 (src/distillery/methods/dmd2.py) on the tiny Wan, checked against quantities recomputed by hand.

- the generator's gradient ``∂loss/∂x̂0`` is ``g / N`` with ``g = (f − r) / mean|x̂0 − r|`` recomputed
  from what the critic and teacher transformers returned (forward hooks), for both rollouts and
  with / without teacher CFG; the critic loss is flow matching on the detached sample, its forward
  run only after the generator's backward (one graph alive at a time);
- ``simulate`` with ``ode`` re-noise follows the Euler step down the student's ladder;
- on non-update steps the student builds no graph, gets no gradient, and its weights and optimizer
  state stay bit-identical; the teacher never holds a gradient;
- through the real trainer, for DMD2 and Self-Forcing (a causal student) alike (and PDD and DM-PDD, in the same launch): 2 ranks (torchrun,
  gloo, FSDP2) draw what 1 rank draws for the same global
  batch (and ``check_rank_agreement`` all-reduces every draw), and a 2-rank run stopped
  mid-way resumes to bitwise the weights of an uninterrupted 2-rank run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import dcp_tensors, nudge_weights, read_log, run_config, train_in_process
from helpers import tiny_raw_batch as raw_batch
from torchrun_each import torchrun_each

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.dmd2 import DMD2Config, DMD2Method, truncated_shifted_timesteps, warped_ladder
from distillery.models.wan import WanModel, WanModelConfig

N_T = 1000  # num_train_timesteps
SHIFT = 3.0  # the tiny base's scheduler shift
TARGET = "distillery.methods.dmd2.DMD2Method"


# -- direct method steps ------------------------------------------------------------------------
@dataclass
class Call:
    """One transformer forward: its inputs and its (velocity) output."""

    x: torch.Tensor  # hidden_states [B, C, T, H, W]
    t: torch.Tensor  # timestep [B]
    text: torch.Tensor  # encoder_hidden_states [B, L, D]
    out: torch.Tensor  # velocity [B, C, T, H, W]; the live tensor when it has a graph

    @property
    def x0(self) -> torch.Tensor:
        """x0 = x_t − σ v (float64, from the recorded tensors)."""
        sigma = (self.t.double() / N_T).view(-1, 1, 1, 1, 1)
        return self.x.double() - sigma * self.out.detach().double()


@dataclass
class Recorder:
    calls: dict[str, list[Call]] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    def attach(self, method: DMD2Method) -> "Recorder":
        for role, model in method.role_models.items():
            self.calls[role] = []

            def hook(module, args, kwargs, output, role=role):
                out = output[0]
                if out.requires_grad:
                    out.retain_grad()
                self.calls[role].append(Call(kwargs["hidden_states"].detach().clone(), kwargs["timestep"].detach().clone(),
                                             kwargs["encoder_hidden_states"].detach().clone(), out))

            self.handles.append(model.transformer.register_forward_hook(hook, with_kwargs=True))
        return self

    def clear(self) -> None:
        for calls in self.calls.values():
            calls.clear()


@pytest.fixture(scope="module")
def training(tiny_base: Path, latent_set: Path):
    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def make(tiny_base: Path, training, **knobs) -> DMD2Method:
    models = {}
    for role in ("student", "teacher", "critic"):
        models[role] = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=role != "teacher"), role)
        models[role].bind_device(torch.device("cpu"))
    nudge_weights(models["critic"].transformer)  # a critic that differs from the teacher, so f − r is not ~0
    method = DMD2Method(DMD2Config(**knobs), models, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    return method


def grads(model) -> list[torch.Tensor | None]:
    return [p.grad for p in model.transformer.parameters()]


def test_each_roles_lr_schedule_spans_its_own_updates(tiny_base, latent_set):
    """Issue 46: the student steps its scheduler only on update steps (every k-th), so a schedule over all the
    run's steps decayed it only ~1/k of the way; each role's horizon is now its own number of updates."""
    raw = run_config(tiny_base, latent_set, Path("unused"), steps=8)
    raw["training"]["optimizer"].update({"lr_scheduler": "cosine", "min_lr_ratio": 0.0, "warmup_steps": 0})
    training = load_run_config(raw=raw, prefixes=allowed_prefixes()).training
    method = make(tiny_base, training, generator_update_interval=2)
    lr = training.optimizer.learning_rate
    for step in range(1, 9):  # no gradients: the optimizers skip every parameter, the schedulers step as in a run
        method.optimizers_step(step)
        rates = method.learning_rates()
        if step % 2 == 0:  # after the student's update: both roles the same way through their decay
            assert rates["student"] == pytest.approx(rates["critic"], abs=1e-12), (step, rates)
    assert rates["student"] == pytest.approx(0.0, abs=1e-12) and rates["critic"] == pytest.approx(0.0, abs=1e-12)
    assert lr > 0
    assert (method.role_updates("student", 8), method.role_updates("critic", 8)) == (4, 8)


def test_guided_real_score_refuses_a_latent_set_without_the_empty_prompt(tiny_base, training):
    """Issue 46: without the empty prompt's embedding, the teacher's unconditional forward ran on zeros."""
    batch = {k: v for k, v in raw_batch().items() if k != "empty_text_embeds"}
    method = make(tiny_base, training, real_score_guidance_scale=3.0, generator_update_interval=1)
    with pytest.raises(UserError, match=r"has no empty_prompt\.safetensors.*real-score guidance of 3\.0.*zeros are not it"):
        method.single_train_step(batch, step=1)
    make(tiny_base, training, real_score_guidance_scale=1.0, generator_update_interval=1).single_train_step(batch, step=1)


@pytest.mark.parametrize("rollout,guidance", [("simulate", 3.0), ("simulate", 1.0), ("data_latent", 2.5)])
def test_generator_gradient_is_the_dmd_formula(tiny_base, training, rollout, guidance):
    method = make(tiny_base, training, rollout=rollout, real_score_guidance_scale=guidance, generator_update_interval=1)
    method.draw_exit_step = lambda batch: 2  # a middle ladder step: simulate runs two no-grad steps first
    rec = Recorder().attach(method)
    raw = raw_batch()
    out = method.single_train_step(raw, step=1)
    # two phases: the critic's forward with a graph waits until the generator's backward has freed the student's graph
    assert [c.out.requires_grad for c in rec.calls["critic"]] == [False] and "critic_loss" not in out.losses
    assert rec.calls["student"][-1].out.grad is None
    method.backward(out)

    # the student: no-grad forwards down the ladder, then the one forward with a graph at t_2
    student = rec.calls["student"]
    assert len(student) == (3 if rollout == "simulate" else 1)
    assert [c.out.requires_grad for c in student] == [False] * (len(student) - 1) + [True]
    exit_call = student[-1]
    assert torch.all(exit_call.t == method.ladder[2]) and method.ladder == warped_ladder(method.student.schedule, 4)
    if rollout == "simulate":
        assert [float(c.t[0]) for c in student] == method.ladder[:3]
    else:  # the data latents noised to t_2: x_t − (1 − σ) x0 = σ ε
        sigma = method.ladder[2] / N_T
        eps = (exit_call.x.double() - (1 - sigma) * raw["latents"].double()) / sigma
        assert abs(float(eps.std()) - 1.0) < 0.15
    x0 = exit_call.x0

    # the critic's no-grad query at (x_τ, τ), then its flow-matching forward with grad
    critic = rec.calls["critic"]
    assert len(critic) == 2 and not critic[0].out.requires_grad and critic[1].out.requires_grad
    tau = critic[0].t
    assert torch.all((tau >= 20.0 - 1e-3) & (tau <= 980.0 + 1e-3))
    sigma_tau = (tau.double() / N_T).view(-1, 1, 1, 1, 1)
    eps_tau = (critic[0].x.double() - (1 - sigma_tau) * x0) / sigma_tau
    assert abs(float(eps_tau.std()) - 1.0) < 0.15  # x_τ is x̂0 re-noised with fresh unit noise
    f = critic[0].x0

    # the teacher at (x_τ, τ): conditional, then (with CFG) on the empty prompt
    teacher = rec.calls["teacher"]
    assert len(teacher) == (1 if guidance == 1.0 else 2)
    assert all(torch.equal(c.x, critic[0].x) and torch.equal(c.t, tau) for c in teacher)
    assert torch.equal(teacher[0].text, raw["text_embeds"])
    c = teacher[0].x0
    if guidance == 1.0:
        r = c
    else:
        assert torch.equal(teacher[1].text, raw["empty_text_embeds"].expand_as(raw["text_embeds"]))
        u = teacher[1].x0
        r = u + guidance * (c - u)

    g = (f - r) / (x0 - r).abs().mean(dim=(1, 2, 3, 4), keepdim=True)  # by hand, float64
    n = x0.numel()
    # ∂loss/∂x̂0 = g / N and x̂0 = x_t − σ v, so ∂loss/∂v = −σ g / N
    sigma_exit = method.ladder[2] / N_T
    dv = exit_call.out.grad.double()
    expected = -sigma_exit * g / n
    assert float(expected.abs().max()) > 1e-6  # not vacuous
    # fp32 (method) against float64 (here): within 1e-5 of the gradient's scale
    torch.testing.assert_close(dv, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    assert float(out.losses["generator_loss"]) == pytest.approx(float(0.5 * (g ** 2).mean()), rel=1e-4)
    assert float(out.metrics["dmd_grad_norm"]) == pytest.approx(float(g.abs().mean()), rel=1e-4)

    # critic loss: velocity target ε − x̂0 at its own t, on the detached sample
    t_c = (critic[1].t.double() / N_T).view(-1, 1, 1, 1, 1)
    eps_c = (critic[1].x.double() - (1 - t_c) * x0) / t_c
    fm = ((critic[1].out.detach().double() - (eps_c - x0)) ** 2).mean()
    assert float(out.losses["critic_loss"]) == pytest.approx(float(fm), rel=1e-4)
    total = out.losses["generator_loss"] + out.losses["critic_loss"]
    assert float(out.losses["total_loss"].detach()) == pytest.approx(float(total), rel=1e-6)

    assert all(gr is not None for gr in grads(method.student)) and all(gr is not None for gr in grads(method.critic))
    assert all(gr is None for gr in grads(method.teacher))


def test_ode_rollout_follows_the_euler_step_down_the_ladder(tiny_base, training):
    method = make(tiny_base, training, rollout_renoise="ode", student_timesteps=[1000, 800, 450, 200],
                  generator_update_interval=1, real_score_guidance_scale=1.0)
    method.draw_exit_step = lambda batch: 3
    rec = Recorder().attach(method)
    method.single_train_step(raw_batch(), step=1)
    student = rec.calls["student"]
    assert [float(c.t[0]) for c in student] == [1000.0, 800.0, 450.0, 200.0]
    for a, b in zip(student, student[1:]):
        expected = a.x.double() + (float(b.t[0]) - float(a.t[0])) / N_T * a.out.detach().double()
        torch.testing.assert_close(b.x.double(), expected, rtol=1e-5, atol=1e-5)
    assert method.sampling_contract()["timesteps"] == [1000.0, 800.0, 450.0, 200.0]


def test_non_update_steps_leave_the_student_alone(tiny_base, training):
    method = make(tiny_base, training, generator_update_interval=2, real_score_guidance_scale=2.0)
    rec = Recorder().attach(method)
    student = method.student.transformer

    def snapshot() -> tuple[dict, dict]:
        weights = {k: v.detach().clone() for k, v in student.state_dict().items()}
        opt = method.optimizers["student"].state_dict()
        state = {(i, k): v.clone() if torch.is_tensor(v) else v for i, s in opt["state"].items() for k, v in s.items()}
        return weights, state

    for step in range(1, 5):
        rec.clear()
        before = snapshot()
        out = method.single_train_step(raw_batch(seed=step), step)
        method.backward(out)
        update = step % 2 == 0
        assert method.roles_to_step(step) == (["critic", "student"] if update else ["critic"])
        assert ("generator_loss" in out.losses) == update
        assert any(c.out.requires_grad for c in rec.calls["student"]) == update  # no graph on non-update steps
        assert all((gr is not None) == update for gr in grads(method.student))
        assert all(gr is None for gr in grads(method.teacher))
        method.optimizers_step(step)
        method.zero_grad(step)
        after = snapshot()
        assert all(gr is None for gr in grads(method.teacher))
        same = all(torch.equal(before[0][k], after[0][k]) for k in before[0])
        same_opt = before[1].keys() == after[1].keys() and all(
            torch.equal(v, after[1][k]) if torch.is_tensor(v) else v == after[1][k] for k, v in before[1].items())
        assert (same and same_opt) != update, step
    assert method.lr_schedulers["student"].last_epoch == 2 and method.lr_schedulers["critic"].last_epoch == 4


def test_draws_ladder_contract_and_config_checks(tiny_base, training):
    from distillery.sampling import build_sampler

    sched = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=False), "t").schedule
    assert warped_ladder(sched, 4) == pytest.approx([1000.0, 900.0, 750.0, 500.0])
    u = torch.tensor([0.0, 0.5, 1.0 - 1e-7])
    tau = truncated_shifted_timesteps(u, sched, 0.02, 0.98)
    assert float(tau[0]) == pytest.approx(20.0, abs=1e-3) and float(tau[2]) == pytest.approx(980.0, abs=1e-2)
    # the median of the truncated shifted law: shift of the middle of the unshifted bounds
    a, b = 0.02 / (3 - 2 * 0.02), 0.98 / (3 - 2 * 0.98)
    mid = (a + b) / 2
    assert float(tau[1]) == pytest.approx(1000 * 3 * mid / (1 + 2 * mid), rel=1e-5)

    method = make(tiny_base, training)
    contract = method.sampling_contract()
    assert contract == {"sampler": "few_step_x0", "shift": SHIFT, "num_train_timesteps": 1000,
                        "timesteps": pytest.approx([1000.0, 900.0, 750.0, 500.0])}
    sampler = build_sampler(contract)
    from distillery.models.base import Conditioning

    with torch.no_grad():
        x = sampler.sample(method.student, Conditioning(raw_batch()["text_embeds"]), (8, 3, 8, 8), torch.Generator().manual_seed(0))
    assert x.shape == (2, 8, 3, 8, 8) and torch.isfinite(x).all()

    for bad in ({"student_timesteps": [1000, 1000]}, {"student_timesteps": [500, 750]}, {"student_timesteps": [1000, 0]},
                {"student_timesteps": []}, {"num_student_steps": 0}, {"generator_update_interval": 0},
                {"real_score_guidance_scale": -1.0}, {"min_score_timestep_ratio": 0.5, "max_score_timestep_ratio": 0.5},
                {"max_score_timestep_ratio": 1.5}, {"rollout": "dream"}, {"rollout_renoise": "heun"}):
        with pytest.raises((ValueError, UserError)):  # a declared field bound: one UserError line (config.typed.check_fields)
            DMD2Config(**bad)


# -- through the trainer: 1 rank, 2 ranks, 2 ranks stopped and resumed ----------------------------
STEPS = 4
STOP = 3  # the student stepped at 2 (it has optimizer state); the resumed part updates it at 4


METHODS = {"dmd2": TARGET, "self_forcing": "distillery.methods.self_forcing.SelfForcingMethod"}


def _config(base: Path, data: Path, out: Path, batch_size: int, save_every: int = 0, method: str = "dmd2") -> dict:
    cfg = run_config(base, data, out, method=METHODS[method], steps=STEPS, batch_size=batch_size, lr=1e-3, save_every=save_every,
                     method_knobs={"generator_update_interval": 2, "real_score_guidance_scale": 2.0,
                                   "check_rank_agreement": True},
                     callbacks={"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}})
    wan = "distillery.models.wan.WanModel"
    if method == "self_forcing":  # a causal student in chunks of 2 latent frames (the set's videos: 3 latent frames)
        cfg["models"]["student"] = {"_target_": "distillery.models.wan.CausalWanModel", "init_from": str(base), "chunk_size": 2}
        cfg["method"]["context_noise"] = 50.0
    cfg["models"]["critic"] = {"_target_": wan, "init_from": str(base), "optimizer": {"learning_rate": 2e-4, "betas": [0.0, 0.999]}}
    cfg["models"]["teacher"] = {"_target_": wan, "init_from": str(base), "trainable": False}
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_base, latent_set):
    """``<root>/<method>/{one,two,resumed}``: both methods' runs, the 2-rank ones in one torchrun launch."""
    root = tmp_path_factory.mktemp("dmd2")
    launches = []
    for method in METHODS:
        out = root / method
        out.mkdir()
        train_in_process(_config(tiny_base, latent_set, out / "one", 4, save_every=1, method=method))  # 1 rank × 4 samples
        stopped = _config(tiny_base, latent_set, out / "resumed", 2, method=method)
        stopped["training"]["loop"]["stop_at_step"] = STOP
        launches += [(_config(tiny_base, latent_set, out / "two", 2, method=method), out / "two.yaml"),  # 2 ranks × 2
                     (stopped, out / "stopped.yaml"),  # stopped at STOP (checkpointed) ...
                     (_config(tiny_base, latent_set, out / "resumed", 2, method=method), out / "resumed.yaml")]  # ... resumed
    for name, dm in (("pdd", False), ("dm_pdd", True)):  # PDD and DM-PDD (simulate: carried trajectories) in the same launch
        out = root / name
        out.mkdir()
        train_in_process(_pdd_config(tiny_base, latent_set, out / "one", 4, dm))
        stopped = _pdd_config(tiny_base, latent_set, out / "resumed", 2, dm)
        stopped["training"]["loop"]["stop_at_step"] = STOP
        launches += [(_pdd_config(tiny_base, latent_set, out / "two", 2, dm), out / "two.yaml"), (stopped, out / "stopped.yaml"),
                     (_pdd_config(tiny_base, latent_set, out / "resumed", 2, dm), out / "resumed.yaml")]
    torchrun_each(launches)
    return root


def _pdd_config(base: Path, data: Path, out: Path, batch_size: int, dm: bool = False) -> dict:
    """PDD's run, or with ``dm`` DM-PDD's (a critic; the DM term every 2nd step, so both kinds of step are run)."""
    knobs = {"rollout": "simulate", "block_size_min": 2, "block_size_max": 4, "teacher_guidance_scale": 2.0, "sampling_steps": 2}
    if dm:
        knobs.update(dm_weight=0.5, generator_update_interval=2)
    method = "distillery.methods.dm_pdd.DMPDDMethod" if dm else "distillery.methods.pdd.PDDMethod"
    cfg = run_config(base, data, out, method=method, steps=STEPS, batch_size=batch_size, lr=1e-3, method_knobs=knobs,
                     callbacks={"grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0}})
    cfg["models"]["student"] = {"_target_": "distillery.models.wan.PDDWanModel", "init_from": str(base), "pdd_steps": 4}
    cfg["models"]["teacher"] = {"_target_": "distillery.models.wan.WanModel", "init_from": str(base), "trainable": False}
    if dm:
        cfg["models"]["critic"] = {"_target_": "distillery.models.wan.WanModel", "init_from": str(base),
                                   "optimizer": {"learning_rate": 2e-4, "betas": [0.0, 0.999]}}
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("method", ["pdd", "dm_pdd"])
def test_pdd_on_two_ranks_is_one_rank_and_resumes_its_carried_trajectories(runs, method):
    """PDD and DM-PDD under FSDP2 (the head bank its own unit; every rank projects the same heads, each row its own
    rung and head): 2 ranks × 2 samples give the 1-rank × 4 draws and losses; a 2-rank run stopped mid-trajectory
    resumes bit for bit."""
    one, two, resumed = (read_log(runs / method / name) for name in ("one", "two", "resumed"))
    assert [r["pdd_head"] for r in two] == [r["pdd_head"] for r in one] and len({r["pdd_head"] for r in one}) > 1
    keys = ["total_loss"] + (["pdd_loss", "critic_loss", "generator_loss", "score_timestep", "critic_timestep"]
                             if method == "dm_pdd" else [])
    if method == "dm_pdd":  # the DM term joins every 2nd step; the critic trains every step
        assert [("generator_loss" in r) for r in one] == [s % 2 == 0 for s in range(1, STEPS + 1)]
        assert all("grad_norm/critic" in r for r in one)
    for a, b in zip(two, one):
        assert [k in a for k in keys] == [k in b for k in keys], a["step"]
        for key in (k for k in keys if k in b):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert [r["total_loss"] for r in resumed] == [r["total_loss"] for r in two]
    prefixes = ("roles.", "optimizers.", "schedulers.", "method.")
    a = dcp_tensors(runs / method / "two" / f"checkpoint-{STEPS}", prefixes)
    b = dcp_tensors(runs / method / "resumed" / f"checkpoint-{STEPS}", prefixes)
    assert a.keys() == b.keys() and any(k.startswith("roles.student.heads.") for k in a)
    assert (method == "dm_pdd") == any(k.startswith("roles.critic.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_trainer_steps_the_student_only_on_update_steps(runs, method):
    runs = runs / method
    log = read_log(runs / "one")
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert [("generator_loss" in r) for r in log] == [s % 2 == 0 for s in range(1, STEPS + 1)]
    assert [("grad_norm/student" in r) for r in log] == [s % 2 == 0 for s in range(1, STEPS + 1)]
    prefixes = ("roles.student.", "optimizers.student.", "schedulers.student.")
    before = dcp_tensors(runs / "one" / "checkpoint-2", prefixes)
    after = dcp_tensors(runs / "one" / "checkpoint-3", prefixes)
    assert before.keys() == after.keys() and any(k.startswith("optimizers.student.") for k in before)
    assert all(torch.equal(before[k], after[k]) for k in before)
    critic = ("roles.critic.",)
    c2, c3 = dcp_tensors(runs / "one" / "checkpoint-2", critic), dcp_tensors(runs / "one" / "checkpoint-3", critic)
    assert any(not torch.equal(c2[k], c3[k]) for k in c2)
    assert dcp_tensors(runs / "one" / "checkpoint-1", ("optimizers.student.",)) == {}  # never stepped yet
    assert not dcp_tensors(runs / "one" / f"checkpoint-{STEPS}", ("roles.teacher.",))  # frozen: not saved


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_two_ranks_draw_what_one_rank_draws(runs, method):
    """Each 2-rank step all-reduced its exit step(s) and generator state (``check_rank_agreement``: a
    difference would have failed the run); the exit steps, τ means and losses equal the 1-rank run's."""
    one, two = read_log(runs / method / "one"), read_log(runs / method / "two")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    assert len({r["exit_step"] for r in one}) > 1  # the draw varies over steps
    for a, b in zip(two, one):
        exits = sorted(k for k in b if k.startswith("exit_step"))
        assert exits == sorted(k for k in a if k.startswith("exit_step")) and exits
        assert all(a[k] == b[k] for k in exits) and float(a[exits[-1]]).is_integer(), a["step"]
        for key in ("total_loss", "critic_loss", "generator_loss", "score_timestep", "critic_timestep", "dmd_grad_norm"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_a_stopped_two_rank_run_resumes_to_the_uninterrupted_weights(runs, method):
    runs = runs / method
    ref, got = read_log(runs / "two"), read_log(runs / "resumed")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["total_loss"] for r in got] == [r["total_loss"] for r in ref]
    prefixes = ("roles.", "optimizers.", "schedulers.", "method.")
    a = dcp_tensors(runs / "two" / f"checkpoint-{STEPS}", prefixes)
    b = dcp_tensors(runs / "resumed" / f"checkpoint-{STEPS}", prefixes)
    assert a.keys() == b.keys() and any(k.startswith("roles.student.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_a_student_and_critic_saved_on_two_ranks_export_as_save_pretrained_writes_them(runs, method, tmp_path):
    """A checkpoint saved by 2 ranks (DCP shards of both), its causal (self forcing) or bidirectional student and its
    critic: the export written without diffusers is save_pretrained's folder, byte for byte."""
    from direct_weights_check import assert_direct_export_is_save_pretrained

    checkpoint = runs / method / "two" / f"checkpoint-{STEPS}"
    for role in ("student", "critic"):
        assert_direct_export_is_save_pretrained(checkpoint, role, tmp_path / role)
