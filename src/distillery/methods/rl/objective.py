"""DiffusionNFT's arithmetic: group-normalised advantages, their clipping, the old policy's decay, the objective.

Notation (per sample ``i`` of a minibatch; ``σ = t / n``, ``n`` the timestep scale): a rollout's clean latent
``x0``, fresh noise ``ε``, ``x_t = (1 − σ) x0 + σ ε``; velocities (``v ≈ ε − x0``) of the policy being trained
``v_θ`` (with gradient), of the old policy that sampled the rollouts ``v_old`` and of the reference ``v_ref``
(both without gradient); the sample's advantage ``a``.

- **Advantages** (:func:`group_advantages`): the K rewards of one prompt's rollouts, ``(r − mean) / (std + 1e-4)``
  (``std`` the population one, over the K).
- **Clipping** (:func:`clip_advantages`): ``a`` clipped to ``[−A, A]`` (``adv_clip_max``), then by ``adv_mode``:
  ``all`` (as is), ``positive_only`` (``[0, A]``), ``negative_only`` (``[−A, 0]``), ``one_only`` (1 where
  ``a > 0``, else 0), ``binary`` (its sign); mapped to the optimality weight ``w = clamp(a / (2A) + 1/2, 0, 1)``.
- **Objective** (:func:`nft_loss`): with ``β`` (``beta``) the implicit positive and negative policies
  ``v⁺ = β v_θ + (1 − β) v_old`` and ``v⁻ = (1 + β) v_old − β v_θ``, their clean predictions
  ``x0^± = x_t − σ v^±``, each sample's adaptive weight ``λ^± = max(mean |x0^± − x0|, 1e-5)`` (float64, no
  gradient), ``L^± = mean (x0^± − x0)² / λ^±``;
  ``policy = A · mean_i (w L⁺ + (1 − w) L⁻) / β``, ``kl = mean_i mean (v_θ − v_ref)²``,
  ``total = policy + kl_beta · kl``. Means ``mean`` are over the sample's elements ``[C, T, H, W]``.
- **Old policy** (:func:`old_policy_decay`): after the ``g``-th rollout group's updates,
  ``old ← d · old + (1 − d) · θ`` with ``d = 0`` for ``g < flat``, else ``min((g − flat) · rate, max)``.

What FastVideo 0.2.1's ``DiffusionNFTMethod`` computes (``_compute_advantages``, ``_training_timestep_loss``,
``_return_decay``), written again here; ``tests/test_nft.py`` runs its code on the same tensors.
"""

from __future__ import annotations

from typing import Literal

import torch

AdvantageMode = Literal["all", "positive_only", "negative_only", "one_only", "binary"]
STD_EPS = 1e-4  # added to a group's reward std
WEIGHT_FLOOR = 1e-5  # the adaptive weights' floor


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``[P, K]`` rewards (K rollouts of each of P prompts) → ``[P, K]`` advantages, each row normalised by its own
    mean and population std (+ :data:`STD_EPS`); float32 in, float32 out."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, unbiased=False, keepdim=True)
    return (rewards - mean) / (std + STD_EPS)


def clip_advantages(advantages: torch.Tensor, clip_max: float, mode: AdvantageMode) -> torch.Tensor:
    """The optimality weight ``w`` in [0, 1] of each advantage (module doc: clip, mode, map)."""
    a = torch.clamp(advantages, -clip_max, clip_max)
    if mode == "positive_only":
        a = torch.clamp(a, 0, clip_max)
    elif mode == "negative_only":
        a = torch.clamp(a, -clip_max, 0)
    elif mode == "one_only":
        a = torch.where(a > 0, torch.ones_like(a), torch.zeros_like(a))
    elif mode == "binary":
        a = torch.sign(a)
    return torch.clamp((a / clip_max) / 2.0 + 0.5, 0, 1)


def old_policy_decay(group: int, flat: int, rate: float, cap: float) -> float:
    """The old policy's decay after rollout group ``group`` (1-based; module doc)."""
    if group < flat:
        return 0.0
    return min((group - flat) * rate, cap)


def nft_loss(x0: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor, v_theta: torch.Tensor, v_old: torch.Tensor,
             v_ref: torch.Tensor, weight: torch.Tensor, beta: float, clip_max: float,
             kl_beta: float) -> dict[str, torch.Tensor]:
    """The objective of the module doc for one minibatch: ``x0``, ``x_t``, the velocities ``[B, C, T, H, W]``
    (float32; ``v_theta`` with its graph), ``sigma`` ``[B]`` (x_t's noise level), ``weight`` ``[B]`` (the
    clipped advantages' optimality weights, :func:`clip_advantages`). Returns ``total_loss`` (with graph) and,
    detached, ``policy_loss``, ``kl_loss``, ``old_deviation`` (mean (v_θ − v_old)²) and ``old_kl``
    (mean (v_old − v_ref)²)."""
    dims = tuple(range(1, x0.ndim))
    s = sigma.view(-1, *[1] * (x0.ndim - 1))
    v_old, v_ref = v_old.detach(), v_ref.detach()
    positive = beta * v_theta + (1 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v_theta
    x0_pos = x_t - s * positive
    x0_neg = x_t - s * negative
    with torch.no_grad():
        lam_pos = (x0_pos.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=WEIGHT_FLOOR)
        lam_neg = (x0_neg.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=WEIGHT_FLOOR)
    loss_pos = ((x0_pos - x0) ** 2 / lam_pos).mean(dim=dims)
    loss_neg = ((x0_neg - x0) ** 2 / lam_neg).mean(dim=dims)
    per_sample = weight * loss_pos / beta + (1.0 - weight) * loss_neg / beta
    policy = (per_sample * clip_max).mean()
    kl = ((v_theta - v_ref) ** 2).mean(dim=dims).mean()
    total = policy + kl_beta * kl
    return {"total_loss": total, "policy_loss": policy.detach(), "kl_loss": kl.detach(),
            "old_deviation": ((v_theta - v_old) ** 2).mean().detach(), "old_kl": ((v_old - v_ref) ** 2).mean()}
