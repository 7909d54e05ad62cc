"""Activation checkpointing of some of a model's blocks (selective AC by block).

Full AC (every block recomputed in backward) is diffusers' own ``enable_gradient_checkpointing``. Here a
share of the blocks is recomputed instead: memory drops by about that share of the activations, time
grows by about that share of one forward. :func:`checkpoint_blocks` replaces the ``forward`` of the chosen
block modules (in place, parameter names unchanged) with one that runs the class's forward under
``torch.utils.checkpoint`` (non-reentrant) when autograd records, and plainly under ``no_grad``. Apply it
to the modules that run forward (a bf16 compute copy's blocks, not its fp32 master's) before they are
compiled or sharded, so that the checkpoint lies inside each compiled block.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint


def chosen_blocks(num_blocks: int, fraction: float) -> list[int]:
    """Indices of ``round(num_blocks · fraction)`` blocks spread evenly over ``range(num_blocks)``
    (0 ≤ fraction ≤ 1): 30 blocks at 0.2 → [0, 5, 10, 15, 20, 25]."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"activation checkpointing fraction {fraction} is not within [0, 1]")
    count = round(num_blocks * fraction)
    return sorted({(i * num_blocks) // count for i in range(count)}) if count else []


def _checkpointed_forward(self: torch.nn.Module, *args, **kwargs):
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(blocks: Sequence[torch.nn.Module], fraction: float) -> list[int]:
    """Recompute the chosen share of ``blocks`` (:func:`chosen_blocks`) in backward; returns their indices."""
    chosen = chosen_blocks(len(blocks), fraction)
    for i in chosen:
        blocks[i].forward = types.MethodType(_checkpointed_forward, blocks[i])
    return chosen
