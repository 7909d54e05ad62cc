"""An exported student that trained with block-sparse video attention samples with it (stdlib + torch + diffusers;
FlashAttention-4 where :mod:`distilled_fast` installs it).

The transformer's ``config.json`` records how it attends (``_sparse_attention``: the sparsity and the tile, written
when distillery trained it sparse; :func:`folder_spec`). :func:`install_sparse` routes every block's self-attention
through :func:`sparse_attention.video_sparse_attention` — the module distillery trains with, shipped beside this
one —: a bidirectional block through a :class:`SparseSelfAttnProcessor` (the token grid comes from a hook on
``transformer.rope``), a causal block's :class:`distilled_causal.CausalAttnProcessor` block-causally over its chunks
and KV cache. On a GPU with FlashAttention-4 (``attention="fa4"`` in the speed plan) the fine attention is its
block-sparse kernel; elsewhere the dense masked computation (fp32), the same function validate sampled with on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .distilled_fast import FA4SelfAttnProcessor, attention_output, self_attention_qkv
from .sparse_attention import RECORD_KEY, SparseSpec, install_grid_hook, read_record, video_sparse_attention

_SAFE = None  # video_sparse_attention behind torch.compiler.disable (made at the first install)


def compile_safe_attention():
    """:func:`sparse_attention.video_sparse_attention` kept out of compiled blocks (it builds layouts per call)."""
    global _SAFE
    if _SAFE is None:
        _SAFE = torch.compiler.disable(video_sparse_attention)
    return _SAFE


def folder_spec(transformer_dir: Path) -> SparseSpec | None:
    """The sparse attention ``transformer_dir/config.json`` records (None: dense attention)."""
    path = Path(transformer_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return read_record(json.loads(path.read_text()))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


class SparseSelfAttnProcessor:
    """``attn1`` of a bidirectional block: sparse self-attention over the token grid the rope hook attached; ``fa4``
    (set by :func:`distilled_fast.install_fa4`): FlashAttention-4's block-sparse kernel for CUDA bf16/fp16. A call with
    a mask or text keys is :class:`distilled_fast.FA4SelfAttnProcessor`'s."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, spec: SparseSpec) -> None:
        self.spec = spec
        self.fa4 = False

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        grid = getattr(rotary_emb, "grid", None)
        if encoder_hidden_states is not None or attention_mask is not None or grid is None:
            if grid is None and encoder_hidden_states is None and attention_mask is None:
                raise RuntimeError("sparse self-attention without the token grid: install_sparse adds the rope hook")
            dense = FA4SelfAttnProcessor()
            dense._attention_backend, dense._parallel_config = self._attention_backend, self._parallel_config
            return dense(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = self_attention_qkv(attn, hidden_states, rotary_emb)
        out = compile_safe_attention()(query, key, value, self.spec, grid, fa4=self.fa4)
        return attention_output(attn, out, query)


def install_sparse(transformer: torch.nn.Module, spec: SparseSpec) -> None:
    """Every block's self-attention of ``transformer`` sparse as ``spec`` says (idempotent): a causal processor (it has
    ``block_index``) gets the spec, any other ``attn1`` a :class:`SparseSelfAttnProcessor` and ``rope`` the grid hook."""
    compile_safe_attention()
    causal = False
    for block in transformer.blocks:
        processor = block.attn1.processor
        if hasattr(processor, "block_index"):
            processor.sparse, causal = spec, True
        elif isinstance(processor, SparseSelfAttnProcessor):
            processor.spec = spec
        else:
            ours = SparseSelfAttnProcessor(spec)
            ours.fa4 = bool(getattr(processor, "fa4", False)) or isinstance(processor, FA4SelfAttnProcessor)
            block.attn1.set_processor(ours)
    if not causal:
        install_grid_hook(transformer)


__all__ = ["RECORD_KEY", "SparseSelfAttnProcessor", "SparseSpec", "folder_spec", "install_sparse"]
