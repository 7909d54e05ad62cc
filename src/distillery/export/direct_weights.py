"""A full-weight Wan role's ``transformer/`` folder written without diffusers (the byte-identical fast path).

:func:`distillery.export.weights.export_weights` used to rebuild the ``WanTransformer3DModel`` (importing diffusers:
~4 s of CPU per training stage) only to call ``save_pretrained`` on it. For the cases where the bytes are provably
those ``save_pretrained`` of diffusers :data:`DIFFUSERS_VERSION` writes, :func:`write_direct` writes them itself:

- ``config.json``: ``json.dumps(config, indent=2, sort_keys=True) + "\\n"`` of the architecture's init arguments (the
  checkpoint's ``roles/<role>/config.json`` holds them all, as the trained module's config), its ``_wan_layout`` when
  not empty (what ``build_transformer`` registers), ``_class_name`` and the installed ``_diffusers_version`` —
  diffusers' ``ConfigMixin.to_json_string``;
- ``diffusion_pytorch_model.safetensors``: every tensor of the role's state dict (DCP ``roles.<role>.transformer.*``,
  float32 as the rebuilt module holds it; its EMA shadow in place of the trained values), contiguous,
  ``safetensors.torch.save_file(..., metadata={"format": "pt"})`` — one file, as ``save_pretrained``'s default
  ``max_shard_size`` (10 GB) leaves a state of at most 10**10 bytes (a larger one is sharded: not this path).

:func:`direct_config` says whether a role qualifies (None: keep diffusers' path): a ``WanTransformer3DModel`` of one
expert whose config names exactly :data:`WAN_INIT_KEYS`, under diffusers :data:`DIFFUSERS_VERSION` installed.
tests/test_direct_weights.py compares every byte with ``save_pretrained``'s folder.
"""

from __future__ import annotations

import json
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.components.checkpoint.dcp_io import load_dcp, read_dcp_metadata

DIFFUSERS_VERSION = "0.42.1"  # the save_pretrained / to_json_string this module reproduces
CLASS_NAME = "WanTransformer3DModel"
WAN_INIT_KEYS = frozenset({  # WanTransformer3DModel.__init__'s arguments in diffusers DIFFUSERS_VERSION (its config keys)
    "added_kv_proj_dim", "attention_head_dim", "cross_attn_norm", "eps", "ffn_dim", "freq_dim", "image_dim", "in_channels",
    "num_attention_heads", "num_layers", "out_channels", "patch_size", "pos_embed_seq_len", "qk_norm", "rope_max_seq_len",
    "text_dim"})
LAYOUT_KEY = "_wan_layout"  # distillery.models.wan.experts.LAYOUT_KEY (not imported: that module imports the model)
SPARSE_KEY = "_sparse_attention"  # distillery.models.wan.sparse_attention.RECORD_KEY (likewise)
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
CONFIG_NAME = "config.json"
MAX_SHARD_BYTES = 10 * 10**9  # save_pretrained's max_shard_size="10GB" as huggingface_hub parses it


def _installed_diffusers() -> str | None:
    try:
        return version("diffusers")
    except PackageNotFoundError:
        return None


def direct_config(config: dict[str, Any]) -> str | None:
    """The ``config.json`` text ``save_pretrained`` writes for the transformer ``build_transformer(config)`` rebuilds,
    or None when this module cannot vouch for it (another class, two experts, keys other than
    :data:`WAN_INIT_KEYS`, another diffusers installed)."""
    installed = _installed_diffusers()
    if config.get("_class_name") != CLASS_NAME or installed != DIFFUSERS_VERSION:
        return None
    layout = config.get(LAYOUT_KEY) or {}
    if not isinstance(layout, dict) or "transformer_2" in layout:
        return None
    if {k for k in config if not k.startswith("_")} != WAN_INIT_KEYS:
        return None
    out = {k: config[k] for k in WAN_INIT_KEYS}
    if layout:
        out[LAYOUT_KEY] = dict(layout)
    if SPARSE_KEY in config:  # what build_transformer registers: the attention it trained with (null: dense)
        out[SPARSE_KEY] = config[SPARSE_KEY]
    out["_class_name"] = CLASS_NAME
    out["_diffusers_version"] = installed
    return json.dumps(out, indent=2, sort_keys=True) + "\n"


def role_tensor_shapes(checkpoint: Path, role: str, module_name: str = "transformer") -> dict[str, torch.Size] | None:
    """``{state dict key: shape}`` of ``role``'s ``module_name`` in the checkpoint's DCP metadata, in its order; None
    when an entry there is not a tensor (not this path)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"roles.{role}.{module_name}."
    shapes: dict[str, torch.Size] = {}
    for key, meta in read_dcp_metadata(Path(checkpoint) / "dcp").state_dict_metadata.items():
        if key.startswith(prefix):
            if not isinstance(meta, TensorStorageMetadata):
                return None
            shapes[key[len(prefix):]] = meta.size
    return shapes


def load_role_tensors(checkpoint: Path, role: str, shapes: dict[str, torch.Size], ema: str | None = None,
                      module_name: str = "transformer") -> dict[str, torch.Tensor]:
    """``role``'s ``module_name`` tensors, float32, read from the checkpoint's DCP shards (any saving world size) — with
    ``ema``, the EMA callback's shadow in place of every tensor it holds one of (as
    :func:`~distillery.export.weights.load_role_weights` does for a module). A failure: one-line UserError."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    checkpoint = Path(checkpoint)
    state = {k: torch.empty(s, dtype=torch.float32) for k, s in shapes.items()}
    load_dcp({f"roles.{role}.{module_name}": state}, checkpoint / "dcp", f"role {role!r}")
    if ema:
        prefix = f"callbacks.{ema}.{role}.{module_name}."
        saved = {k[len(prefix):] for k in read_dcp_metadata(checkpoint / "dcp").state_dict_metadata if k.startswith(prefix)}
        shadow = {n: torch.empty_like(t) for n, t in state.items() if n in saved}
        if not shadow:
            raise UserError(f"{checkpoint}: cannot load EMA callback {ema!r}: it holds no EMA weights for role {role!r}")
        load_dcp({f"callbacks.{ema}": {role: {module_name: shadow}}}, checkpoint / "dcp", f"EMA callback {ema!r}")
        state.update(shadow)
    return state


def fits_one_file(shapes: dict[str, torch.Size]) -> bool:
    """Whether ``save_pretrained`` writes a float32 state of these shapes as one file (no shards, no index)."""
    return sum(4 * torch.Size(s).numel() for s in shapes.values()) <= MAX_SHARD_BYTES


def write_direct(folder: Path, config_text: str, state: dict[str, torch.Tensor]) -> None:
    """Write ``folder`` (created) as ``save_pretrained`` does for a one-file state: ``config.json`` and the weights."""
    import safetensors.torch

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / CONFIG_NAME, "w", encoding="utf-8") as fh:
        fh.write(config_text)
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, str(folder / WEIGHTS_NAME),
                                metadata={"format": "pt"})


class ProjOutHolder(torch.nn.Module):
    """What a Wan head bank is shaped from (``empty_head_bank(transformer, n)`` reads ``transformer.proj_out``): the
    role's ``proj_out`` as a Linear, values as loaded."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        weight, bias = state["proj_out.weight"], state["proj_out.bias"]
        self.proj_out = torch.nn.Linear(weight.shape[1], weight.shape[0], device="meta")
        self.proj_out.weight = torch.nn.Parameter(weight.clone())
        self.proj_out.bias = torch.nn.Parameter(bias.clone())
