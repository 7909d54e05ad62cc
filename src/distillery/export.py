"""Weights out: a checkpoint role's transformer as a diffusers ``transformer/`` folder.

``export_weights(checkpoint, role, out)`` rebuilds the transformer from the architecture saved in
the checkpoint (``roles/<role>/config.json``), loads that role's weights (or its EMA shadow) from
the DCP shards on one process (any saving world size), and writes ``<out>/transformer/`` with
``save_pretrained`` (safetensors + config.json), atomically.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from distillery.errors import UserError
from distillery.fsutil import replace_dir

SUPPORTED_CLASSES = ("WanTransformer3DModel",)


def build_transformer_from_config(config: dict) -> torch.nn.Module:
    """Instantiate the diffusers transformer class named in ``config['_class_name']`` (random weights)."""
    import diffusers

    name = config.get("_class_name")
    if name not in SUPPORTED_CLASSES:
        raise UserError(f"cannot export a {name}; supported: {', '.join(SUPPORTED_CLASSES)}")
    cls = getattr(diffusers, name)
    return cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def load_role_weights(checkpoint: Path, role: str, module: torch.nn.Module, ema: str | None = None) -> None:
    """Load ``role``'s weights from the DCP shards into ``module`` (in place, single process).

    ``ema`` names an EMA callback whose shadow weights to load instead of the raw weights.
    """
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    if ema:
        params = dict(module.named_parameters())
        shadow = {n: torch.empty_like(p, dtype=torch.float32) for n, p in params.items()}
        dcp.load({f"callback.{ema}": {role: shadow}}, checkpoint_id=str(checkpoint / "dcp"))
        with torch.no_grad():
            for n, t in shadow.items():
                params[n].copy_(t)
        return
    state = module.state_dict()
    dcp.load({f"role.{role}": {"model": state}}, checkpoint_id=str(checkpoint / "dcp"))
    module.load_state_dict(state)


def export_weights(checkpoint: str | Path, role: str, out: str | Path, ema: str | None = None) -> Path:
    """Write ``<out>/transformer/`` for ``role`` of ``checkpoint``; returns that folder."""
    ckpt = Path(checkpoint)
    meta_path = ckpt / "metadata.json"
    if not meta_path.is_file():
        raise UserError(f"{ckpt}: not a complete checkpoint (no metadata.json)")
    meta = json.loads(meta_path.read_text())
    if role not in meta.get("roles", []):
        raise UserError(f"{ckpt}: no trainable role {role!r}; it holds {', '.join(meta.get('roles', [])) or 'none'}")
    config = json.loads((ckpt / "roles" / role / "config.json").read_text())
    module = build_transformer_from_config(config)
    try:
        load_role_weights(ckpt, role, module, ema)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:
        what = f"EMA callback {ema!r}" if ema else f"role {role!r}"
        text = str(exc)
        missing = re.search(r"Missing key in checkpoint state_dict: ([^\s\\]+?)\.?(?:\s|\\n|$)", text)
        reason = f"the checkpoint has no {missing.group(1)}" if missing else (text.strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{ckpt}: cannot load {what}: {reason}") from None
    out_dir = Path(out)
    final = out_dir / "transformer"
    tmp = out_dir / ".tmp-transformer"
    out_dir.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    module.save_pretrained(tmp, safe_serialization=True)
    return replace_dir(tmp, final)
