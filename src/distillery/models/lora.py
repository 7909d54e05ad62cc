"""LoRA adapters on a role's transformer, through PEFT (the library diffusers' own ``load_lora_weights`` uses).

A role with ``models.<role>.lora`` (:class:`~distillery.config.schema.LoraConfig`) trains ``A``/``B`` pairs on the
Linear layers ``target_modules`` names, its base weights frozen. The contract, for every caller:

- :func:`check_lora` — before any weights load: the role is trainable, every target names a Linear layer of the
  role's architecture (:meth:`~distillery.models.base.ModelBase.linear_layers`, built on the meta device), the rank
  is at most the narrowest targeted layer's width. Each problem is one :class:`UserError` line.
- :func:`inject_lora` — adapters into a transformer (in place, before it is placed: sharded, copied to bf16,
  compiled, checkpointed); afterwards exactly the adapter parameters require grad. PEFT's layers keep the base
  weight at ``<path>.base_layer.weight`` and the adapter at ``<path>.lora_{A,B}.default.weight``.
- :func:`adapter_names` — the FQNs of a transformer's adapter parameters: what a checkpoint holds of the role
  (:class:`~distillery.components.checkpoint.stateful.ModuleState` ``adapters_only``).
- :func:`merge_lora_` — fold every adapter into its base weight (``W + alpha/rank · B A``) and put the plain Linear
  back: the transformer is then the stock class with stock parameter names (what ``save_pretrained`` writes).
- :func:`save_diffusers_lora` — the adapter as ``pytorch_lora_weights.safetensors`` in diffusers' layout
  (``transformer.<path>.lora_{A,B}.weight``, the PEFT config in its metadata: rank, alpha, targets), which a
  stock ``WanPipeline.load_lora_weights(folder)`` loads onto the base. A role of two experts (Wan 2.2 A14B) adapts
  both: the high-noise expert's adapter is that file, the low-noise one's ``pytorch_lora_weights_2.safetensors``
  (:data:`LORA_WEIGHTS_FILE_2`, the same layout), which ``load_lora_weights(folder, weight_name=...,
  load_into_transformer_2=True)`` loads onto ``transformer_2``.
- :func:`lora_record` / :func:`spec_from_record` — the spec as the checkpoint's ``metadata.json`` keeps it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from distillery.common.errors import UserError
from distillery.config.schema import LoraConfig

ADAPTER_NAME = "default"  # PEFT's adapter name inside our modules (one adapter per role)
LORA_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"  # diffusers' file name (load_lora_weights reads it by default)
LORA_WEIGHTS_FILE_2 = "pytorch_lora_weights_2.safetensors"  # a two-expert role's low-noise expert's adapter (module doc)


def matches(path: str, target: str) -> bool:
    """Whether module ``path`` is what ``target`` names: the same path, or one ending with ``.<target>`` (PEFT's rule)."""
    return path == target or path.endswith("." + target)


def linear_layers(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """``{dotted path: (in_features, out_features)}`` of every ``nn.Linear`` of ``module``."""
    return {name: (m.in_features, m.out_features) for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}


def check_targets(spec: LoraConfig, layers: dict[str, tuple[int, int]], where: str) -> list[str]:
    """The Linear layers ``spec`` targets (their paths); a :class:`UserError` when a target names none of ``layers``
    or the rank exceeds a targeted layer's width. ``where``: the config key (``models.student.lora``)."""
    chosen: list[str] = []
    suffixes = sorted({".".join(p.split(".")[-2:]) if p.split(".")[-1].isdigit() else p.split(".")[-1] for p in layers})
    for target in spec.target_modules:
        hit = [p for p in layers if matches(p, target)]
        if not hit:
            raise UserError(f"config error: {where}.target_modules: {target!r} names no Linear layer of this model; "
                            f"valid names end a layer's path, e.g. {', '.join(suffixes[:12])}")
        chosen += hit
    narrowest = min(min(layers[p]) for p in chosen)
    if spec.rank > narrowest:
        raise UserError(f"config error: {where}.rank: {spec.rank} is wider than the narrowest targeted layer ({narrowest}); "
                        f"a LoRA's rank must be at most {narrowest} here (typically 8–128)")
    return sorted(set(chosen))


def check_lora(role: str, spec: LoraConfig, trainable: bool, layers: dict[str, tuple[int, int]] | None) -> None:
    """Everything :func:`inject_lora` would refuse, checked from the config alone (module doc); ``layers``: the role's
    Linear layers (None: not known before the weights load; checked at injection)."""
    where = f"models.{role}.lora"
    if not trainable:
        raise UserError(f"config error: {where}: the {role} is frozen (trainable: false) and a LoRA is what trains; "
                        f"remove models.{role}.lora or make the {role} trainable")
    if layers is not None:
        check_targets(spec, layers, where)


def peft_config(spec: LoraConfig) -> Any:
    """PEFT's ``LoraConfig`` of ``spec`` (B initialised to zeros: the adapted model starts as its base)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                          lora_dropout=spec.dropout, init_lora_weights=True, bias="none")


def inject_lora(transformer: torch.nn.Module, spec: LoraConfig, where: str = "lora") -> list[str]:
    """Add ``spec``'s adapter to ``transformer`` in place (its own RNG draws A: seed before for a given init); freeze
    every other parameter of it. Returns the adapter parameters' FQNs."""
    from peft import inject_adapter_in_model

    check_targets(spec, linear_layers(transformer), where)
    inject_adapter_in_model(peft_config(spec), transformer, adapter_name=ADAPTER_NAME)
    names = adapter_names(transformer)
    for name, param in transformer.named_parameters():
        param.requires_grad_(name in names)
    return sorted(names)


def adapter_names(module: torch.nn.Module) -> set[str]:
    """FQNs of ``module``'s LoRA parameters (``...lora_A.default.weight`` / ``...lora_B.default.weight``)."""
    return {name for name, _ in module.named_parameters() if ".lora_A." in name or ".lora_B." in name}


@torch.no_grad()
def merge_lora_(module: torch.nn.Module) -> torch.nn.Module:
    """Fold every LoRA layer of ``module`` into its base weight and replace it by that base layer (in place); the
    result has the stock class's parameter names. Returns ``module``."""
    from peft.tuners.lora import LoraLayer

    layers = [(name, m) for name, m in module.named_modules() if isinstance(m, LoraLayer)]
    for name, layer in layers:
        layer.merge(safe_merge=True)  # a non-finite merged weight is an error, not a saved model
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, layer.get_base_layer())
    return module


def adapter_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights by diffusers' names (``<path>.lora_A.weight``, no adapter name), fp32, contiguous, on CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(module, adapter_name=ADAPTER_NAME)
    return {k: v.detach().float().contiguous().cpu() for k, v in state.items()}


def save_diffusers_lora(module: torch.nn.Module, spec: LoraConfig, folder: Path) -> Path:
    """Write ``module``'s adapter as ``folder/pytorch_lora_weights.safetensors`` (module doc) — of two experts (a module
    with ``experts``), each expert's in its own file, the second's :data:`LORA_WEIGHTS_FILE_2`; returns the first file."""
    from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin

    folder.mkdir(parents=True, exist_ok=True)
    state = adapter_state_dict(module)
    parts = [state]
    if hasattr(module, "experts"):  # the module's children transformer / transformer_2: each expert's own file
        parts = [{k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
                 for name in ("transformer", "transformer_2")]
    for part, name in zip(parts, (LORA_WEIGHTS_FILE, LORA_WEIGHTS_FILE_2)):
        WanLoraLoaderMixin.save_lora_weights(folder, transformer_lora_layers=part,
                                             transformer_lora_adapter_metadata=peft_config(spec).to_dict(), weight_name=name)
    return folder / LORA_WEIGHTS_FILE


def lora_record(spec: LoraConfig, base: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's ``metadata.json`` keeps of a LoRA role: the spec and its base (``path``, ``sha256``)."""
    return {**dataclasses.asdict(spec), "base": base}


def spec_from_record(record: dict[str, Any], where: str) -> LoraConfig:
    """The :class:`LoraConfig` of a :func:`lora_record` (a :class:`UserError` line when it is not one)."""
    from distillery.config.typed import from_mapping

    if not isinstance(record, dict):
        raise UserError(f"{where}: its LoRA record is not a mapping; not loaded")
    return from_mapping(LoraConfig, {k: v for k, v in record.items() if k != "base"}, where)


def lora_records(models: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """LoRA role → :func:`lora_record` of its spec and base (``model.source()``: the folder and its sha256), for
    the roles of ``models`` (role → :class:`~distillery.models.base.ModelBase`) that train an adapter."""
    return {role: lora_record(model.lora, model.source()) for role, model in models.items() if model.lora is not None}


BASE_FILE = "base.json"  # beside an exported adapter: its spec and the base it needs (path, sha256)
