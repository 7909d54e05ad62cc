"""Prompt embeddings of more than one text encoder in one tensor: the layout the data layer stores and the model
plugins read (HunyuanVideo 1.5: Qwen2.5-VL's hidden states and ByT5's glyph embeddings, each with its own mask).

Every part of distillery carries one prompt tensor ``[L, D]`` per prompt (``[B, L, D]`` batched: zero-padded rows,
swapped whole for the negative prompt, carried across steps by PDD, dropped by CFG dropout). A prompt of ``S`` streams
of widths ``D_1 … D_S`` is that tensor with the streams **side by side** on the width axis (``D = Σ D_s``, in the
family's stream order) and each stream's tokens from row 0: stream ``s``'s ``L_s`` real tokens fill rows
``[0, L_s)`` of its columns, every other row of its columns is zeros, and ``L = max L_s`` stored (trimmed, as a one
stream prompt is). A stream's attention mask is therefore its non-zero rows — a real token's embedding is never the
zero vector — a prefix of the rows (:func:`split_streams` checks it). A stream with no token (ByT5 of a prompt with no
quoted text) is all zeros, mask all zero: what the family's pipeline passes for it.

Stored sets record the layout (``text_streams``: each stream's encoder class, width and token budget) in their
manifest and shard metadata (format ``latents/v2``); a one-stream set is ``latents/v1``, read as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pack_streams(streams: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One prompt's streams ``[(embeds [N_s, D_s], mask [N_s]), …]`` (as a pipeline's encoder returns them, padded
    to its budget ``N_s`` with a prefix mask) → ``[max L_s, Σ D_s]`` (module doc; float32, CPU). ``ValueError`` where
    a mask is not a prefix (the layout keeps a stream's tokens from row 0) or a real token's row is all zeros."""
    lengths = []
    for s, (embeds, mask) in enumerate(streams):
        valid = mask.bool().reshape(-1)
        n = int(valid.sum())
        if not bool(valid[:n].all()):
            raise ValueError(f"prompt stream {s}: its mask is not a prefix of its tokens (a left-padded encoder); the "
                             "packed layout keeps each stream's tokens from row 0")
        if n and bool((embeds[:n].float().abs().sum(dim=-1) == 0).any()):
            raise ValueError(f"prompt stream {s}: a real token's embedding is all zeros; the packed layout would mask it")
        lengths.append(n)
    rows = max(lengths, default=0)
    out = torch.zeros(rows, sum(int(e.shape[-1]) for e, _ in streams), dtype=torch.float32)
    col = 0
    for (embeds, _), n in zip(streams, lengths):
        width = int(embeds.shape[-1])
        out[:n, col:col + width] = embeds[:n].float().cpu()
        col += width
    return out


def split_streams(text: torch.Tensor, widths: Sequence[int], tokens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batched packed prompts ``[B, L, Σ D_s]`` → per stream ``(embeds [B, tokens_s, D_s], mask [B, tokens_s] int64)``:
    each stream's columns cut to ``tokens_s`` rows (zero-padded where ``L`` is shorter), its mask the non-zero rows.
    ``ValueError`` when the widths do not add up to ``D`` or a stream has a token beyond its ``tokens_s``."""
    if sum(widths) != text.shape[-1]:
        raise ValueError(f"prompt embeddings {tuple(text.shape)} are not streams of widths {list(widths)} side by side "
                         f"({sum(widths)} wide)")
    out = []
    col = 0
    for width, budget in zip(widths, tokens):
        part = text[..., col:col + width]
        col += width
        if part.shape[1] > budget:
            if bool(part[:, budget:].ne(0).any()):
                raise ValueError(f"a prompt stream holds tokens beyond its {budget}-token budget")
            part = part[:, :budget]
        elif part.shape[1] < budget:
            part = torch.nn.functional.pad(part, (0, 0, 0, budget - part.shape[1]))
        mask = part.ne(0).any(dim=-1).to(torch.int64)
        out.append((part, mask))
    return out


def hunyuan15_budgets() -> tuple[int, int]:
    """``(Qwen2.5-VL tokens, ByT5 tokens)`` diffusers' ``HunyuanVideo15Pipeline`` encodes a prompt into — its static
    encoders' defaults (1000, 256), the values its ``__init__`` sets as ``tokenizer_max_length`` /
    ``tokenizer_2_max_length`` (a test compares): the streams' budgets of that family, read here once for the data layer
    that packs them and the plugin that splits them."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    def default(method: object) -> int:
        return int(inspect.signature(method).parameters["tokenizer_max_length"].default)

    return default(HunyuanVideo15Pipeline._get_mllm_prompt_embeds), default(HunyuanVideo15Pipeline._get_byt5_prompt_embeds)
