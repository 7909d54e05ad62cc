"""Load a run config: YAML file → dotted overrides → typed, validated :class:`RunConfig`.

An override names a key that must exist in the schema (a dataclass field or a component's
``_target_``/config field), else a one-line UserError; :func:`set_override` sets it to a Python
value (how a training stage fills its template from typed params: no YAML text between them).
A command-line override (``--training.optimizer.learning_rate 1e-4``) is a ``(dotted.key,
value_text)`` pair whose text is read as DVC reads YAML, 1.2 (:func:`parse_override_value`:
``10`` is an int, ``1e-4`` a float, ``true`` a bool, ``[1, 2]`` a list; a scalar YAML 1.1 would read
as another value, ``010`` or ``yes``, is refused in one line saying how to write it).

The file and every override value are read within the bounds of :mod:`distillery.config.limits`
(size, nesting, string and integer length, strict UTF-8), so no input ends in a traceback.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from distillery.common.errors import UserError
from distillery.config.limits import (
    MAX_DEPTH,
    MAX_KEY_CHARS,
    MAX_OVERRIDE_CHARS,
    did_you_mean,
    key_list,
    parse_yaml_text,
    read_yaml_file,
    show,
    show_key,
    show_path,
    unknown_key_message,
)
from distillery.config.schema import Component, LoraConfig, OptimizerOverride, RoleDistributedOverride, RunConfig, TrainingConfig
from distillery.config.targets import resolve_target
from distillery.config.typed import check_fields, config_error, field_types, from_mapping
from distillery.config.yaml_versions import Scalar, collector, disagreement_line, disagreements, dvc_load, is_dotless_float

TOP_LEVEL_KEYS = ("models", "method", "training", "callbacks")
MAX_TARGET_CHARS = 200  # a _target_ dotted path
_TARGET_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a run-config YAML mapping within the input bounds; any problem is a one-line UserError."""
    source = f"config error: {show_path(path)}"
    data = read_yaml_file(path, source, "file not found")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{source}: the top level must be a mapping with keys {', '.join(TOP_LEVEL_KEYS)}")
    return data


def parse_override_args(args: list[str]) -> list[tuple[str, str]]:
    """Turn ``["--training.loop.max_train_steps", "10", "--a.b=3"]`` into key/value pairs."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise UserError(f"config error: unexpected argument {show(arg)}; overrides look like --training.loop.max_train_steps 10")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise UserError(f"config error: override --{show_key(key)} has no value")
            value = args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def _check_override_key(key: str) -> list[str]:
    """The parts of a dotted override key, after checking it is a plausible key at all."""
    parts = key.split(".")
    if not all(parts) or len(parts) > MAX_DEPTH or any(len(p) > MAX_KEY_CHARS for p in parts) or not key.isprintable():
        raise UserError(f"config error: --{show_key(key)}: malformed key; overrides look like --training.loop.max_train_steps 10")
    return parts


_OVERRIDE_READERS = ("YAML 1.2 (as DVC reads it)", "YAML 1.1 (as a run-config file reads it)")


def parse_override_value(key: str, value_text: str) -> Any:
    """The value of one command-line override as YAML 1.2 reads it (as DVC reads ``-S key=value`` and
    params.yaml), within the same bounds as a config file; text that is not YAML is a string.

    Where YAML 1.1 (PyYAML, a run-config file) reads a scalar as another value, the exponent without a
    dot is 1.2's float (``1e-4``, what the train help shows); any other (``010``, ``yes``, ``1:00``) is
    refused in one line saying how to write it so both read one value.
    """
    source = f"config error: --{show_key(key)}"
    if len(value_text) > MAX_OVERRIDE_CHARS:
        raise UserError(f"{source}: a value of {len(value_text)} characters; at most {MAX_OVERRIDE_CHARS}")
    scalars: list[Scalar] = []
    value = parse_yaml_text(value_text, source, syntax_error_as_text=True, on_scalar=collector(scalars))
    found = disagreements(scalars)
    refused = [d for d in found if not is_dotless_float(d[1], d[2])]
    if refused:
        raise UserError(disagreement_line(*refused[0], source, line=False, readers=_OVERRIDE_READERS))
    if found:  # only floats 1.1 reads as text: the value as 1.2 reads it
        try:
            return dvc_load(value_text)
        except Exception:  # noqa: BLE001 - not YAML to 1.2 either: the text, as parse_yaml_text gave it
            return value
    return value


def check_target(target: Any, where: str) -> None:
    """A ``_target_`` must be a short dotted Python path before anything tries to import it."""
    if not isinstance(target, str) or len(target) > MAX_TARGET_CHARS or not _TARGET_RE.fullmatch(target):
        raise config_error(f"{where}._target_", f"expected a dotted path like distillery.models.wan.WanModel "
                                                 f"(at most {MAX_TARGET_CHARS} characters), got {show(target)}")


def _config_class(cls: Any, where: str) -> type:
    config_cls = getattr(cls, "config_class", None)
    if config_cls is None or not dataclasses.is_dataclass(config_cls):
        raise UserError(f"config error: {where}._target_: {cls.__module__}.{cls.__qualname__} is not a distillery component (no config_class)")
    return config_cls


def _check_dataclass_path(tp: Any, parts: list[str], where: str) -> None:
    """Check that ``parts`` names an existing (possibly nested) field of dataclass ``tp``."""
    for i, part in enumerate(parts):
        types_by_name = field_types(tp)
        key = ".".join([where, *parts[: i + 1]])
        if part not in types_by_name:
            raise config_error(key, unknown_key_message(part, types_by_name))
        tp = types_by_name[part]
        if i + 1 < len(parts) and not dataclasses.is_dataclass(tp):
            origin = typing.get_origin(tp)
            if origin in (dict,):
                return  # free-form mapping (e.g. tracker.tags.<name>)
            raise config_error(key, "is not a section; it has no sub-keys")


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    """``raw[key]`` when it is a mapping, else empty (the full check reports what it really is)."""
    value = raw.get(key)
    return value if isinstance(value, dict) else {}


def apply_override(raw: dict[str, Any], key: str, value_text: str, prefixes: tuple[str, ...]) -> None:
    """Set ``key`` (dotted) in the raw config to the command-line text ``value_text`` read as
    :func:`parse_override_value` reads it, after checking the key exists."""
    _check_override_key(key)  # a malformed key before its value is read
    set_override(raw, key, parse_override_value(key, value_text), prefixes)


def set_override(raw: dict[str, Any], key: str, value: Any, prefixes: tuple[str, ...]) -> None:
    """Set ``key`` (dotted) in the raw config to the Python ``value`` after checking the key exists in
    the schema (the value itself is checked when the config is built, :func:`build_run_config`)."""
    parts = _check_override_key(key)
    head = parts[0]
    if head not in TOP_LEVEL_KEYS:
        raise config_error(show_key(head), unknown_key_message(head, TOP_LEVEL_KEYS))
    if head == "training":
        if len(parts) < 2:
            raise config_error(key, "override a single key, e.g. training.loop.max_train_steps")
        _check_dataclass_path(TrainingConfig, parts[1:], "training")
    elif head == "method":
        if len(parts) < 2:
            raise config_error(key, "override a single key, e.g. method.chunk_size")
        section = _section(raw, "method")
        if parts[1] != "_target_":
            check_target(section.get("_target_"), "method")
            cls = resolve_target(section.get("_target_"), "method", prefixes)
            _check_dataclass_path(_config_class(cls, "method"), parts[1:], "method")
    else:  # models / callbacks: <name>.<key>
        if len(parts) < 3:
            raise config_error(key, f"override a single key, e.g. {head}.<name>.<key>")
        entries = _section(raw, head)
        name = parts[1]
        if name not in entries:
            raise config_error(f"{head}.{show_key(name)}", f"unknown {head[:-1] if head != 'callbacks' else 'callback'}; "
                                                           f"valid: {key_list(entries)}{did_you_mean(name, entries)}")
        if parts[2] != "_target_":
            where = f"{head}.{name}"
            target = _section(entries, name).get("_target_")
            check_target(target, where)
            cls = resolve_target(target, where, prefixes)
            overrides = {"optimizer": OptimizerOverride, "distributed": RoleDistributedOverride, "lora": LoraConfig}
            if head == "models" and parts[2] in overrides:
                if len(parts) > 3:
                    _check_dataclass_path(overrides[parts[2]], parts[3:], f"{where}.{parts[2]}")
            else:
                _check_dataclass_path(_config_class(cls, where), parts[2:], where)
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


KIND_BASES = {"model": "ModelBase", "method": "TrainingMethod", "callback": "Callback", "reward": "Reward"}


def build_component(entry: Any, where: str, prefixes: tuple[str, ...], kind: str | None = None) -> Component:
    """Resolve one ``{_target_: ..., knobs...}`` entry into a :class:`Component`.

    ``kind`` (``model`` | ``method`` | ``callback``): a target whose class does not declare that
    ``component_kind`` (the plugin base classes do) is refused before its knobs are checked; the
    config package imports no plugin base class. A model entry may hold ``optimizer:`` (the role's
    :class:`OptimizerOverride`), ``distributed:`` (its mesh, :class:`RoleDistributedOverride`) and ``lora:``
    (a LoRA adapter that trains instead of its weights, :class:`LoraConfig`; null: none).
    """
    if not isinstance(entry, dict) or "_target_" not in entry:
        raise config_error(where, "expected a mapping with a _target_ key")
    target = entry["_target_"]
    check_target(target, where)
    cls = resolve_target(target, where, prefixes)
    if kind is not None and not (isinstance(cls, type) and getattr(cls, "component_kind", None) == kind):
        raise config_error(f"{where}._target_", f"{target} is not a distillery {kind} ({KIND_BASES[kind]})")
    config_cls = _config_class(cls, where)
    knobs = {k: v for k, v in entry.items() if k != "_target_"}
    optimizer = distributed = lora = None
    if kind == "model" and "lora" in knobs:  # null: no adapter (the role's weights train, or it is frozen)
        given = knobs.pop("lora")
        lora = None if given is None else _role_section(LoraConfig, given, f"{where}.lora")
    if kind == "model" and "optimizer" in knobs:
        optimizer = _role_section(OptimizerOverride, knobs.pop("optimizer"), f"{where}.optimizer")
    if kind == "model" and "distributed" in knobs:
        distributed = _role_section(RoleDistributedOverride, knobs.pop("distributed"), f"{where}.distributed")
    config = from_mapping(config_cls, knobs, where)
    return Component(target=target, cls=cls, config=config, optimizer=optimizer, distributed=distributed, lora=lora,
                     plugins=resolve_plugins(config, where, prefixes))


def _role_section(cls: type, given: Any, where: str) -> Any:
    """A model entry's ``optimizer`` / ``distributed`` / ``lora``: a mapping read into ``cls``, or a ``cls`` a recipe
    built, held to the same field declarations (:func:`~distillery.config.typed.check_fields`)."""
    if isinstance(given, cls):
        check_fields(given, where)
        return given
    return from_mapping(cls, given or {}, where)


def public_path(cls: type) -> str:
    """``cls``'s dotted path as its package hands it out: the shortest ``<module>.<name>`` of an imported module holding
    ``cls`` under its name (``distillery.models.wan.WanModel``, not ``distillery.models.wan.bidirectional.WanModel``)."""
    parts = cls.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None and getattr(module, cls.__qualname__, None) is cls:
            return f"{'.'.join(parts[:end])}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def component_of(cls: type, where: str, prefixes: tuple[str, ...] = ("distillery.",), **knobs: Any) -> Component:
    """The :class:`Component` of the plugin class ``cls`` with ``knobs`` (its config class's fields; for a model also
    ``optimizer``, ``distributed``, ``lora``) — what a recipe builds its run config from: each value checked against its
    field's declaration as a file's would be (:func:`build_component`, the kind ``cls`` declares), its ``_target_`` the
    path its package exports it under (:func:`public_path`)."""
    return build_component({"_target_": public_path(cls), **knobs}, where, prefixes, getattr(cls, "component_kind", None))


def resolve_plugins(config: Any, where: str, prefixes: tuple[str, ...]) -> dict[str, Any]:
    """The plugins a component's ``config`` names: each field its class lists in ``plugin_fields`` holds
    a dotted ``_target_`` path (or null: none), resolved under the allowed prefixes like any
    ``_target_`` — a bad one is a one-line error while the run config is built, before anything loads.
    Each field its class lists in ``component_fields`` (field → component kind, e.g. a method's ``rewards`` →
    ``reward``) holds a mapping of names to ``{_target_: ..., knobs}`` entries, each built as a component of that
    kind (:func:`build_component`: its class, its typed knobs): ``plugins[field]`` is ``{name: Component}``."""
    plugins: dict[str, Any] = {}
    for name, kind in getattr(type(config), "component_fields", {}).items():
        entries = getattr(config, name)
        if entries is None:
            continue
        if not isinstance(entries, dict):
            raise config_error(f"{where}.{name}", f"expected a mapping of name -> {{_target_: ..., ...}}, got {show(entries)}")
        plugins[name] = {key: build_component(entry, f"{where}.{name}.{show_key(key)}", prefixes, kind)
                         for key, entry in entries.items()}
    for name in getattr(type(config), "plugin_fields", ()):
        target = getattr(config, name)
        if target is None:
            continue
        if not isinstance(target, str) or len(target) > MAX_TARGET_CHARS or not _TARGET_RE.fullmatch(target):
            raise config_error(f"{where}.{name}", f"expected a dotted path like distillery.clips.analyzer.folder_scorer "
                                                  f"(at most {MAX_TARGET_CHARS} characters), got {show(target)}")
        plugins[name] = resolve_target(target, f"{where}.{name}", prefixes)
    return plugins


def build_run_config(raw: dict[str, Any], prefixes: tuple[str, ...]) -> RunConfig:
    """Validate the raw mapping and build the typed :class:`RunConfig`."""
    unknown = [k for k in raw if k not in TOP_LEVEL_KEYS]
    if unknown:
        raise config_error(show_key(unknown[0]), unknown_key_message(unknown[0], TOP_LEVEL_KEYS))
    models_raw = raw.get("models")
    if not isinstance(models_raw, dict) or not models_raw:
        raise config_error("models", "required: a mapping of role -> {_target_: ..., ...} with at least a student")
    if "method" not in raw:
        raise config_error("method", "required key is missing ({_target_: ..., knobs})")
    models = {
        role: build_component(entry, f"models.{show_key(role)}", prefixes, "model")
        for role, entry in models_raw.items()
    }
    method = build_component(raw["method"], "method", prefixes, "method")
    training = from_mapping(TrainingConfig, raw.get("training") or {}, "training")
    callbacks_raw = raw.get("callbacks") or {}
    if not isinstance(callbacks_raw, dict):
        raise config_error("callbacks", "expected a mapping of name -> {_target_: ..., ...}")
    callbacks = {
        name: build_component(entry, f"callbacks.{show_key(name)}", prefixes, "callback")
        for name, entry in callbacks_raw.items()
    }
    return RunConfig(models=models, method=method, training=training, callbacks=callbacks)


def load_run_config(
    path: str | Path | None = None,
    overrides: list[tuple[str, str]] = (),  # type: ignore[assignment]
    prefixes: tuple[str, ...] = ("distillery.",),
    raw: dict[str, Any] | None = None,
) -> RunConfig:
    """Read ``path`` (or take ``raw``), apply overrides, and return the typed run config."""
    data = copy.deepcopy(raw) if raw is not None else read_yaml(path)  # type: ignore[arg-type]
    for key, value in overrides:
        apply_override(data, key, value, prefixes)
    return build_run_config(data, prefixes)


def dump_run_config(config: RunConfig) -> str:
    """The resolved config as YAML text (what ``--dry-run`` prints and tracking stores)."""
    return yaml.safe_dump(config.to_plain(), sort_keys=False)
