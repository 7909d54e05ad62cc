"""DINO ViT-B/16 (Caron et al., ICCV 2021), the image model VBench's *subject consistency* runs, as
transformers' :class:`~transformers.ViTModel` (no pooler): a folder in transformers' layout (e.g.
``facebook/dino-vitb16``), or the published ``dino_vitbase16_pretrain.pth`` mapped onto it
(:func:`vit_from_dino_state`).

One behaviour is DINO's own and differs from transformers': frames that are not 224×224 get the 14×14 patch
position embeddings resized by bicubic interpolation with *scale factors* ``((H/16 + 0.1)/14, (W/16 + 0.1)/14)``
(not to a target size), which moves every interpolated embedding a little; :func:`use_dino_position_interpolation`
puts DINO's formula on the model, so the features equal the published model's (VBench resizes frames to a shorter
side of 224 and does not crop: 480×832 frames are read at 224×388). The image features are the class token after
the last LayerNorm.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn as nn

DINO_FILE = "dino_vitbase16_pretrain.pth"


def dino_position_embeddings(embeddings: nn.Module, tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """DINO's ``interpolate_pos_encoding`` for ``[B, 1 + N', D]`` tokens of a ``height × width`` image (module doc)."""
    table = embeddings.position_embeddings
    n = table.shape[1] - 1
    if tokens.shape[1] - 1 == n and height == width:
        return table
    side = int(math.sqrt(n))
    patch = embeddings.patch_size
    h0, w0 = height // patch + 0.1, width // patch + 0.1
    grid = table[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
    grid = nn.functional.interpolate(grid, scale_factor=(h0 / side, w0 / side), mode="bicubic")
    if grid.shape[-2:] != (int(h0), int(w0)):
        raise ValueError(f"DINO position interpolation gave {tuple(grid.shape[-2:])}, expected {(int(h0), int(w0))}")
    return torch.cat((table[:, :1], grid.permute(0, 2, 3, 1).reshape(1, -1, table.shape[-1])), dim=1)


def use_dino_position_interpolation(model: nn.Module) -> nn.Module:
    """``model`` (a :class:`~transformers.ViTModel`) with DINO's position interpolation in place of transformers'."""
    emb = model.embeddings
    emb.interpolate_pos_encoding = types.MethodType(dino_position_embeddings, emb)
    return model


def dino_vit_config(**overrides):
    """The :class:`~transformers.ViTConfig` of DINO ViT-B/16 (LayerNorm eps 1e-6, qkv bias, GELU), ``overrides`` applied."""
    from transformers import ViTConfig

    base = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, image_size=224,
                patch_size=16, layer_norm_eps=1e-6, qkv_bias=True, hidden_act="gelu")
    return ViTConfig(**{**base, **overrides})


def vit_from_dino_state(state: dict[str, torch.Tensor]) -> nn.Module:
    """A :class:`~transformers.ViTModel` holding a DINO ``VisionTransformer`` state dict (its sizes read from the
    tensors; keys mapped: ``qkv`` split into q, k, v). A state dict of another model raises ``KeyError``/``ValueError``."""
    from transformers import ViTModel

    dim = state["cls_token"].shape[-1]
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    patch = state["patch_embed.proj.weight"].shape[-1]
    side = int(math.sqrt(state["pos_embed"].shape[1] - 1))
    hidden = state["blocks.0.mlp.fc1.weight"].shape[0]
    heads = max(1, dim // 64)
    config = dino_vit_config(hidden_size=dim, num_hidden_layers=depth, num_attention_heads=heads, intermediate_size=hidden,
                             patch_size=patch, image_size=side * patch)
    mapped = {"embeddings.cls_token": state["cls_token"], "embeddings.position_embeddings": state["pos_embed"],
              "embeddings.patch_embeddings.projection.weight": state["patch_embed.proj.weight"],
              "embeddings.patch_embeddings.projection.bias": state["patch_embed.proj.bias"],
              "layernorm.weight": state["norm.weight"], "layernorm.bias": state["norm.bias"]}
    for i in range(depth):
        src, dst = f"blocks.{i}.", f"layers.{i}."
        for part in ("weight", "bias"):
            q, k, v = state[src + f"attn.qkv.{part}"].chunk(3, dim=0)
            mapped.update({dst + f"attention.q_proj.{part}": q, dst + f"attention.k_proj.{part}": k,
                           dst + f"attention.v_proj.{part}": v,
                           dst + f"attention.o_proj.{part}": state[src + f"attn.proj.{part}"],
                           dst + f"layernorm_before.{part}": state[src + f"norm1.{part}"],
                           dst + f"layernorm_after.{part}": state[src + f"norm2.{part}"],
                           dst + f"mlp.fc1.{part}": state[src + f"mlp.fc1.{part}"],
                           dst + f"mlp.fc2.{part}": state[src + f"mlp.fc2.{part}"]})
    extra = set(state) - {k for k in state if k.startswith("blocks.")} - {"cls_token", "pos_embed", "patch_embed.proj.weight",
                                                                          "patch_embed.proj.bias", "norm.weight", "norm.bias"}
    if extra:
        raise ValueError(f"unexpected tensors {sorted(extra)[:3]}")
    model = ViTModel(config, add_pooling_layer=False)
    model.load_state_dict(mapped, strict=True)
    return model

