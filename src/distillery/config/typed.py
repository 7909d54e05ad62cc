"""Strict conversion of plain YAML data into typed config dataclasses: the one converter of run
configs and of ``params.yaml`` (:mod:`distillery.pipeline.params.schema`).

``from_mapping(cls, data, where)`` builds dataclass ``cls`` from a mapping, recursing into
nested dataclasses, ``list``/``tuple``/``dict`` and ``Optional``/``Literal`` fields. Unknown
keys, missing required keys and wrong types raise a :class:`FieldError` (a
:class:`~distillery.common.errors.UserError`): one line naming the dotted key and what is valid,
worded for a run config; a reader of another file words the same facts its own way
(:meth:`FieldError.worded`). Explicit zeros and ``false`` are kept as given: only absent keys take
defaults. Echoed values go through :func:`~distillery.config.limits.show` (cut to a readable
length); a string field named like a path (:func:`is_path_field`) must be a usable path (see
:func:`~distillery.config.limits.path_problem`).

Every number a config holds is bounded, so no knob reaches the code with a value it cannot take (a
tensor of 10**12 tokens, a grid of 4e9 intervals): a field declared with :func:`bounded` must lie in
its range; any other integer within ±:data:`MAX_KNOB_INT`, any other float finite and within
±:data:`MAX_KNOB_FLOAT` (items of lists and tuples and values of mappings alike). A field may also
carry a ``check`` (``bounded(..., check=fn)``: a rule of its own, e.g. 4k+1 frames, a host:port), run on
the value as given once its type fits and before its range; a null (where the type allows it) is no number
and meets no check. Each rule is declared once, on its field: :func:`check_fields` holds a config built in
Python to the same declarations, and :func:`with_default` declares a field again with another default.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from distillery.common.errors import UserError
from distillery.config.limits import cut, path_problem, show, show_key, unknown_key_message
from distillery.config.yaml_versions import float_text

_MISSING = dataclasses.MISSING
MAX_KNOB_INT = 2**31 - 1  # an integer knob without its own range (a count, a step, an interval)
MAX_KNOB_FLOAT = 1e6  # |x| of a float knob without its own range (rates, scales, ratios, timesteps)
_RANGE = "range"  # a field's metadata key: (low, high), either None for no bound on that side
_CHECK = "check"  # a field's metadata key: fn(value as given) -> what is wrong with it, or None
Check = Callable[[Any], "str | None"]
NO_VALUE = object()  # FieldError.value when the problem is the key itself (unknown, missing)
_EXPONENT_TEXT = re.compile(r"[-+]?(\d[\d_]*\.?\d*|\.\d+)[eE][-+]?\d+")  # 1e-4, 1.e-4, 12E5: text to YAML 1.1

PATH_FIELD_NAMES = frozenset({"path", "init_from", "output_dir", "resume", "split"})
PATH_FIELD_SUFFIXES = ("_dir", "_path", "_file", "_from")


def bounded(default: Any = _MISSING, low: float | None = None, high: float | None = None, *,
            default_factory: Any = _MISSING, check: Check | None = None, **metadata: Any) -> Any:
    """A dataclass field whose numbers (the value, or each item of a list) must lie in ``[low, high]``
    (None: no bound on that side); ``check``: a further rule on the value as given (module doc);
    ``metadata``: further facts a reader of the field's declaration may use (a params field's run-config keys)."""
    metadata[_RANGE] = (low, high)
    if check is not None:
        metadata[_CHECK] = check
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def with_default(cls: type, name: str, default: Any, **metadata: Any) -> Any:
    """The field ``name`` of dataclass ``cls`` declared again with another default and everything else of its
    declaration (range, check, metadata; ``metadata`` replaces those facts it names): a field that follows
    another's rule (a subclass's default, an override of the same knob) without restating it."""
    return dataclasses.field(default=default, metadata={**cls.__dataclass_fields__[name].metadata, **metadata})  # type: ignore[attr-defined]


def positive_finite(v: float) -> str | None:
    """A check (:func:`bounded`): a finite number above 0 (a learning rate, a rate, a scale)."""
    return None if math.isfinite(v) and v > 0 else "must be a finite number > 0"


class FieldError(UserError):
    """A key whose value does not fit its field, kept as facts a reader can word for its own file.

    ``key``: the dotted key; ``value``: the value as given (:data:`NO_VALUE` when the key itself is
    wrong: unknown, missing); ``problem``: what is wrong, the text after the value (``expected an
    integer``, ``must be ≥ 1``, ``valid values: a, b``). ``str()`` is the run-config line
    (``config error: <key>: ...``, or ``message`` when given); :meth:`worded` the line of another file.
    """

    def __init__(self, key: str, value: Any, problem: str, message: str | None = None) -> None:
        self.key, self.value, self.problem = key, value, problem
        if message is None:
            text = problem if value is NO_VALUE else f"{show(value)}: {problem}"
            message = f"config error: {cut(key, 200)}: {text}"
        super().__init__(cut(message))

    def worded(self, source: str) -> str:
        """``<source>: <key>: <value>: <problem>`` (``<source>: <key>: <problem>`` for a key's own problem)."""
        head = f"{source}: {cut(self.key, 200)}" if self.key else source
        return cut(head + (f": {self.problem}" if self.value is NO_VALUE else f": {show(self.value)}: {self.problem}"))


def _mismatch(where: str, value: Any, expected: str, config_text: str | None = None) -> FieldError:
    """The value's type does not fit: ``expected`` (e.g. ``expected an integer``) after the value;
    the run-config line says ``<expected>, got <value>`` unless ``config_text`` words it."""
    return FieldError(where, value, expected, f"config error: {cut(where, 200)}: {config_text or f'{expected}, got {show(value)}'}")


def _float_text_hint(value: Any) -> str:
    """For a number YAML 1.1 read as text (``1e-4``): how to write it so that it is a number."""
    if isinstance(value, str) and _EXPONENT_TEXT.fullmatch(value):
        return f"; YAML reads {value} as text: write it with a dot and a signed exponent, e.g. {float_text(value)}"
    return ""


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
            raise FieldError(where, value, problem)


def check_fields(obj: Any, where: str) -> None:
    """The rules :func:`from_mapping` checks after the types — each field's ``check``, its range, the
    path rules — on the dataclass ``obj`` as built (a config made in Python, not read from a file);
    the first that breaks is a :class:`FieldError` at ``<where>.<field>``. Nested dataclasses are not entered."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), _join(where, f.name)
        if dataclasses.is_dataclass(value):
            continue
        check = f.metadata.get(_CHECK)
        problem = check(value) if check is not None and value is not None else None
        if problem:
            raise FieldError(key, value, problem)
        _check_numbers(value, f.metadata.get(_RANGE), key)
        if isinstance(value, str) and is_path_field(f.name):
            problem = path_problem(value)
            if problem:
                raise FieldError(key, value, problem)


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
    """Check ``value`` against type ``tp`` and convert it (int → float, list → tuple, dict → dataclass);
    a value that does not fit is a :class:`FieldError` at ``where``."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool) != any(isinstance(c, bool) for c in choices if c == value):
            raise _mismatch(where, value, f"valid values: {', '.join(str(c) for c in choices)}",
                            f"got {show(value)}; valid values: {', '.join(repr(c) for c in choices)}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _mismatch(where, value, f"must not be null; expected {_type_name(tp)}", f"must not be null; expected {_type_name(tp)}")
        problems = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except UserError as exc:
                problems.append(exc.problem if isinstance(exc, FieldError) else str(exc))
        expected = " or ".join(problems) + (" or null" if type(None) in args else "")
        raise _mismatch(where, value, expected, f"got {show(value)}; expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise _mismatch(where, value, f"expected a mapping with keys {', '.join(field_types(tp))}")
        return from_mapping(tp, value, where)
    if origin in (list, tuple, typing.Sequence, _abc_sequence()):
        if not isinstance(value, (list, tuple)):
            raise _mismatch(where, value, "expected a list", f"expected a list ({_type_name(tp)}), got {show(value)}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise _mismatch(where, value, f"expected {len(args)} items", f"expected {len(args)} items ({_type_name(tp)}), got {len(value)}")
            pairs = list(zip(value, args))
        else:
            pairs = [(v, args[0] if args else Any) for v in value]
        items = []
        for i, (item, item_tp) in enumerate(pairs):
            try:
                items.append(coerce(item, item_tp, f"{where}[{i}]"))
            except FieldError as exc:  # the item's own line for a run config; the list's, naming the item, for params
                raise FieldError(where, value, f"item {i} ({show(item)}): {exc.problem}", str(exc)) from None
        return tuple(items) if origin is tuple else items
    if origin in (dict, typing.Mapping, _abc_mapping()):
        if not isinstance(value, dict):
            raise _mismatch(where, value, "expected a mapping")
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        return {coerce(k, key_tp, f"{where}"): coerce(v, val_tp, _join(where, show_key(k))) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _mismatch(where, value, "expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _mismatch(where, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = _float_text_hint(value)
            raise _mismatch(where, value, f"expected a number{hint}", f"expected a number, got {show(value)}{hint}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _mismatch(where, value, "expected a string")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _mismatch(where, value, f"expected {_type_name(tp)}", f"got {show(value)}; expected {_type_name(tp)}")


def _abc_sequence() -> Any:
    import collections.abc

    return collections.abc.Sequence


def _abc_mapping() -> Any:
    import collections.abc

    return collections.abc.Mapping


def from_mapping(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from ``data``; every key must be a field, every required field present.

    Per field: its type (:func:`coerce`), then its ``check``, its range and, for a path field, the path
    rules, each on the value as given; a value that breaks one is a :class:`FieldError`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _mismatch(where, data, "expected a mapping")
    types_by_name = field_types(cls)
    unknown = [k for k in data if k not in types_by_name]
    if unknown:
        raise FieldError(_join(where, show_key(unknown[0])), NO_VALUE, unknown_key_message(unknown[0], types_by_name))
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = _join(where, f.name)
        if f.name in data:
            given = data[f.name]
            kwargs[f.name] = coerce(given, types_by_name[f.name], key)
            if dataclasses.is_dataclass(kwargs[f.name]):
                continue
            check = f.metadata.get(_CHECK)
            problem = check(given) if check is not None and given is not None else None
            if problem:
                raise FieldError(key, given, problem)
            _check_numbers(kwargs[f.name] if isinstance(given, (list, tuple, dict)) else given, f.metadata.get(_RANGE), key)
            if isinstance(given, str) and is_path_field(f.name):
                problem = path_problem(given)
                if problem:
                    raise FieldError(key, given, problem)
        elif f.default is _MISSING and f.default_factory is _MISSING:  # type: ignore[misc]
            raise FieldError(key, NO_VALUE, f"required key is missing ({_type_name(types_by_name[f.name])})")
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
