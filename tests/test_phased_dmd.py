"""Phased DMD (src/distillery/methods/phased_dmd.py) on the tiny two-expert Wan 2.2 A14B.

- against LightX2V's own code on the same tensors: its subinterval forward and velocity target
  (``trainers/phased_dmd/math.py``), its phase DMD loss and fake-score loss (``PhasedRolloutEngine._dmd_loss_for_region``,
  ``_fake_loss_for_score_range``), compiled from the repository's source (``ast``, unchanged) and run with torch —
  the loss and its gradient equal ours;
- the method: the ladder splits at the experts' boundary, the phases alternate by blocks of the update interval, each
  exit draw is inside its phase; a high step trains only the high-noise experts of the student and the critic, a low
  step only the low-noise ones; the rollout is the deployed ``few_step_x0`` (``renoise: ode``) sampler and the high
  anchor is the state it hands the low phase; bad configurations are one line;
- through the trainer: both experts of the student and the critic train, the export samples it as validate does.
(1 rank ≡ 2 ranks and a bitwise resume: tests/test_a14b_ranks.py.)
"""

from __future__ import annotations
import __future__

import ast
import copy
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import nudge_weights, run_config

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.dmd2 import ScoreModels, distribution_matching_loss, fake_score_loss
from distillery.methods.phased_dmd import (
    PhasedDMDConfig,
    PhasedDMDMethod,
    phase_coefficients,
    phase_forward,
    phase_velocity_target,
)
from distillery.models.base import Conditioning
from distillery.models.schedule import x0_from_velocity
from distillery.models.wan import WanModel, WanModelConfig
from distillery.sampling import build_sampler
from distillery.sampling.noise import RNGNoise
from distillery.tinybase.wan22 import A14B_BOUNDARY_RATIO

BOUNDARY = A14B_BOUNDARY_RATIO * 1000
LADDER = [1000.0, 900.0, 500.0, 250.0]  # high: 1000, 900; low: 500, 250 (σ_b = 0.5)
LIGHTX2V = Path(os.environ.get("DISTILLERY_LIGHTX2V_SRC", "/work/.mirror/ModelTC+LightX2V/repo"))
TRAINERS = "lightx2v_train/lightx2v_train/trainers"


# -- LightX2V's own functions ---------------------------------------------------------------------
def _source(relative: str) -> str:
    """A file of LightX2V's repository: from an unpacked tree, or the HEAD of a git mirror (no work tree)."""
    if (LIGHTX2V / relative).is_file():
        return (LIGHTX2V / relative).read_text()
    if not LIGHTX2V.is_dir():
        pytest.skip(f"LightX2V's source is not at {LIGHTX2V} (DISTILLERY_LIGHTX2V_SRC)")
    out = subprocess.run(["git", "--git-dir", str(LIGHTX2V), "show", f"HEAD:{relative}"], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"{relative} is not in {LIGHTX2V}: {out.stderr.strip()[:200]}")
    return out.stdout


def _compiled(relative: str, names: set[str], namespace: dict[str, Any], cls: str | None = None) -> dict[str, Any]:
    """The functions ``names`` of LightX2V's file ``relative`` (the methods of class ``cls``), compiled unchanged."""
    tree = ast.parse(_source(relative), filename=relative)
    body = tree.body if cls is None else next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    funcs = [node for node in body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {f.name for f in funcs} == names
    code = compile(ast.Module(body=funcs, type_ignores=[]), relative, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)
    return {name: namespace[name] for name in names}


def lightx2v() -> dict[str, Any]:
    import torch.nn.functional as F

    ns: dict[str, Any] = {"torch": torch, "F": F, "broadcast_sequence_parallel_value": lambda value: value}
    dmd = _compiled(f"{TRAINERS}/dmd/math.py", {"expand_sigma", "euler_step", "do_cfg", "dmd_loss"}, ns)
    phased = _compiled(f"{TRAINERS}/phased_dmd/math.py", {"phased_coefficients", "phased_forward",
                                                           "phased_velocity_target"}, ns)
    engine = _compiled(f"{TRAINERS}/phased_dmd/rollout.py", {"_dmd_loss_for_region", "_fake_loss_for_score_range",
                                                             "_teacher_velocity", "_fake_model_for_dmd"}, ns,
                       cls="PhasedRolloutEngine")
    return {**dmd, **phased, **engine}


class _Velocity:
    """A model whose velocity is given (``cond``, and ``uncond`` for the unconditional branch); LightX2V's
    ``_predict_velocity(model, x, sigma, condition)`` and our ``predict_x0`` / ``predict_noise`` both read it."""

    boundary_timestep = None

    def __init__(self, cond: torch.Tensor, uncond: torch.Tensor | None = None) -> None:
        from distillery.models.schedule import FlowMatchSchedule

        self.cond, self.uncond = cond, uncond if uncond is not None else cond
        self.schedule = FlowMatchSchedule(shift=3.0)
        self.transformer = torch.nn.Identity()  # LightX2V calls .transformer.eval() / .train()

    def velocity(self, conditional: bool) -> torch.Tensor:
        return self.cond if conditional else self.uncond

    def predict_noise(self, x, t, cond, conditional=True):
        return self.velocity(conditional)

    def predict_x0(self, x, t, cond, conditional=True):
        return x0_from_velocity(x, self.velocity(conditional), self.schedule.sigma(t))


class _Draws:
    """A random stream that hands out given noise (what ``torch.randn_like`` gave LightX2V's code)."""

    def __init__(self, noise: torch.Tensor) -> None:
        self.noise = noise

    def randn(self, shape, dtype=torch.float32):
        assert tuple(shape) == tuple(self.noise.shape)
        return self.noise.clone()


@pytest.mark.parametrize("phase,sigma_s", [("high", 0.5), ("low", 0.0)])
def test_the_phase_losses_and_gradients_are_lightx2vs_on_the_same_tensors(phase, sigma_s):
    ref = lightx2v()
    g = torch.Generator().manual_seed(3)
    b, shape = 3, (4, 2, 6, 6)
    anchor, x0_init = torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)
    v_fake, v_cond, v_uncond = (torch.randn(b, *shape, generator=g) for _ in range(3))
    sigma_t = torch.tensor([0.95, 0.9, 0.97]) if phase == "high" else torch.tensor([0.3, 0.05, 0.45])
    w, eps = 3.5, 1e-8
    # the subinterval's maths: the forward and the target, and the marginal they keep
    for s in ((sigma_s, 0.3) if phase == "high" else (sigma_s, 0.02)):  # below every σ_t of the phase
        a, bt = phase_coefficients(s, sigma_t, anchor)
        ref_s = torch.full((b,), s)
        noise = torch.randn(b, *shape, generator=g)
        torch.testing.assert_close(phase_forward(anchor, noise, s, sigma_t), ref["phased_forward"](anchor, noise, ref_s, sigma_t, eps))
        torch.testing.assert_close(phase_velocity_target(anchor, noise, s, sigma_t),
                                   ref["phased_velocity_target"](anchor, noise, ref_s, sigma_t, eps))
        torch.testing.assert_close(a * (1 - s), (1 - sigma_t).view(-1, 1, 1, 1, 1).expand_as(a))  # the clean part: 1 − σ_t
        torch.testing.assert_close(a**2 * s**2 + bt**2, (sigma_t**2).view(-1, 1, 1, 1, 1).expand_as(a))  # the noise: σ_t
    fake, teacher = _Velocity(v_fake), _Velocity(v_cond, v_uncond)
    owner = type("Owner", (), {
        "match_timestep": 500, "score_timestep_margin": 20, "num_train_timestep": 1000, "running_dtype": torch.float32,
        "teacher_model": teacher, "teacher_2_model": teacher, "fake_model": fake, "fake_2_model": fake,
        "fake_low_high_model": None, "guidance_distill": w, "cfg_norm": None, "dmd_norm_clip_min": None,
        "_sample_score_sigma_range": lambda self, *args: sigma_t,
        "_phased_forward": lambda self, xs, n, s, t: ref["phased_forward"](xs, n, s, t, eps),
        "_phased_velocity_target": lambda self, xs, n, s, t: ref["phased_velocity_target"](xs, n, s, t, eps),
        "_predict_velocity": lambda self, model, x, sigma, condition: model.velocity(condition == "c"),
        "_euler_step": lambda self, x, v, s, s2: ref["euler_step"](x, v, s, s2),
        "_dmd_loss": lambda self, latents, f, r, norm_clip_min=None: ref["dmd_loss"](latents, f, r, norm_clip_min),
        "_do_cfg": lambda self, c, u, scale, norm: ref["do_cfg"](c, u, scale, norm),
        **{name: ref[name] for name in ("_dmd_loss_for_region", "_fake_loss_for_score_range", "_teacher_velocity",
                                        "_fake_model_for_dmd")}})()
    theirs_x0 = x0_init.clone().requires_grad_(True)
    torch.manual_seed(11)
    noise = torch.randn_like(anchor)
    torch.manual_seed(11)  # LightX2V draws its noise with torch.randn_like: the same draw
    their_loss = owner._dmd_loss_for_region(anchor, theirs_x0, torch.full((b,), sigma_s), ("c", "u"), phase, phase)
    their_loss.backward()
    ours_x0 = x0_init.clone().requires_grad_(True)
    scores = ScoreModels(teacher, fake, lambda n: sigma_t * 1000, _Draws(noise),
                         noised=lambda n, s: phase_forward(anchor, n, sigma_s, s),
                         target=lambda n, s: phase_velocity_target(anchor, n, sigma_s, s))
    cond = Conditioning(torch.zeros(b, 2, 4), torch.zeros(b, 2, 4))
    our_loss, _ = distribution_matching_loss(ours_x0, cond, scores, w)
    our_loss.backward()
    torch.testing.assert_close(our_loss, their_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours_x0.grad, theirs_x0.grad, rtol=1e-4, atol=1e-9)
    # the critic's loss on the anchor: the subinterval's target at the same draws
    their_v = v_fake.clone().requires_grad_(True)
    critic = _Velocity(their_v)
    owner.fake_model = critic
    torch.manual_seed(11)
    their_fake = owner._fake_loss_for_score_range(critic, anchor, torch.full((b,), sigma_s), "c", 1, 1000)
    their_fake.backward()
    our_v = v_fake.clone().requires_grad_(True)
    our_fake, _ = fake_score_loss(anchor, cond, ScoreModels(teacher, _Velocity(our_v), scores.draw_timesteps, _Draws(noise),
                                                            noised=scores.noised, target=scores.target))
    our_fake.backward()
    torch.testing.assert_close(our_fake, their_fake, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(our_v.grad, their_v.grad, rtol=1e-4, atol=1e-9)


# -- the method on the tiny two-expert Wan ---------------------------------------------------------
@pytest.fixture(scope="module")
def training(a14b, latent_set):
    return load_run_config(raw=run_config(a14b, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def make(a14b: Path, training, **knobs) -> PhasedDMDMethod:
    models = {role: WanModel(WanModelConfig(init_from=str(a14b), trainable=role != "teacher"), role)
              for role in ("student", "teacher", "critic")}
    for model in models.values():
        model.bind_device(torch.device("cpu"))
    nudge_weights(models["critic"].transformer)
    method = PhasedDMDMethod(PhasedDMDConfig(**{"student_timesteps": LADDER, **knobs}), models, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    return method


def raw_batch(b: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"latents": torch.randn(b, 8, 3, 8, 8, generator=g), "text_embeds": torch.randn(b, 8, 32, generator=g),
            "empty_text_embeds": torch.randn(8, 32, generator=g)}


def test_the_phases_split_the_ladder_at_the_boundary_and_alternate(a14b, training):
    method = make(a14b, training, generator_update_interval=2)
    assert (method.split, method.sigma_b, method.boundary) == (2, 0.5, BOUNDARY)
    assert [method.phase_of(s) for s in range(1, 9)] == ["high", "high", "low", "low"] * 2
    assert [method.is_update_step(s) for s in range(1, 5)] == [False, True, False, True]  # each phase's block ends updating
    highs = {method.draw_phase_exit("high") for _ in range(40)}
    lows = {method.draw_phase_exit("low") for _ in range(40)}
    assert highs == {0, 1} and lows == {2, 3}
    tau = {phase: method.draw_phase_timesteps(256, phase) for phase in ("high", "low")}
    assert bool((tau["high"] >= BOUNDARY).all()) and bool((tau["low"] < BOUNDARY).all())
    assert method.sampling_contract() == {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000,
                                          "timesteps": LADDER, "renoise": "ode"}


@pytest.mark.parametrize("phase,step", [("high", 1), ("low", 2)])
def test_a_step_trains_only_its_phases_experts(a14b, training, phase, step):
    """A high step's generator gradient reaches only the student's high-noise expert and its critic loss only the
    critic's; a low step only the low-noise ones; the teacher none. Both phases' teacher guidance: their own scale."""
    method = make(a14b, training, generator_update_interval=1, real_score_guidance_scale=4.0, real_score_guidance_scale_2=3.0)
    assert method.phase_of(step) == phase
    out = method.single_train_step(raw_batch(), step=step)
    method.backward(out)
    assert out.metrics["phase"] == float(phase == "low")
    assert (float(out.metrics["score_timestep"]) >= BOUNDARY) == (phase == "high")
    for role in ("student", "critic"):
        high, low = getattr(method, role).transformer.experts
        touched = [any(p.grad is not None and p.grad.abs().sum() > 0 for p in e.parameters()) for e in (high, low)]
        assert touched == [phase == "high", phase == "low"], role
    assert all(p.grad is None for p in method.teacher.transformer.parameters())


def test_the_rollout_is_the_deployed_sampler_and_the_high_anchor_its_hand_over(a14b, training):
    method = make(a14b, training)
    batch = raw_batch()
    cond = Conditioning(batch["text_embeds"], batch["empty_text_embeds"].expand_as(batch["text_embeds"]))
    sampler = build_sampler(method.sampling_contract())
    rng = copy.deepcopy(method.rng)
    with torch.no_grad():
        x0, sample, _ = method.phase_rollout(batch, len(LADDER) - 1, "low", with_grad=False)
        want = sampler.sample(method.student, cond, (8, 3, 8, 8), RNGNoise(rng))
    assert torch.equal(x0, want) and sample.sigma_s == 0.0 and torch.equal(sample.anchor, x0)
    # the high phase's anchor from its last step is the state the sampler takes into the low phase (t_m = 500)
    rng = copy.deepcopy(method.rng)
    with torch.no_grad():
        _, high, _ = method.phase_rollout(batch, 1, "high", with_grad=False)
        two = build_sampler({**method.sampling_contract(), "timesteps": LADDER[:2] + [0.0]})
        noise = RNGNoise(rng).randn((2, 8, 3, 8, 8), "cpu")
        x = noise
        for k, t in enumerate(LADDER[:2]):
            v = method.student.predict_noise(x, torch.full((2,), t), cond)
            x = x + (LADDER[k + 1] / 1000 - t / 1000) * v
    assert high.sigma_s == 0.5 and two is not None
    torch.testing.assert_close(high.anchor, x, rtol=0, atol=1e-6)


def test_bad_configurations_are_one_line(a14b, tiny_base, training):
    with pytest.raises(ValueError, match="rollout must be simulate"):
        PhasedDMDConfig(rollout="data_latent")
    with pytest.raises(UserError, match="gives the low-noise expert no step"):
        make(a14b, training, student_timesteps=[1000.0, 950.0, 900.0])
    with pytest.raises(UserError, match="must hold the experts' boundary"):
        make(a14b, training, max_score_timestep_ratio=0.8)
    models = {role: WanModel(WanModelConfig(init_from=str(tiny_base if role == "critic" else a14b),
                                            trainable=role != "teacher"), role) for role in ("student", "teacher", "critic")}
    with pytest.raises(UserError, match="models.critic: Phased DMD distils each expert on its own phase; .* one expert"):
        PhasedDMDMethod(PhasedDMDConfig(student_timesteps=LADDER), models, training)
    configs = {role: WanModelConfig(init_from=str(tiny_base if role == "teacher" else a14b), trainable=role != "teacher")
               for role in ("student", "teacher", "critic")}  # from the run config, before any weights load
    with pytest.raises(UserError, match="models.teacher: Phased DMD distils each expert on its own phase; .* one expert"):
        PhasedDMDMethod.check_roles(configs)


def test_phased_dmd_trains_both_experts_through_the_trainer_and_exports(a14b, latent_set, tmp_path):
    import json
    import shutil

    from helpers import role_state, train_in_process

    from distillery.export.weights import export_weights
    from distillery.models import registry

    cfg = run_config(a14b, latent_set, tmp_path / "run", method="distillery.methods.phased_dmd.PhasedDMDMethod", steps=4,
                     batch_size=2, save_every=4, method_knobs={"generator_update_interval": 1, "student_timesteps": LADDER,
                                                              "real_score_guidance_scale": 3.0})
    wan = "distillery.models.wan.WanModel"
    cfg["models"]["critic"] = {"_target_": wan, "init_from": str(a14b)}
    cfg["models"]["teacher"] = {"_target_": wan, "init_from": str(a14b), "trainable": False}
    result = train_in_process(cfg)
    assert [r["phase"] for r in result.history] == [0.0, 1.0, 0.0, 1.0]
    before = WanModel(WanModelConfig(init_from=str(a14b), trainable=False), "b").transformer.state_dict()
    for role in ("student", "critic"):
        after = role_state(result.checkpoint, role)
        for prefix in ("transformer.", "transformer_2."):
            assert any(not torch.equal(after[k], before[k]) for k in after if k.startswith(prefix)), (role, prefix)
    export_weights(result.checkpoint, "student", tmp_path / "model")
    shutil.copytree(a14b / "scheduler", tmp_path / "model" / "scheduler")
    contract = json.loads((tmp_path / "run" / "run_summary.json").read_text())["sampling"]
    assert contract == {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": LADDER,
                        "renoise": "ode"}
    assert registry.family_of(tmp_path / "model").name == "wan2.2-a14b"
    # the export's own sampler over both trained experts: validate's latents, bit for bit
    from helpers import shipped_denoiser

    from distillery.export.standalone import distilled_samplers, distilled_wan

    text = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4))
    plugin = registry.load_inference_model(tmp_path / "model", shift=3.0)
    expected = build_sampler(contract).sample(plugin, Conditioning(text), (8, 3, 8, 8), torch.Generator().manual_seed(5))
    shipped = distilled_samplers.build_sampler(contract)
    got = shipped.sample(shipped_denoiser(tmp_path / "model", {}), distilled_wan.Conditioning(text), (8, 3, 8, 8),
                         torch.Generator().manual_seed(5))
    assert torch.equal(got, expected)
