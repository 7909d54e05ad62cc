"""A role's self-attention as a run config (``models.<role>.attention``, the Wan plugins') and ``params.yaml``
(``<stage>.attention``, the trained student's) write it: ``auto`` (as the model's folder records it trained), ``dense``,
or ``sparse`` — trained block-sparse video attention (:mod:`distillery.models.wan.sparse_attention`) at a
``sparsity`` over tiles of ``sparse_tile`` tokens. The knobs' one declaration of range and shape, without torch:
``params.yaml``'s schema reads them before any stage works, the plugins' config class with the model.
"""

from __future__ import annotations

from typing import Literal

ATTENTION_KINDS = ("auto", "dense", "sparse")
Attention = Literal["auto", "dense", "sparse"]
DEFAULT_SPARSITY = 0.9  # the share of the key tiles a query tile may attend that it skips
MAX_SPARSITY = 0.999  # sparsity < 1: a query tile keeps at least one key tile
# frames × rows × columns of tokens; distillery.models.wan.sparse_attention.DEFAULT_TILE (the shipped module keeps its
# own: an export imports nothing of distillery; tests/test_sparse_attention.py holds them equal)
DEFAULT_TILE = (1, 16, 8)
MAX_TILE_SIDE = 4096


def three_sizes(value: list[int]) -> str | None:
    """``sparse_tile``'s shape: one size per axis of the token grid (each within ``[1, MAX_TILE_SIDE]``: the field's
    bounds)."""
    return None if len(value) == 3 else "must be 3 integers (frames, rows, columns)"
