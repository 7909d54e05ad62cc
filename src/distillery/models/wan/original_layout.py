"""Wan 2.1 transformer weights in the original layout (the Wan-AI repository's ``WanModel``, and the
checkpoints published from it — the Self-Forcing repository's ``ode_init.pt`` and ``self_forcing_dmd.pt``)
as diffusers ``WanTransformer3DModel`` weights.

The two layouts hold the same tensors under other names (shapes are equal), so the conversion is a
renaming, checked strictly: every tensor of the file must map to a parameter of the target
architecture and every parameter must be given, with the shape the target config asks for; anything
else is one :class:`UserError` line naming the first key (a checkpoint of another model, another size,
an image-to-video model's ``img_emb``).

Original name → diffusers name (``N``: the block index)::

    patch_embedding.*                 patch_embedding.*
    text_embedding.0.* / .2.*         condition_embedder.text_embedder.linear_1.* / linear_2.*
    time_embedding.0.* / .2.*         condition_embedder.time_embedder.linear_1.* / linear_2.*
    time_projection.1.*               condition_embedder.time_proj.*
    blocks.N.self_attn.{q,k,v}.*      blocks.N.attn1.to_{q,k,v}.*      (.o.* → .to_out.0.*)
    blocks.N.self_attn.norm_{q,k}.*   blocks.N.attn1.norm_{q,k}.*
    blocks.N.cross_attn.*             blocks.N.attn2.*                 (the same renaming as self_attn)
    blocks.N.norm3.*                  blocks.N.norm2.*                 (the cross-attention's affine norm)
    blocks.N.ffn.0.* / .2.*           blocks.N.ffn.net.0.proj.* / net.2.*
    blocks.N.modulation               blocks.N.scale_shift_table
    head.head.*                       proj_out.*
    head.modulation                   scale_shift_table

A published file is a ``torch.save`` of a dict: the tensors themselves, or nested under a key such as
``generator`` / ``generator_ema`` (Self-Forcing) or ``model`` / ``state_dict``; names may carry the
prefixes of the wrappers that saved them (``model.``, ``module.``, ``_fsdp_wrapped_module.``,
``_orig_mod.``). It is read with ``torch.load(weights_only=True)`` only — a file that needs anything but
tensors and plain containers to load is refused, never unpickled.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from distillery.common.errors import UserError

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "module.", "model.")
NESTED_KEYS = ("generator_ema", "generator", "model", "state_dict", "module")  # where a published file keeps its weights
_TOP = {
    "text_embedding.0.": "condition_embedder.text_embedder.linear_1.",
    "text_embedding.2.": "condition_embedder.text_embedder.linear_2.",
    "time_embedding.0.": "condition_embedder.time_embedder.linear_1.",
    "time_embedding.2.": "condition_embedder.time_embedder.linear_2.",
    "time_projection.1.": "condition_embedder.time_proj.",
    "head.head.": "proj_out.",
    "patch_embedding.": "patch_embedding.",
}
_ATTN = {"q.": "to_q.", "k.": "to_k.", "v.": "to_v.", "o.": "to_out.0.", "norm_q.": "norm_q.", "norm_k.": "norm_k."}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def diffusers_name(name: str) -> str | None:
    """The diffusers ``WanTransformer3DModel`` name of the original-layout tensor ``name``; None when the
    original layout has no such tensor (or it has no place in a text-to-video transformer)."""
    if name == "head.modulation":
        return "scale_shift_table"
    for old, new in _TOP.items():
        if name.startswith(old):
            return new + name[len(old):]
    m = _BLOCK.match(name)
    if not m:
        return None
    index, rest = m.groups()
    if rest == "modulation":
        return f"blocks.{index}.scale_shift_table"
    for attn, target in (("self_attn.", "attn1."), ("cross_attn.", "attn2.")):
        if rest.startswith(attn):
            tail = rest[len(attn):]
            for old, new in _ATTN.items():
                if tail.startswith(old):
                    return f"blocks.{index}.{target}{new}{tail[len(old):]}"
            return None
    if rest.startswith("norm3."):
        return f"blocks.{index}.norm2.{rest[len('norm3.'):]}"
    if rest.startswith("ffn.0."):
        return f"blocks.{index}.ffn.net.0.proj.{rest[len('ffn.0.'):]}"
    if rest.startswith("ffn.2."):
        return f"blocks.{index}.ffn.net.2.{rest[len('ffn.2.'):]}"
    return None


def _strip_prefixes(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def read_published(path: str | Path, key: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The original-layout tensors of the published file ``path`` (wrapper prefixes stripped) and where in the
    file they were (``"(top level)"`` or the nested key). ``key`` picks a nested entry (``generator_ema``);
    without it the first of :data:`NESTED_KEYS` present is taken. One :class:`UserError` line for a file
    that does not load with ``weights_only=True``, or holds no tensors where asked."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: not a file (a published checkpoint is a torch.save .pt/.pth file)")
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # a 14B file is not read into memory twice
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format cannot be mapped
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ...
        reason = " ".join(str(exc).split())[:160]
        raise UserError(f"{path}: does not load as tensors alone (weights_only=True: {type(exc).__name__}: {reason}); "
                        "a file that needs code to load is never unpickled") from None
    if key is not None:
        if not (isinstance(obj, dict) and key in obj):
            found = sorted(k for k in obj if isinstance(k, str)) if isinstance(obj, dict) else []
            raise UserError(f"{path}: no entry {key!r} (it holds {', '.join(found[:8]) or 'no named entries'})")
        obj, where = obj[key], key
    elif _is_state_dict(obj):
        where = "(top level)"
    else:
        nested = [k for k in NESTED_KEYS if isinstance(obj, dict) and _is_state_dict(obj.get(k))]
        if not nested:
            raise UserError(f"{path}: holds no tensors at its top level or under {', '.join(NESTED_KEYS)}")
        obj, where = obj[nested[0]], nested[0]
    if not _is_state_dict(obj):
        raise UserError(f"{path}: entry {where!r} is not a mapping of names to tensors")
    return {_strip_prefixes(k): v for k, v in obj.items()}, where


def to_diffusers(original: dict[str, torch.Tensor], expected: dict[str, torch.Size], source: str) -> dict[str, torch.Tensor]:
    """``original`` renamed to the diffusers layout, checked against ``expected`` (the target transformer's
    parameter names and shapes): one :class:`UserError` line for a tensor with no place, a parameter not given,
    or a shape that differs (a checkpoint of another model or size)."""
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in original.items():
        target = diffusers_name(name)
        if target is None or target not in expected:
            raise UserError(f"{source}: tensor {name!r} has no place in a Wan 2.1 text-to-video transformer "
                            f"({len(original)} tensors; not the original Wan layout, or another model)")
        if tuple(tensor.shape) != tuple(expected[target]):
            raise UserError(f"{source}: {name} has shape {list(tensor.shape)}, the target transformer's {target} "
                            f"{list(expected[target])}: a checkpoint of another model size (check --like)")
        if target in converted:
            raise UserError(f"{source}: two tensors map to {target} (one with a wrapper prefix, one without?)")
        converted[target] = tensor
    missing = sorted(set(expected) - set(converted))
    if missing:
        raise UserError(f"{source}: {len(missing)} parameter(s) of the target transformer not given (first: {missing[0]}): "
                        "an incomplete checkpoint, or one of another architecture")
    return converted
