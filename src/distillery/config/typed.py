"""Strict conversion of plain YAML data into typed config dataclasses.

``from_mapping(cls, data, where)`` builds dataclass ``cls`` from a mapping, recursing into
nested dataclasses, ``list``/``tuple``/``dict`` and ``Optional``/``Literal`` fields. Unknown
keys, missing required keys and wrong types raise :class:`~distillery.common.errors.UserError` with
one line naming the dotted key and what is valid. Explicit zeros and ``false`` are kept as given:
only absent keys take defaults. Echoed values go through :func:`~distillery.config.limits.show`
(cut to a readable length); a string field named like a path (:func:`is_path_field`) must be a
usable path (see :func:`~distillery.config.limits.path_problem`).

Every number a config holds is bounded, so no knob reaches the code with a value it cannot take (a
tensor of 10**12 tokens, a grid of 4e9 intervals): a field declared with :func:`bounded` must lie in
its range; any other integer within ±:data:`MAX_KNOB_INT`, any other float finite and within
±:data:`MAX_KNOB_FLOAT` (items of lists and tuples and values of mappings alike).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union

from distillery.common.errors import UserError
from distillery.config.limits import cut, path_problem, show, show_key, unknown_key_message

_MISSING = dataclasses.MISSING
MAX_KNOB_INT = 2**31 - 1  # an integer knob without its own range (a count, a step, an interval)
MAX_KNOB_FLOAT = 1e6  # |x| of a float knob without its own range (rates, scales, ratios, timesteps)
_RANGE = "range"  # a field's metadata key: (low, high), either None for no bound on that side

PATH_FIELD_NAMES = frozenset({"path", "init_from", "output_dir", "resume", "split"})
PATH_FIELD_SUFFIXES = ("_dir", "_path", "_file", "_from")


def bounded(default: Any = _MISSING, low: float | None = None, high: float | None = None, *,
            default_factory: Any = _MISSING) -> Any:
    """A dataclass field whose numbers (the value, or each item of a list) must lie in ``[low, high]``."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_RANGE: (low, high)})


def range_problem(value: Any, bounds: tuple[float | None, float | None] | None) -> str | None:
    """What is wrong with the number ``value`` for ``bounds`` (None: the default bounds of the module doc)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if bounds is None:
        limit = MAX_KNOB_INT if isinstance(value, int) else MAX_KNOB_FLOAT
        bounds = (-limit, limit)
    low, high = bounds
    if low is not None and value < low:
        return f"must be ≥ {low:g}" if isinstance(low, float) else f"must be ≥ {low}"
    if high is not None and value > high:
        return f"must be ≤ {high:g}" if isinstance(high, float) else f"must be ≤ {high}"
    return None


def _check_numbers(value: Any, bounds: Any, where: str) -> None:
    """Every number in ``value`` (itself, list/tuple items, mapping values) within ``bounds``."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_numbers(item, bounds, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_numbers(item, bounds, _join(where, show_key(key)))
    else:
        problem = range_problem(value, bounds)
        if problem:
            raise config_error(where, f"{show(value)}: {problem}")


def config_error(where: str, message: str) -> UserError:
    """Build the one-line config error for the dotted key ``where`` (the line is cut if absurdly long)."""
    return UserError(cut(f"config error: {cut(where, 200)}: {message}"))


def is_path_field(name: str) -> bool:
    """Whether a string config field called ``name`` holds a file-system path (checked by :func:`from_mapping`)."""
    return name in PATH_FIELD_NAMES or name.endswith(PATH_FIELD_SUFFIXES)


def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass's fields (string annotations evaluated)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against type ``tp`` and convert it (int → float, list → tuple, dict → dataclass)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool) != any(isinstance(c, bool) for c in choices if c == value):
            raise config_error(where, f"got {show(value)}; valid values: {', '.join(repr(c) for c in choices)}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise config_error(where, f"must not be null; expected {_type_name(tp)}")
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except UserError:
                pass
        raise config_error(where, f"got {show(value)}; expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise config_error(where, f"expected a mapping with keys {', '.join(field_types(tp))}, got {show(value)}")
        return from_mapping(tp, value, where)
    if origin in (list, tuple, typing.Sequence, _abc_sequence()):
        if not isinstance(value, (list, tuple)):
            raise config_error(where, f"expected a list ({_type_name(tp)}), got {show(value)}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise config_error(where, f"expected {len(args)} items ({_type_name(tp)}), got {len(value)}")
            return tuple(coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        items = [coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, typing.Mapping, _abc_mapping()):
        if not isinstance(value, dict):
            raise config_error(where, f"expected a mapping, got {show(value)}")
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        return {coerce(k, key_tp, f"{where}"): coerce(v, val_tp, _join(where, show_key(k))) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise config_error(where, f"expected true or false, got {show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise config_error(where, f"expected an integer, got {show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise config_error(where, f"expected a number, got {show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise config_error(where, f"expected a string, got {show(value)}")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise config_error(where, f"got {show(value)}; expected {_type_name(tp)}")


def _abc_sequence() -> Any:
    import collections.abc

    return collections.abc.Sequence


def _abc_mapping() -> Any:
    import collections.abc

    return collections.abc.Mapping


def from_mapping(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from ``data``; every key must be a field, every required field present."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise config_error(where, f"expected a mapping, got {show(data)}")
    types_by_name = field_types(cls)
    unknown = [k for k in data if k not in types_by_name]
    if unknown:
        raise config_error(_join(where, show_key(unknown[0])), unknown_key_message(unknown[0], types_by_name))
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = _join(where, f.name)
        if f.name in data:
            kwargs[f.name] = coerce(data[f.name], types_by_name[f.name], key)
            if not dataclasses.is_dataclass(kwargs[f.name]):
                _check_numbers(kwargs[f.name], f.metadata.get(_RANGE), key)
            if isinstance(kwargs[f.name], str) and is_path_field(f.name):
                problem = path_problem(kwargs[f.name])
                if problem:
                    raise config_error(key, f"{show(kwargs[f.name])}: {problem}")
        elif f.default is _MISSING and f.default_factory is _MISSING:  # type: ignore[misc]
            raise config_error(key, f"required key is missing ({_type_name(types_by_name[f.name])})")
    try:
        obj = cls(**kwargs)
    except UserError:
        raise
    except (TypeError, ValueError) as exc:
        raise config_error(where or cls.__name__, cut(str(exc), 300)) from None
    return obj


def to_plain(obj: Any) -> Any:
    """Turn a config dataclass tree back into plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if hasattr(obj, "to_plain"):
            return obj.to_plain()
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
