"""DM-PDD (src/distillery/methods/dm_pdd.py) on the tiny Wan: the loss is PDD's head regression plus
``dm_weight`` × DMD2's generator loss of the fused jump ``x̂0 = x_n − σ_n v̄_[n,P)``, every term recomputed
here from the models' inputs (forward hooks); the DM term reaches heads n … P−1, off-DM steps only head k;
the critic trains on the detached sample after the student's backward.
(Through the trainer — 2 ranks draw what 1 rank draws, a stopped run resumes bitwise —: tests/test_dmd2.py,
in the distillation methods' shared torchrun launch.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import nudge_weights, run_config
from helpers import tiny_raw_batch as raw_batch

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.dm_pdd import DMPDDConfig, DMPDDMethod
from distillery.models.base import Conditioning
from distillery.models.schedule import block_weights
from distillery.models.wan import WanModel, WanModelConfig
from distillery.models.wan.pdd import PDDWanModel, PDDWanModelConfig

P = 8


@pytest.fixture(scope="module")
def training(tiny_base: Path, latent_set: Path):
    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def make(tiny_base: Path, training, **knobs) -> DMPDDMethod:
    student = PDDWanModel(PDDWanModelConfig(init_from=str(tiny_base), pdd_steps=P), "student")
    teacher = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=False), "teacher")
    critic = WanModel(WanModelConfig(init_from=str(tiny_base)), "critic")
    for model in (student, teacher, critic):
        model.bind_device(torch.device("cpu"))
    nudge_weights(teacher.transformer)  # the teacher differs from the student's init and the critic: f ≠ r
    nudge_weights(critic.transformer, 0.01)
    method = DMPDDMethod(DMPDDConfig(**knobs), {"student": student, "teacher": teacher, "critic": critic}, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    return method


def record(model) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each forward of ``model``'s transformer: (x, t, text)."""
    calls = []

    def hook(module, args, kwargs):
        calls.append((kwargs["hidden_states"].detach().clone(), kwargs["timestep"].detach().clone(),
                      kwargs["encoder_hidden_states"].detach().clone()))

    model.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def test_loss_is_the_head_regression_plus_the_weighted_dm_term(tiny_base, training):
    w, dm_weight = 2.0, 0.7  # teacher CFG (the PDD target's and the real score's), the DM term's weight
    method = make(tiny_base, training, block_size_max=P, teacher_guidance_scale=w, dm_weight=dm_weight,
                  generator_update_interval=2)
    student, teacher, critic = method.student, method.teacher, method.critic
    s_calls, t_calls, c_calls = record(student), record(teacher), record(critic)
    for step in (1, 2):  # step 1: head regression only; step 2: + the DM term
        for calls in (s_calls, t_calls, c_calls):
            calls.clear()
        method.zero_grad(step)
        check_step(method, step, w, dm_weight, s_calls, t_calls, c_calls)


def check_step(method, step, w, dm_weight, s_calls, t_calls, c_calls):
    starts, heads_k = [3, 1], [5, 4]  # each row its own block start and head
    draws = iter([[(n + 0.5) / P for n in starts], [(k - n + 0.5) / (P - n) for n, k in zip(starts, heads_k)]])
    method.global_uniforms = lambda rows: next(draws)
    student, teacher, critic = method.student, method.teacher, method.critic
    raw = raw_batch()
    out = method.single_train_step(raw, step=step)
    objective = float(out.losses["total_loss"].detach())
    method.backward(out)
    dm = step % 2 == 0
    assert (len(s_calls), len(t_calls), len(c_calls)) == (1, 4 if dm else 2, 2 if dm else 1)
    sigmas = student.fine_sigmas()
    cond = Conditioning(raw["text_embeds"], raw["empty_text_embeds"].expand_as(raw["text_embeds"]))
    x_n, t_n = s_calls[0][0].float(), s_calls[0][1]
    torch.testing.assert_close(t_n, (sigmas[torch.tensor(starts)] * 1000).float())

    def guided(model, x, t):
        c = model.predict_noise(x, t, cond, conditional=True).double()
        u = model.predict_noise(x, t, cond, conditional=False).double()
        return u + w * (c - u)

    rows = list(zip(starts, heads_k))
    with torch.no_grad():
        heads = student.predict_pdd_heads(x_n, t_n, cond).double()  # [B, P, ...]
        x_k = torch.stack([x_n[i].double() + sum((sigmas[j + 1] - sigmas[j]).double() * heads[i, j] for j in range(n, k))
                           for i, (n, k) in enumerate(rows)])
        target = guided(teacher, x_k.float(), (sigmas[torch.tensor(heads_k)] * 1000).float())
        pdd = float((torch.stack([heads[i, k] for i, k in enumerate(heads_k)]) - target).pow(2).mean())
        x0 = torch.stack([x_n[i].double() - float(sigmas[n]) * sum(w * heads[i, j] for j, w in
                                                                    zip(range(n, P), block_weights(sigmas, n, P)))
                          for i, (n, _) in enumerate(rows)])  # each row's one-forward jump [n_i, P) to σ = 0
    assert float(out.losses["pdd_loss"]) == pytest.approx(pdd, rel=1e-4)
    if dm:
        x_tau, tau = t_calls[2][0].float(), t_calls[2][1]
        assert torch.equal(c_calls[0][0].float(), x_tau) and torch.equal(c_calls[0][1], tau)
        with torch.no_grad():
            sigma_tau = (tau.double() / 1000).view(-1, 1, 1, 1, 1)
            fake = x_tau.double() - sigma_tau * critic.predict_noise(x_tau, tau, cond, conditional=True).double()
            real = x_tau.double() - sigma_tau * guided(teacher, x_tau, tau)
            norm = (x0 - real).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
            g = (fake - real) / norm
        gen = float(0.5 * (g ** 2).mean())
        assert float(out.losses["generator_loss"]) == pytest.approx(gen, rel=1e-3)
        assert objective == pytest.approx(pdd + dm_weight * gen, rel=1e-4)
    else:
        assert "generator_loss" not in out.losses and objective == pytest.approx(pdd, rel=1e-4)
    assert float(out.losses["total_loss"]) == pytest.approx(objective + float(out.losses["critic_loss"]), rel=1e-6)
    bank = student.head_bank
    graded = [j for j in range(P) if bank.weight[j].grad is not None]
    assert graded == (list(range(min(starts), P)) if dm else sorted(heads_k))  # the DM term: every head of the rows' jumps
    assert all(p.grad is not None for p in critic.transformer.parameters() if p.requires_grad)
    assert all(p.grad is None for p in teacher.transformer.parameters())


def test_config_checks(tiny_base, training):
    with pytest.raises(ValueError, match="dm_weight"):
        DMPDDConfig(dm_weight=-1.0)
    with pytest.raises(ValueError, match="min_score_timestep_ratio"):
        DMPDDConfig(min_score_timestep_ratio=0.9, max_score_timestep_ratio=0.5)
    student = PDDWanModel(PDDWanModelConfig(init_from=str(tiny_base), pdd_steps=P), "student")
    teacher = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=False), "teacher")
    with pytest.raises(UserError, match="needs roles student, teacher, critic; missing critic"):
        DMPDDMethod(DMPDDConfig(), {"student": student, "teacher": teacher}, training)
