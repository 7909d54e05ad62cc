"""Callbacks on plain modules: grad-norm/clip against torch's reference, EMA arithmetic."""

from __future__ import annotations

import torch

from distillery.callbacks.ema import EMACallback, EMAConfig
from distillery.callbacks.grad_clip import clip_to_norm, total_grad_norm


def _module_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    m(torch.randn(4, 7)).pow(2).sum().backward()
    return m


def test_grad_norm_and_clip_match_torch():
    for norm_type in (1.0, 2.0, 3.0):
        a, b = _module_with_grads(), _module_with_grads()
        ref = torch.nn.utils.clip_grad_norm_(list(b.parameters()), 0.1, norm_type=norm_type)
        params = list(a.parameters())
        total = total_grad_norm(params, norm_type)
        torch.testing.assert_close(total, ref)
        clip_to_norm(params, 0.1, total)
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa.grad, pb.grad)
    small = _module_with_grads()
    before = [p.grad.clone() for p in small.parameters()]
    clip_to_norm(list(small.parameters()), 1e6, total_grad_norm(list(small.parameters())))
    assert all(torch.equal(x, p.grad) for x, p in zip(before, small.parameters()))  # under the limit: untouched


class _Role:
    """The one thing EMA asks of a role: its trainable modules."""

    def __init__(self, module):
        self.module = module

    def trainable_modules(self):
        return {"transformer": self.module}


def test_ema_tracks_the_weights_with_the_given_decay():
    from distillery.callbacks.base import CallbackContext

    m = torch.nn.Linear(3, 2)
    ema = EMACallback(EMAConfig(decay=0.75, start_step=2), "ema")
    ctx = CallbackContext(roles={"student": _Role(m)}, rank=0, world_size=1, max_train_steps=10,
                          roles_to_step=lambda step: ["student"] if step != 3 else [])
    ema.on_train_start(ctx)
    w0 = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.add_(1.0)
    ema.on_training_step_end(ctx, 1)  # before start_step: copy
    torch.testing.assert_close(ema.shadow["student"]["transformer"]["weight"], w0 + 1.0)
    with torch.no_grad():
        m.weight.add_(4.0)
    ema.on_training_step_end(ctx, 2)
    expected = 0.75 * (w0 + 1.0) + 0.25 * (w0 + 5.0)
    torch.testing.assert_close(ema.shadow["student"]["transformer"]["weight"], expected)
    with torch.no_grad():
        m.weight.add_(2.0)
    ema.on_training_step_end(ctx, 3)  # the student did not step at 3: its average stays
    assert torch.equal(ema.shadow["student"]["transformer"]["weight"], expected)
    state = {r: {k: {n: t.clone() for n, t in v.items()} for k, v in mods.items()} for r, mods in ema.state_dict().items()}
    other = EMACallback(EMAConfig(decay=0.75), "ema")
    other.on_train_start(ctx)
    other.load_state_dict(state)
    torch.testing.assert_close(other.shadow["student"]["transformer"]["weight"], ema.shadow["student"]["transformer"]["weight"])


def test_ema_shadow_after_n_trainer_steps_is_the_hand_written_average(tmp_path, tiny_base, latent_set):
    """Through the real trainer (SFT on the tiny Wan, 6 steps, a checkpoint after every step): the EMA shadow
    in the last checkpoint is the average written out by hand over each step's saved weights w_k —
    s = w_k while k < start_step, then s ← lerp(s, w_k, 1 − d) in fp32, as torch.lerp computes it — bit for bit
    (the shadow weights component keeps the EMA exactly as the callback computed it before it existed), and not the
    last weights themselves."""
    from helpers import role_state, run_config, train_in_process

    decay, start, steps = 0.6, 3, 6
    ema = {"_target_": "distillery.callbacks.ema.EMACallback", "decay": decay, "start_step": start}
    cfg = run_config(tiny_base, latent_set, tmp_path / "run", steps=steps, save_every=1, lr=1e-2, callbacks={"ema": ema})
    train_in_process(cfg)
    weights = [role_state(tmp_path / "run" / f"checkpoint-{k}") for k in range(1, steps + 1)]  # w_1 … w_N
    reference: dict[str, torch.Tensor] = {}
    for k, w in enumerate(weights, start=1):
        for name, t in w.items():
            reference[name] = t.float().clone() if k < start else torch.lerp(reference[name], t.float(), 1.0 - decay)
    shadow = role_state(tmp_path / "run" / f"checkpoint-{steps}", ema="ema")
    assert shadow.keys() == reference.keys()
    for name in reference:
        assert torch.equal(shadow[name], reference[name]), name
    moved = [n for n in reference if not torch.equal(reference[n], weights[-1][n])]
    assert moved, "the average must differ from the last weights (else the test cannot tell them apart)"
