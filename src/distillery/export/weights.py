"""Weights out: a checkpoint role's transformer as a diffusers ``transformer/`` folder.

``export_weights(checkpoint, role, out)`` rebuilds the transformer from the architecture saved in
the checkpoint (``roles/<role>/config.json``), loads that role's weights (or its EMA shadow) from
the DCP shards on one process (any saving world size), and writes ``<out>/transformer/`` with
``save_pretrained`` (safetensors + config.json), atomically — with the role's PDD head bank beside
the weights (``pdd_heads.safetensors``) when it trained one. A role that trained a LoRA adapter is its base +
the adapter, written merged and/or as a diffusers LoRA file (``<out>/lora/``, :func:`export_lora_folder`).

The checkpoint folder is named by the user, so its recorded checksums must verify before anything
in it is read, and its DCP files are read without unpickling (:mod:`distillery.components.checkpoint.dcp_io`).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from distillery.common.errors import UserError
from distillery.common.fsutil import follow_umask, replace_dir
from distillery.components.checkpoint.dcp_io import load_dcp
from distillery.components.checkpoint.trust import require_intact

if TYPE_CHECKING:
    from distillery.models.registry import FamilyLoaders


def load_role_weights(checkpoint: Path, role: str, module: torch.nn.Module, ema: str | None = None,
                      module_name: str = "transformer", adapters_only: bool = False) -> None:
    """Load ``role``'s ``module_name`` weights (DCP key ``roles.<role>.<module_name>``) from the
    checkpoint into ``module`` (in place, single process, any saving world size).

    ``ema`` names an EMA callback whose shadow weights to load instead (key ``callbacks.<ema>``);
    ``adapters_only``: the role trained a LoRA adapter (``module`` has it injected over its base): only the
    adapter's parameters are in the checkpoint and are loaded. Reads through the safe DCP reader; does not
    verify checksums (:func:`export_weights` does). A failure raises a one-line UserError.
    """
    from distillery.components.checkpoint.stateful import is_adapter_key

    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    checkpoint = Path(checkpoint)
    state = module.state_dict()
    if adapters_only:
        state = {k: v for k, v in state.items() if is_adapter_key(k)}
    load_dcp({f"roles.{role}.{module_name}": state}, checkpoint / "dcp", f"role {role!r}")
    module.load_state_dict(state, strict=not adapters_only)
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


LORA_FORMS = ("merged", "adapter", "both")  # what export_weights writes of a LoRA role (``lora``)


def export_weights(checkpoint: str | Path, role: str, out: str | Path, ema: str | None = None, lora: str = "both") -> Path:
    """Write ``<out>/transformer/`` for ``role`` of ``checkpoint``; returns that folder.

    A role that trained a LoRA adapter (the checkpoint's ``metadata.json`` ``lora.<role>``: its spec and base) is
    rebuilt as base + adapter (the base checked against its recorded sha256 first), and ``lora`` says what is
    written: ``merged`` — ``transformer/`` with the adapter folded into the weights (a stock transformer);
    ``adapter`` — only ``<out>/lora/`` (:func:`export_lora_folder`: the diffusers LoRA file stock
    ``load_lora_weights`` reads, and ``base.json`` naming the base it needs), and that folder is returned;
    ``both`` (default) — both. ``adapter`` of a role that trained its full weights is a :class:`UserError`."""
    if lora not in LORA_FORMS:
        raise UserError(f"export: lora: {lora!r}; valid: {', '.join(LORA_FORMS)}")
    ckpt = Path(checkpoint)
    check_out_folder(Path(out))
    require_intact(ckpt, "export", "not exported")
    meta = json.loads((ckpt / "metadata.json").read_text())
    if role not in meta.get("roles", []):
        raise UserError(f"{ckpt}: no trainable role {role!r}; it holds {', '.join(meta.get('roles', [])) or 'none'}")
    record = (meta.get("lora") or {}).get(role)
    if record is None and lora == "adapter":
        raise UserError(f"{ckpt}: the {role} trained its full weights, not a LoRA adapter (models.{role}.lora); "
                        "export it merged")
    from distillery.models.registry import family_of_class

    config_file = ckpt / "roles" / role / "config.json"
    config = json.loads(config_file.read_text())
    loaders = family_of_class(config.get("_class_name"), f"cannot export {config_file}").loaders()
    if record is None and lora != "adapter":
        direct = _export_direct(ckpt, role, config, Path(out), loaders, ema)
        if direct is not None:
            return direct
    if record is None:
        module = loaders.build_transformer(config)
        load_role_weights(ckpt, role, module, ema)
    else:
        module = load_base_with_adapter(record, config, f"{ckpt}: the {role}'s LoRA")
        load_role_weights(ckpt, role, module, ema, adapters_only=True)
    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"export: cannot create --out {out_dir}: {exc.strerror or exc}") from None
    if record is not None and lora in ("adapter", "both"):
        lora_dir = export_lora_folder(module, record, out_dir)
        if lora == "adapter":
            return lora_dir
    if record is not None:
        from distillery.models.lora import merge_lora_

        merge_lora_(module)
    final = out_dir / "transformer"
    tmp = out_dir / ".tmp-transformer"
    if tmp.exists():
        shutil.rmtree(tmp)
    module.save_pretrained(tmp, safe_serialization=True)
    export_head_bank(ckpt, role, module, tmp, loaders, ema)
    follow_umask(tmp)  # safetensors writes its files 0600; the weights are as readable as every other file
    return replace_dir(tmp, final)


def _export_direct(ckpt: Path, role: str, config: dict[str, Any], out_dir: Path, loaders: "FamilyLoaders",
                   ema: str | None) -> Path | None:
    """``<out_dir>/transformer/`` of a full-weight role written without diffusers, byte for byte what
    ``save_pretrained`` writes (:mod:`distillery.export.direct_weights`); None when that is not provable here."""
    from distillery.export import direct_weights as direct

    config_text = direct.direct_config(config)
    if config_text is None:
        return None
    shapes = direct.role_tensor_shapes(ckpt, role)
    if not shapes or not direct.fits_one_file(shapes):
        return None
    state = direct.load_role_tensors(ckpt, role, shapes, ema)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"export: cannot create --out {out_dir}: {exc.strerror or exc}") from None
    final, tmp = out_dir / "transformer", out_dir / ".tmp-transformer"
    if tmp.exists():
        shutil.rmtree(tmp)
    direct.write_direct(tmp, config_text, state)
    export_head_bank(ckpt, role, direct.ProjOutHolder(state), tmp, loaders, ema)
    follow_umask(tmp)  # safetensors writes its files 0600; the weights are as readable as every other file
    return replace_dir(tmp, final)


def export_lora_folder(module: torch.nn.Module, record: dict, out_dir: Path) -> Path:
    """``<out_dir>/lora/``, atomically: ``pytorch_lora_weights.safetensors`` (``module``'s adapter in diffusers' layout;
    of two experts, the second's in ``pytorch_lora_weights_2.safetensors``) and ``base.json``
    (:data:`distillery.models.lora.BASE_FILE`: the adapter's spec and the base it needs, path and sha256, the second
    expert's under ``base.second``). Returns the folder."""
    from distillery.models.lora import BASE_FILE, LORA_WEIGHTS_FILE, LORA_WEIGHTS_FILE_2, save_diffusers_lora, spec_from_record

    tmp, final = out_dir / ".tmp-lora", out_dir / "lora"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_diffusers_lora(module, spec_from_record(record, "lora"), tmp)
    files = {"weights": LORA_WEIGHTS_FILE, **({"weights_2": LORA_WEIGHTS_FILE_2} if hasattr(module, "experts") else {})}
    (tmp / BASE_FILE).write_text(json.dumps({**record, **files}, indent=2, sort_keys=True) + "\n")
    follow_umask(tmp)
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


def _base_folder(base: dict[str, Any], where: str) -> Path:
    """The base folder a LoRA record names (``path``), checked against its recorded ``sha256`` (a :class:`UserError`
    line when it is not here or holds other weights)."""
    from distillery.common.hashcache import folder_sha256

    folder = Path(str(base.get("path") or ""))
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise UserError(f"{where} was trained on the base {folder}, which is not here (sha256 "
                        f"{str(base.get('sha256'))[:12]}…); an adapter needs its base: restore it there")
    if folder_sha256(folder) != base.get("sha256"):
        raise UserError(f"{where} was trained on {folder} with sha256 {str(base.get('sha256'))[:12]}…; the folder there "
                        "now holds other weights: restore that base")
    return folder


def load_base_with_adapter(record: dict[str, Any], config: dict[str, Any], where: str) -> torch.nn.Module:
    """The transformer a LoRA checkpoint's ``record`` (:func:`distillery.models.lora.lora_record`) trained on — its base folder, checked
    against the recorded sha256 — with the (untrained) adapter injected, fp32 on CPU: load the checkpoint's adapter
    into it. ``config``: the role's architecture (``roles/<role>/config.json``); it must be the base's. A base of two
    experts (its record's ``base.second``: Wan 2.2 A14B's ``transformer_2``) gives the family's module of both, each
    expert's weights from its folder, both adapted."""
    import diffusers

    from distillery.models.lora import inject_lora, spec_from_record
    from distillery.models.registry import family_of_class

    spec = spec_from_record(record, where)
    base = record.get("base") if isinstance(record.get("base"), dict) else {}
    folders = [_base_folder(base, where)]
    if isinstance(base.get("second"), dict):
        folders.append(_base_folder(base["second"], f"{where} (its second expert)"))
    class_name = config.get("_class_name")
    loaders = family_of_class(class_name, where).loaders()  # a class of a registered family: the one diffusers names so
    experts = [getattr(diffusers, str(class_name)).from_pretrained(folder, torch_dtype=torch.float32) for folder in folders]
    module = experts[0]
    if len(experts) > 1:  # the family's two-expert module of the role's config, each expert's base weights loaded
        module = loaders.build_transformer(config)
        targets = getattr(module, "experts", None)
        if targets is None or len(targets) != len(experts):
            raise UserError(f"{where}: its record names two base experts; the role's config.json is of one transformer")
        for target, expert in zip(targets, experts):
            target.load_state_dict(expert.state_dict())
    inject_lora(module, spec, where)
    return module
