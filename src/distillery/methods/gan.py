"""A discriminator term for distribution-matching distillation (DMD2, Self-Forcing): ``gan_weight`` > 0 in the method.

The DMD2 paper's GAN term, as the Self-Forcing code's GAN variant and NVIDIA FastGen's DMD2 add it: a small
**discriminator head** reads the critic's (the fake score's) hidden states and tells noised real latents from noised
student samples; the critic's step trains it, the student's step gets a non-saturating generator term from it.

**The head** (:class:`DiscriminatorHead`, trained with the critic: one of its trainable modules,
``roles.critic.discriminator`` in checkpoints): the hidden states ``[B, L, D]`` of a few of the critic's blocks
(``gan_feature_blocks``; default the Self-Forcing code's choice for Wan's 30 blocks, 13, 21 and 29, scaled to the
critic's depth: :func:`default_feature_blocks`) are each pooled by attention from one learned query (multi-head, 128 wide
per head), the pooled vectors concatenated, then LayerNorm → Linear(F·D → D) → SiLU → Linear(D → 1): one logit per
sample (float32).

**The critic's step** (every step, after the fake-score loss's forward, :func:`critic_step_with_discriminator`): the
fake-score forward at ``x_t = (1 − σ_t) x̂0 + σ_t ε`` also yields the fake sample's hidden states; the real latents of
the batch (the latent set's videos) are noised to the same per-sample t with fresh noise ε_r (drawn after the
fake-score draws) and run through the critic once more. Loss ``w_D · (softplus(−D(real)) + softplus(D(fake)))``
(means over the batch; ``w_D = gan_discriminator_weight``) added to the fake-score loss; gradients reach the head and
the critic's trunk. The fake pass is backpropagated before the real pass runs (one critic graph alive at a time).

**The student's step** (update steps, :func:`generator_gan_term`): per sample a score timestep τ' and noise ε' (drawn
after DMD's), ``x' = (1 − σ_τ') x̂0 + σ_τ' ε'`` *with* the student's graph; loss ``softplus(−D(x'))`` (mean), whose
gradient with respect to ``x̂0`` alone is taken (``torch.autograd.grad``: the critic and the head get none from it,
their optimizer steps on the discriminator's loss only); the student's loss adds ``gan_weight · ⟨x̂0, ∂/∂x̂0⟩`` — the
term whose gradient through the student is the GAN term's. Its value ``gan_generator_loss`` is logged. While that
gradient is taken the critic's activations are held beside the student's (one critic forward).

Real samples come from the batch's latents, so the method reads a latent set (a prompt-only set is refused in one line
before any model loads, :func:`distillery.engine.batches.check_data_kind`); a latent set of the teacher's own samples
serves as "real" as well.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from distillery.common.errors import UserError
from distillery.models.base import ModelBase
from distillery.models.schedule import renoise

HEAD_NAME = "discriminator"  # the head's name among the critic's trainable modules (roles.critic.discriminator)
SELF_FORCING_BLOCKS = (13, 21, 29)  # the Self-Forcing code's feature blocks of Wan-1.3B's 30


def default_feature_blocks(num_blocks: int) -> list[int]:
    """The Self-Forcing code's feature blocks (13, 21, 29 of 30) scaled to ``num_blocks`` blocks (distinct, sorted)."""
    return sorted({max(0, min(num_blocks - 1, round((b + 1) * num_blocks / 30) - 1)) for b in SELF_FORCING_BLOCKS})


def check_feature_blocks(blocks: list[int], num_blocks: int) -> list[int]:
    """``blocks`` when each is a block of the critic's ``num_blocks``; a one-line UserError otherwise."""
    if not blocks or any(not 0 <= int(b) < num_blocks for b in blocks):
        raise UserError(f"config error: method.gan_feature_blocks: {blocks}: need block indices of the critic's "
                        f"{num_blocks} blocks (0 … {num_blocks - 1})")
    return [int(b) for b in blocks]


class DiscriminatorHead(torch.nn.Module):
    """Logits ``[B]`` (float32) from the hidden states ``[B, L, width]`` of ``num_features`` blocks (module doc)."""

    def __init__(self, width: int, num_features: int) -> None:
        super().__init__()
        self.heads = max(1, width // 128) if width % max(1, width // 128) == 0 else 1
        self.queries = torch.nn.Parameter(torch.randn(num_features, width) / math.sqrt(width))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(num_features))
        self.keys_values = torch.nn.ModuleList(torch.nn.Linear(width, 2 * width) for _ in range(num_features))
        self.outs = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(num_features))
        self.classifier = torch.nn.Sequential(torch.nn.LayerNorm(num_features * width), torch.nn.Linear(num_features * width, width),
                                              torch.nn.SiLU(), torch.nn.Linear(width, 1))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        dtype = self.queries.dtype  # the compute dtype of the parameters (bf16 when FSDP2 gathers them so)
        pooled = []
        for i, hidden in enumerate(features):
            b, length, width = hidden.shape
            k, v = self.keys_values[i](self.norms[i](hidden.to(dtype))).chunk(2, dim=-1)
            q = self.queries[i].expand(b, 1, width)
            split = (lambda x: x.unflatten(-1, (self.heads, width // self.heads)).transpose(1, 2))  # noqa: E731
            attended = F.scaled_dot_product_attention(split(q), split(k), split(v))  # [B, heads, 1, width / heads]
            pooled.append(self.outs[i](attended.transpose(1, 2).flatten(2)).squeeze(1))
        return self.classifier(torch.cat(pooled, dim=-1)).squeeze(-1).float()


def attach_discriminator(critic: ModelBase, blocks: list[int] | None) -> list[int]:
    """Give ``critic`` a :class:`DiscriminatorHead` over the hidden states of ``blocks`` (null: the default) as its
    trainable module ``discriminator``; returns the blocks."""
    num_blocks = len(critic.shardable_blocks())
    chosen = check_feature_blocks(list(blocks), num_blocks) if blocks is not None else default_feature_blocks(num_blocks)
    critic.attach_trainable(HEAD_NAME, DiscriminatorHead(critic.hidden_width(), len(chosen)))
    return chosen


def _reaching_the_output(loss: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    """``loss`` plus zero times the critic's output: the discriminator reads hidden states only, and FSDP2 runs a
    module's backward hooks (its gradient reduce-scatter, the root's end-of-backward resharding) only when the loss
    reaches that module's output; this adds exact zeros to the gradients."""
    return loss + 0.0 * velocity.sum()


def generator_gan_term(x0: torch.Tensor, cond: Any, scores: Any, blocks: list[int]
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The student's GAN term of its sample ``x0`` (with graph): the term to add (its gradient through the student is
    the generator loss's) and the metrics (module doc: draws τ', then ε'). ``scores``: the method's
    :class:`~distillery.methods.dmd2.ScoreModels` (the critic, the score-timestep draw, the random stream)."""
    critic, head = scores.critic, scores.critic.attached[HEAD_NAME]
    tau = scores.draw_timesteps(x0.shape[0])
    noise = scores.rng.randn(x0.shape).to(x0.device)
    leaf = x0.detach().float().requires_grad_(True)
    with torch.enable_grad():
        velocity, features = critic.predict_noise_with_features(renoise(leaf, noise, critic.schedule.sigma(tau)), tau, cond,
                                                                blocks)
        logits = head(features)
        loss = F.softplus(-logits).mean()
        (grad,) = torch.autograd.grad(_reaching_the_output(loss, velocity), leaf)
    term = (x0.float() * grad).sum()
    return term, {"gan_generator_loss": loss.detach(), "gan_fake_logit": logits.detach().mean()}


def critic_step_with_discriminator(fake: Any, real: torch.Tensor | None, cond: Any, scores: Any, blocks: list[int],
                                   weight: float, grad_accum_rounds: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's step with the discriminator's loss (module doc). ``fake``: the critic's fake-score pass on the
    student's sample with the hidden states of ``blocks`` (:class:`~distillery.methods.dmd2.CriticPass`): its loss and
    the discriminator's on it are backpropagated; then the real latents ``real`` noised to the same t, backpropagated.
    Returns the critic's whole loss (detached) and its metrics."""
    if real is None:
        raise UserError("a GAN term needs real latents (the discriminator's real samples): train on a latent set")
    critic, head = scores.critic, scores.critic.attached[HEAD_NAME]
    fake_logits = head(fake.features)
    fake_part = F.softplus(fake_logits).mean()
    critic.backward(fake.loss + weight * fake_part, None, grad_accum_rounds)
    noise = scores.rng.randn(real.shape).to(real.device)
    x_real = renoise(real.float(), noise, critic.schedule.sigma(fake.t))
    velocity, features = critic.predict_noise_with_features(x_real, fake.t, cond, blocks)
    real_logits = head(features)
    real_part = F.softplus(-real_logits).mean()
    critic.backward(_reaching_the_output(weight * real_part, velocity), None, grad_accum_rounds)
    gan_loss = (fake_part + real_part).detach()
    metrics = {**fake.metrics, "gan_discriminator_loss": gan_loss, "gan_real_logit": real_logits.detach().mean(),
               "gan_fake_logit_critic": fake_logits.detach().mean()}
    return fake.loss.detach() + weight * gan_loss, metrics
