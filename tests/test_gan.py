"""The discriminator term of DMD2 and Self-Forcing (src/distillery/methods/gan.py) on the tiny Wan.

- off by default: no head, nothing read beyond what DMD2 read; on: a head trained with the critic (one of its
  trainable modules), the method reads the set's latents (its real samples), a prompt-only set refused in one line;
- the student's term: its gradient with respect to the sample is the non-saturating loss's, recomputed by hand from
  the same draws; the critic and the head get none of it;
- the critic's step: the discriminator's loss is softplus(−D(real)) + softplus(D(fake)) on real latents and the
  student's sample noised to the same timesteps, added to the fake-score loss; the head gets gradients.

Through the trainer (1 rank ≡ 2 ranks, a stopped run resumed bit for bit): tests/test_ranks_and_resume.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import nudge_weights, prompt_twin, run_config, tiny_raw_batch

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.dmd2 import DMD2Config, DMD2Method, critic_flow_matching
from distillery.methods.gan import (
    HEAD_NAME,
    DiscriminatorHead,
    critic_step_with_discriminator,
    default_feature_blocks,
    generator_gan_term,
)
from distillery.models.schedule import renoise
from distillery.models.wan import WanModel, WanModelConfig


@pytest.fixture(scope="module")
def training(tiny_base: Path, latent_set: Path):
    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def make(tiny_base: Path, training, **knobs) -> DMD2Method:
    models = {role: WanModel(WanModelConfig(init_from=str(tiny_base), trainable=role != "teacher"), role)
              for role in ("student", "teacher", "critic")}
    nudge_weights(models["critic"].transformer)
    method = DMD2Method(DMD2Config(**{"generator_update_interval": 1, "real_score_guidance_scale": 2.0, **knobs}), models,
                        training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    return method


def test_the_default_blocks_and_the_head():
    assert default_feature_blocks(30) == [13, 21, 29]  # the Self-Forcing code's
    assert default_feature_blocks(4) == [1, 2, 3] and default_feature_blocks(1) == [0]
    head = DiscriminatorHead(256, 2)
    assert head.heads == 2
    logits = head([torch.randn(3, 10, 256), torch.randn(3, 10, 256)])
    assert logits.shape == (3,) and logits.dtype == torch.float32


def test_off_by_default_on_with_a_head_on_the_critic(tiny_base, training):
    off = make(tiny_base, training)
    assert off.gan_blocks is None and list(off.critic.trainable_modules()) == ["transformer"]
    assert not DMD2Method.reads_latents(DMD2Config())
    on = make(tiny_base, training, gan_weight=0.1)
    assert on.gan_blocks == [1, 2, 3] and list(on.critic.trainable_modules()) == ["transformer", HEAD_NAME]
    assert DMD2Method.reads_latents(DMD2Config(gan_weight=0.1))
    head_params = {id(p) for p in on.critic.attached[HEAD_NAME].parameters()}
    assert head_params <= {id(p) for group in on.optimizers["critic"].param_groups for p in group["params"]}
    with pytest.raises(UserError, match=r"gan_feature_blocks: \[4\]: need block indices of the critic's 4 blocks"):
        make(tiny_base, training, gan_weight=0.1, gan_feature_blocks=[4])


def test_a_prompt_only_set_is_refused_before_any_model_loads(tiny_base, latent_set, tmp_path):
    from distillery.engine.batches import check_data_kind

    cfg = run_config(tiny_base, prompt_twin(latent_set, tmp_path / "prompts"), tmp_path / "run",
                     method="distillery.methods.dmd2.DMD2Method", method_knobs={"gan_weight": 0.05})
    with pytest.raises(UserError, match=r"DMD2Method's GAN term \(gan_weight 0.05\) needs real latents for its discriminator"):
        check_data_kind(load_run_config(raw=cfg, prefixes=allowed_prefixes()))


def _features(method: DMD2Method, x: torch.Tensor, t: torch.Tensor, cond) -> torch.Tensor:
    _, features = method.critic.predict_noise_with_features(x, t, cond, method.gan_blocks)
    return method.critic.attached[HEAD_NAME](features)


def test_the_students_term_is_the_non_saturating_loss_and_only_the_student_gets_it(tiny_base, training):
    method = make(tiny_base, training, gan_weight=0.1)
    cond = method.student.prepare_batch(tiny_raw_batch(), method.rng)
    x0 = torch.randn(cond.noise.shape, generator=torch.Generator().manual_seed(4)).requires_grad_()
    state = method.rng.generator.get_state()
    term, metrics = generator_gan_term(x0, cond, method.score_models(), method.gan_blocks)
    term.backward()
    method.rng.generator.set_state(state)  # the same draws, by hand: τ' then ε'
    tau = method.draw_score_timesteps(x0.shape[0])
    noise = method.rng.randn(x0.shape)
    leaf = x0.detach().clone().requires_grad_()
    loss = F.softplus(-_features(method, renoise(leaf, noise, method.critic.schedule.sigma(tau)), tau, cond)).mean()
    (expected,) = torch.autograd.grad(loss, leaf)
    torch.testing.assert_close(x0.grad, expected, rtol=1e-5, atol=1e-8)
    assert float(metrics["gan_generator_loss"]) == pytest.approx(float(loss.detach()), rel=1e-6)
    assert all(p.grad is None for module in method.critic.trainable_modules().values() for p in module.parameters())


def test_the_critics_step_adds_the_discriminators_loss_at_the_same_timesteps(tiny_base, training):
    weight = 0.5
    method = make(tiny_base, training, gan_weight=0.1, gan_discriminator_weight=weight)
    cond = method.student.prepare_batch(tiny_raw_batch(), method.rng)
    sample = torch.randn(cond.noise.shape, generator=torch.Generator().manual_seed(5))
    seen: list[torch.Tensor] = []
    method.critic.transformer.register_forward_hook(lambda m, a, k, o: seen.append(k["timestep"].clone()), with_kwargs=True)
    state = method.rng.generator.get_state()
    fake = critic_flow_matching(sample, cond, method.score_models(), 0, method.gan_blocks)
    total, metrics = critic_step_with_discriminator(fake, cond.latents, cond, method.score_models(), method.gan_blocks,
                                                    weight, 1)
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])  # the fake and the real pass at the same t
    head = method.critic.attached[HEAD_NAME]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters())
    method.rng.generator.set_state(state)  # by hand: t, ε (the fake-score pass), then ε_r
    t = method.draw_score_timesteps(sample.shape[0])
    eps = method.rng.randn(sample.shape)
    eps_real = method.rng.randn(sample.shape)
    sigma = method.critic.schedule.sigma(t)
    with torch.no_grad():
        d_fake = _features(method, renoise(sample, eps, sigma), t, cond)
        d_real = _features(method, renoise(cond.latents, eps_real, sigma), t, cond)
    d_loss = F.softplus(-d_real).mean() + F.softplus(d_fake).mean()
    assert float(metrics["gan_discriminator_loss"]) == pytest.approx(float(d_loss), rel=1e-5)
    assert float(total) == pytest.approx(float(fake.loss.detach()) + weight * float(d_loss), rel=1e-5)


def test_sequence_parallelism_is_refused_with_the_gan_term_before_any_model_loads(tiny_base, latent_set, tmp_path):
    from distillery.engine.builder import check_roles_early

    cfg = run_config(tiny_base, latent_set, tmp_path / "run", method="distillery.methods.dmd2.DMD2Method",
                     method_knobs={"gan_weight": 0.05})
    wan = "distillery.models.wan.WanModel"
    cfg["models"].update(teacher={"_target_": wan, "init_from": str(tiny_base), "trainable": False},
                         critic={"_target_": wan, "init_from": str(tiny_base)})
    cfg["training"]["distributed"] = {"sp_size": 2}
    with pytest.raises(UserError, match=r"sp_size: 2, but DMD2Method's GAN term \(gan_weight 0.05\) does not take sequence"):
        check_roles_early(load_run_config(raw=cfg, prefixes=allowed_prefixes()))
    cfg["method"]["gan_weight"] = 0.0
    check_roles_early(load_run_config(raw=cfg, prefixes=allowed_prefixes()))  # DMD2 alone takes it
