"""Causal consistency distillation and Teacher-Forcing SFT against FastVideo 0.2.1's own code, on the same tensors.

tests/fastvideo_oracle.py runs FastVideo's ``CausalConsistencyDistillationMethod`` and ``TeacherForcingSFTMethod``
(their ``__init__``, ``single_train_step``, ``backward`` and, for causal CD, ``optimizers_schedulers_step`` with its EMA
update) in a process of their own, on our tiny causal Wan with the weights and the batch given here, and returns the
loss, the student's gradients and the draws FastVideo made (its grid index or table indices, its noise). Our methods
then take the same draws (our own random stream draws differently: the draws are the input, not the compared thing)
and must give the same loss and gradients; causal CD's target must follow the student as FastVideo's EMA does; our
teacher-forcing attention must be FastVideo's teacher-forcing mask, token for token. What the oracle sets up around
FastVideo's code (three aggregator ``__init__`` not run, a ``torchvision.utils`` stand-in never called, our models
behind its model interface) is in its module doc.

The FastVideo wheel is fetched with pip into ``$DISTILLERY_TEST_CACHE`` (default ``~/.cache/distillery-tests``) once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fastvideo_oracle import fastvideo_site, run_oracle
from helpers import nudge_weights, run_config, tiny_raw_batch

from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.causal_cd import CausalCDConfig, CausalCDMethod
from distillery.methods.tfsft import TFSFTConfig, TFSFTMethod
from distillery.models.wan.causal import CausalWanModel, CausalWanModelConfig, _AttentionPlan

pytestmark = pytest.mark.process
LR, SEED = 1e-3, 5
CD = {"num_discrete_steps": 8, "guidance_scale": 3.0, "target_decay": 0.9, "target_start_step": 1}
MASKS = [(4, 2, 2), (3, 3, 1), (6, 2, 3), (5, 1, 2)]  # (frames, tokens per frame, chunk size); the last: a short last chunk


def _causal(base: Path, role: str, trainable: bool) -> CausalWanModel:
    return CausalWanModel(CausalWanModelConfig(init_from=str(base), trainable=trainable, chunk_size=1), role)


def _batch() -> dict[str, torch.Tensor]:
    """A tiny batch (3 latent frames: 3 chunks of 1) with a per-sample empty-prompt embedding, the unconditional
    forward's input on both sides."""
    raw = tiny_raw_batch()
    empty = raw["empty_text_embeds"][None].expand(raw["text_embeds"].shape[0], -1, -1).contiguous()
    return {"latents": raw["latents"], "text_embeds": raw["text_embeds"], "negative_text_embeds": empty}


@pytest.fixture(scope="module")
def reference(tiny_base, tmp_path_factory):
    """FastVideo's outputs for the three jobs, from one oracle process; the inputs they were given."""
    cache = Path(os.environ.get("DISTILLERY_TEST_CACHE", Path.home() / ".cache" / "distillery-tests"))
    site = fastvideo_site(cache)
    student, teacher = _causal(tiny_base, "student", True), _causal(tiny_base, "teacher", False)
    nudge_weights(teacher.transformer)  # a teacher that differs from the student: the ODE step and the target differ
    batch = _batch()
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(3))
    common = {"base": str(tiny_base), "chunk_size": 1, "seed": SEED, "lr": LR, "shift": student.schedule.shift}
    specs = [
        {**common, "job": "causal_cd", "batch": batch, "iteration": 1,
         "weights": {"student": student.transformer.state_dict(), "teacher": teacher.transformer.state_dict(),
                     "ema": student.transformer.state_dict()},
         "method": {"guidance_scale": CD["guidance_scale"], "discrete_cd_N": CD["num_discrete_steps"],
                    "ema_decay": CD["target_decay"], "ema_start_step": CD["target_start_step"]}},
        {**common, "job": "tfsft", "batch": {**batch, "noise": noise}, "weights": {"student": student.transformer.state_dict()},
         "method": {"chunk_size": 1}},
        *({"job": "mask", "frames": f, "tokens_per_frame": n, "chunk_size": c} for f, n, c in MASKS),
    ]
    outputs = run_oracle(site, specs, tmp_path_factory.mktemp("oracle"))
    return {"causal_cd": outputs[0], "tfsft": outputs[1], "masks": outputs[2:], "teacher": teacher.transformer.state_dict(),
            "batch": batch, "noise": noise}


@pytest.fixture(scope="module")
def training(tiny_base, latent_set):
    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused"), lr=LR), prefixes=allowed_prefixes()).training


def _assert_grads_match(model: CausalWanModel, theirs: dict[str, torch.Tensor]) -> None:
    ours = {n: p.grad for n, p in model.transformer.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys() and ours
    for name, grad in ours.items():  # fp32 through the same networks: the arithmetic around them may round otherwise
        torch.testing.assert_close(grad, theirs[name], rtol=2e-3, atol=2e-4 * float(theirs[name].abs().max()) + 1e-12,
                                   msg=name)


def test_causal_cd_loss_gradients_and_target_are_fastvideos(reference, tiny_base, training):
    fv = reference["causal_cd"]
    student, teacher = _causal(tiny_base, "student", True), _causal(tiny_base, "teacher", False)
    teacher.transformer.load_state_dict(reference["teacher"])
    initial = {n: p.detach().clone() for n, p in student.transformer.named_parameters()}
    method = CausalCDMethod(CausalCDConfig(**CD), {"student": student, "teacher": teacher}, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    torch.testing.assert_close(method.grid, fv["timesteps"], rtol=0, atol=1e-3)  # the same discrete grid
    index = fv["index"]
    tb = student.prepare_batch(reference["batch"], method.rng, timesteps=torch.full((2,), float(method.grid[index])))
    tb.noise = fv["noise"]  # FastVideo's draws
    tb.noisy_latents = student.add_noise(tb.latents, tb.noise, tb.timesteps)
    out = method.loss(tb, index)
    method.backward(out)
    torch.testing.assert_close(out.losses["total_loss"].detach(), fv["loss"], rtol=1e-4, atol=0)
    _assert_grads_match(student, fv["grads"])
    method.optimizers_step(1)  # step 1 >= target_start_step: the target takes its first EMA step
    target = method.shadows["target"].tensors["transformer"]
    decay = CD["target_decay"]
    for name, after in fv["ema_after"].items():  # FastVideo's EMA rule is ours: lerp(initial, student, 1 − decay)
        torch.testing.assert_close(after, torch.lerp(initial[name], fv["student_after"][name], 1.0 - decay), rtol=0, atol=1e-6)
        assert torch.equal(target[name], torch.lerp(initial[name], dict(student.transformer.named_parameters())[name].detach(),
                                                    1.0 - decay)), name


def test_tfsft_loss_and_gradients_are_fastvideos(reference, tiny_base, training):
    fv = reference["tfsft"]
    student = _causal(tiny_base, "student", True)
    method = TFSFTMethod(TFSFTConfig(chunk_size=1), {"student": student}, training)
    method.on_train_start(torch.device("cpu"))
    torch.testing.assert_close(method.table, fv["timesteps"], rtol=0, atol=2e-4)  # the same timestep table ...
    torch.testing.assert_close(method.weights, fv["weights"], rtol=0, atol=1e-6)  # ... and index weights
    index = fv["index"]
    tb = student.prepare_batch(reference["batch"], method.rng, timesteps=method.table[index])
    tb.noise = reference["noise"]
    tb.noisy_latents = student.add_noise(tb.latents, tb.noise, tb.timesteps)
    out = method.loss(tb, index)
    method.backward(out)
    torch.testing.assert_close(out.losses["total_loss"].detach(), fv["loss"], rtol=1e-5, atol=0)
    _assert_grads_match(student, fv["grads"])


@pytest.mark.parametrize("case", range(len(MASKS)))
def test_teacher_forcing_attention_is_fastvideos_mask(reference, case):
    """Token for token FastVideo's mask; with a short last chunk (5 frames in chunks of 2), FastVideo's clean last chunk
    also sees the first noisy tokens — its block end is not clipped at the end of the clean half, a slip of its mask
    for lengths that are not a multiple of the chunk (Wan's 21 frames in chunks of 3 are one) — and ours does not."""
    frames, tokens, chunk = MASKS[case]
    plan = _AttentionPlan(chunk, tokens, 0, 2 * frames, context=frames)
    ours = torch.zeros(2 * frames * tokens, 2 * frames * tokens, dtype=torch.bool)
    for q0, q1, ranges in plan.key_groups():
        for begin, end in ranges:
            ours[q0:q1, begin:end] = True
    theirs = reference["masks"][case]["mask"]
    if frames % chunk == 0:
        assert torch.equal(ours, theirs)
        return
    last, clean_end = (frames // chunk) * chunk * tokens, frames * tokens
    overhang = torch.zeros_like(ours)
    overhang[last:clean_end, clean_end:last + chunk * tokens] = True  # FastVideo's clean last block, run past the clean half
    assert torch.equal(theirs, ours | overhang) and not (ours & overhang).any()
