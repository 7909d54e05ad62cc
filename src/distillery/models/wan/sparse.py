"""``models.<role>.attention: sparse``: the Wan plugins' self-attention through trained block-sparse video attention
(:mod:`.sparse_attention`: coarse tile scores pick each query tile's key tiles, the fine attention reads those only).

A bidirectional Wan (:class:`~distillery.models.wan.WanModel`, PDD's trunk) gets a :class:`SparseWanAttnProcessor`
on every block's ``attn1`` and a forward hook on ``transformer.rope`` that hands the processors the token grid
(:class:`~.sparse_attention.GridRotary`: diffusers' ``(cos, sin)`` with the call's ``(frames, rows, columns)`` after
patchify). The causal Wan's processors (:mod:`.causal`) carry the same :class:`~.sparse_attention.SparseSpec` and
attend block-causally, with or without the KV cache. The kernel is FlashAttention-4's block-sparse one where the
role's attention backend is an FA4 one and the activations are CUDA bf16/fp16, else each query tile's kept key tiles
gathered into SDPA calls (CPU, SDPA backends, fp32).

A transformer that trained sparse records its :class:`~.sparse_attention.SparseSpec` in its config
(:data:`~.sparse_attention.RECORD_KEY`, written into ``config.json`` by ``save_pretrained``), so wherever it is loaded
— a later stage's role, validate, the exported pipeline — it attends as it trained (``attention: auto``, the default,
reads the record; :func:`folder_spec`); a role configured ``dense`` runs dense and its record says so. Cross-attention
is always dense.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.models.wan import sparse_attention as sa
from distillery.models.wan.attention import FA4WanAttnProcessor, across_sequence_shards, attention_output, self_attention_qkv

_SAFE: Any = None  # sa.video_sparse_attention behind torch.compiler.disable (made at the first install)


def compile_safe_attention() -> Any:
    """:func:`~.sparse_attention.video_sparse_attention` kept out of ``torch.compile`` regions (it builds layouts from
    Python ints per call), wrapped once when a model first installs a sparse processor: importing ``torch._dynamo``
    at import time would cost every process that only reads a config class."""
    global _SAFE
    if _SAFE is None:
        _SAFE = torch.compiler.disable(sa.video_sparse_attention)
    return _SAFE


class SparseWanAttnProcessor:
    """The self-attention of a bidirectional Wan block through :func:`~.sparse_attention.video_sparse_attention`;
    ``fa4_mode`` (set by :func:`~.attention.install_attention_backend`): FlashAttention-4 where the activations allow.
    Cross-attention (and a call with a mask) goes to :class:`~.attention.FA4WanAttnProcessor`. A plain picklable
    object: ``copy.deepcopy`` (the bf16 compute copy) carries it."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, spec: sa.SparseSpec, fa4_mode: str | None = None) -> None:
        self.spec = spec
        self.fa4_mode = fa4_mode

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            dense = FA4WanAttnProcessor(self.fa4_mode)
            dense._attention_backend, dense._parallel_config = self._attention_backend, self._parallel_config
            return dense(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        grid = getattr(rotary_emb, "grid", None)
        if grid is None:
            raise RuntimeError("sparse self-attention without the token grid: the transformer's rope hook is missing "
                               "(install_sparse_attention)")
        query, key, value = self_attention_qkv(attn, hidden_states, rotary_emb.freqs_cos, rotary_emb.freqs_sin)
        attend = compile_safe_attention()
        out = across_sequence_shards(rotary_emb, lambda q, k, v: attend(q, k, v, self.spec, grid, fa4=self.fa4_mode is not None),
                                     query, key, value)  # under sequence parallelism: every token, this rank's heads
        return attention_output(attn, out, query)


def install_sparse_attention(transformer: torch.nn.Module, spec: sa.SparseSpec) -> None:
    """Every block's ``attn1`` of a bidirectional Wan through a :class:`SparseWanAttnProcessor` (keeping the FA4 mode
    and SDPA choice already made) and the grid hook on ``rope`` (idempotent)."""
    compile_safe_attention()
    for block in transformer.blocks:
        old = block.attn1.processor
        if isinstance(old, SparseWanAttnProcessor):
            old.spec = spec
            continue
        processor = SparseWanAttnProcessor(spec, getattr(old, "fa4_mode", None))
        processor._attention_backend = getattr(old, "_attention_backend", None)
        processor._parallel_config = getattr(old, "_parallel_config", None)
        block.attn1.set_processor(processor)
    sa.install_grid_hook(transformer)


def record(transformer: torch.nn.Module, spec: sa.SparseSpec | None) -> None:
    """Keep ``spec`` in ``transformer``'s config (:data:`~.sparse_attention.RECORD_KEY`; None: dense, the key dropped),
    so its ``config.json`` and every checkpoint of it say how it attends."""
    config = transformer.config
    if spec is None:
        if config.get(sa.RECORD_KEY) is not None:
            transformer.register_to_config(**{sa.RECORD_KEY: None})
        return
    transformer.register_to_config(**{sa.RECORD_KEY: spec.record()})


def spec_of(config: Any, role: str, transformer_dir: str | Path) -> sa.SparseSpec | None:
    """The :class:`~.sparse_attention.SparseSpec` a Wan model config asks for (None: dense): ``attention: sparse`` its
    ``sparsity`` and ``sparse_tile``; ``dense`` none; ``auto`` (the default) what the folder's transformer recorded
    when it trained (:func:`folder_spec`: a student trained sparse stays sparse wherever it is loaded). A
    :class:`UserError` naming ``models.<role>`` for settings it cannot take."""
    attention = getattr(config, "attention", "auto")
    if attention == "auto":
        return folder_spec(transformer_dir)
    if attention != "sparse":
        return None
    tile = list(config.sparse_tile)
    problem = sa.spec_problem(config.sparsity, tile)
    if problem:
        raise UserError(f"config error: models.{role}: {problem}")
    return sa.SparseSpec(float(config.sparsity), tuple(int(t) for t in tile))


def folder_spec(transformer_dir: str | Path) -> sa.SparseSpec | None:
    """The sparse attention a transformer folder's ``config.json`` records (None: dense); a :class:`UserError` for a
    record that holds none."""
    path = Path(transformer_dir) / "config.json"
    try:
        return sa.read_record(json.loads(path.read_text()))
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None
