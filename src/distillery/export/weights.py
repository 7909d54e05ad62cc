"""Weights out: a checkpoint role's transformer as a diffusers ``transformer/`` folder.

``export_weights(checkpoint, role, out)`` rebuilds the transformer from the architecture saved in
the checkpoint (``roles/<role>/config.json``), loads that role's weights (or its EMA shadow) from
the DCP shards on one process (any saving world size), and writes ``<out>/transformer/`` with
``save_pretrained`` (safetensors + config.json), atomically — with the role's PDD head bank beside
the weights (``pdd_heads.safetensors``) when it trained one.

The checkpoint folder is named by the user, so its recorded checksums must verify before anything
in it is read, and its DCP files are read without unpickling (:mod:`distillery.components.checkpoint.dcp_io`).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from distillery.common.errors import UserError
from distillery.common.fsutil import follow_umask, replace_dir
from distillery.components.checkpoint.dcp_io import load_dcp
from distillery.components.checkpoint.trust import require_intact

if TYPE_CHECKING:
    from distillery.models.registry import FamilyLoaders


def build_transformer_from_config(config: dict, where: str = "checkpoint role config") -> torch.nn.Module:
    """Instantiate the transformer ``config['_class_name']`` names (random weights), by the model
    family that loads that class (:mod:`distillery.models.registry`; ``where``: the file, for the
    one-line :class:`UserError` when no registered family does)."""
    from distillery.models.registry import family_of_class

    return family_of_class(config.get("_class_name"), f"cannot export {where}").loaders().build_transformer(config)


def load_role_weights(checkpoint: Path, role: str, module: torch.nn.Module, ema: str | None = None,
                      module_name: str = "transformer") -> None:
    """Load ``role``'s ``module_name`` weights (DCP key ``roles.<role>.<module_name>``) from the
    checkpoint into ``module`` (in place, single process, any saving world size).

    ``ema`` names an EMA callback whose shadow weights to load instead (key ``callbacks.<ema>``).
    Reads through the safe DCP reader; does not verify checksums (:func:`export_weights` does). A
    failure raises a one-line UserError.
    """
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    checkpoint = Path(checkpoint)
    state = module.state_dict()
    load_dcp({f"roles.{role}.{module_name}": state}, checkpoint / "dcp", f"role {role!r}")
    module.load_state_dict(state)
    if ema:  # the shadow of every parameter that trained (a frozen one, e.g. PDD's proj_out, has none: as trained)
        from distillery.components.checkpoint.dcp_io import read_dcp_metadata

        prefix = f"callbacks.{ema}.{role}.{module_name}."
        saved = {k[len(prefix):] for k in read_dcp_metadata(checkpoint / "dcp").state_dict_metadata if k.startswith(prefix)}
        params = dict(module.named_parameters())
        shadow = {n: torch.empty_like(p, dtype=torch.float32) for n, p in params.items() if n in saved}
        if not shadow:
            raise UserError(f"{checkpoint}: cannot load EMA callback {ema!r}: it holds no EMA weights for role {role!r}")
        load_dcp({f"callbacks.{ema}": {role: {module_name: shadow}}}, checkpoint / "dcp", f"EMA callback {ema!r}")
        with torch.no_grad():
            for n, t in shadow.items():
                params[n].copy_(t)


def check_out_folder(out: Path) -> None:
    """``out`` can be the export's folder: a folder there, or nothing there and no file on its way
    (a one-line :class:`UserError` otherwise, before any weight is loaded)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"export: --out {out} is a file, not a folder; name a folder (created when missing)")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"export: --out {out}: {parent} is a file, not a folder; name a folder")
            break


def export_weights(checkpoint: str | Path, role: str, out: str | Path, ema: str | None = None) -> Path:
    """Write ``<out>/transformer/`` for ``role`` of ``checkpoint``; returns that folder."""
    ckpt = Path(checkpoint)
    check_out_folder(Path(out))
    require_intact(ckpt, "export", "not exported")
    meta = json.loads((ckpt / "metadata.json").read_text())
    if role not in meta.get("roles", []):
        raise UserError(f"{ckpt}: no trainable role {role!r}; it holds {', '.join(meta.get('roles', [])) or 'none'}")
    from distillery.models.registry import family_of_class

    config_file = ckpt / "roles" / role / "config.json"
    config = json.loads(config_file.read_text())
    loaders = family_of_class(config.get("_class_name"), f"cannot export {config_file}").loaders()
    module = loaders.build_transformer(config)
    load_role_weights(ckpt, role, module, ema)
    out_dir = Path(out)
    final = out_dir / "transformer"
    tmp = out_dir / ".tmp-transformer"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"export: cannot create --out {out_dir}: {exc.strerror or exc}") from None
    if tmp.exists():
        shutil.rmtree(tmp)
    module.save_pretrained(tmp, safe_serialization=True)
    export_head_bank(ckpt, role, module, tmp, loaders, ema)
    follow_umask(tmp)  # safetensors writes its files 0600; the weights are as readable as every other file
    return replace_dir(tmp, final)


def export_head_bank(checkpoint: Path, role: str, transformer: torch.nn.Module, out: Path, loaders: "FamilyLoaders",
                     ema: str | None = None) -> bool:
    """When ``role`` trained a PDD head bank (DCP keys ``roles.<role>.heads.*``), write it as
    ``out/<HEAD_BANK_FILE>`` by the transformer's model family's ``loaders`` (``pdd_heads.safetensors`` for Wan,
    :mod:`distillery.models.wan.pdd`) — its EMA shadow when ``ema`` names the EMA callback, as for
    the trunk; returns whether it did."""
    from distillery.components.checkpoint.dcp_io import read_dcp_metadata

    prefix = f"roles.{role}.heads.weight."
    keys = [k for k in read_dcp_metadata(checkpoint / "dcp").state_dict_metadata if k.startswith(prefix)]
    if not keys:
        return False
    bank = loaders.empty_head_bank(transformer, len(keys))
    load_role_weights(checkpoint, role, bank, ema, module_name="heads")
    loaders.save_head_bank(out / loaders.HEAD_BANK_FILE, bank)
    return True
