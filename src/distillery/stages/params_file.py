"""A params file read as DVC reads it, or refused: the stages never see a value ``dvc.lock`` does not.

DVC reads ``params.yaml`` with ruamel.yaml, YAML 1.2 (``dvc.utils.serialize.parse_yaml``:
``YAML(typ="safe").load``), and records those values in ``dvc.lock``; the stages, their lineage and
the MLflow parent run read it with PyYAML, YAML 1.1. The two read some plain scalars differently
(DVC's reading first, YAML 1.1's in brackets; ``tests/reliability/test_yaml_trust.py`` checks each
against DVC's own parser):

- octal-looking integers: ``010``, ``+010``, ``0_10`` → 10 (8); ``0o10`` → 8 (the text); ``08`` → 8 (the text);
- base 60: ``1:00``, ``-1:30``, ``1:00.5`` → the text (60, -90, 60.5);
- ``yes``, ``no``, ``on``, ``off`` in any case → the text (true, false);
- exponents without a dot: ``1e-4``, ``1E4``, ``1.e-4``, ``12e-05`` → floats (the text).

:func:`read_params_file` parses the file within the bounds of :mod:`distillery.config.limits` (alias
bombs, merge chains, depth, size: refused before either parser builds anything), then reads each
scalar as both versions would and refuses the file in one line at the first key (or key name)
whose two readings differ, saying how to write it so both agree. A last comparison of the whole
document as DVC's parser loads it catches anything else (a syntax one of them does not take, two
merge keys), so a params file the stages accept holds exactly the values DVC records.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from distillery.common.errors import UserError
from distillery.config.limits import cut, parse_yaml_text, read_text_file, show, show_key

_LOADER: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STR_TAG = "tag:yaml.org,2002:str"
_STAGES = "the stages (YAML 1.1)"
_DVC = "DVC (YAML 1.2)"


@dataclass(frozen=True)
class _Scalar:
    """One scalar of the file whose two readings may differ."""

    path: str  # dotted path of the value (of the value it names, for a key)
    line: int
    text: str  # as written (the scalar's value before any resolution)
    is_key: bool
    item: str  # the scalar as one item of a YAML list, resolved and constructed as in place


def read_params_file(path: str | Path, source: str, missing: str) -> Any:
    """The parsed params file ``path`` (None when empty), read as DVC reads it; messages start with ``source``.

    ``missing`` is the text after ``source`` when ``path`` is not a readable regular file.
    """
    return parse_params_text(read_text_file(path, source, missing), source)


def parse_params_text(text: str, source: str) -> Any:
    """Parse params ``text`` within the input bounds and check that DVC reads every value alike (module doc)."""
    scalars: list[_Scalar] = []

    def collect(where: str, event: yaml.ScalarEvent, is_key: bool) -> None:
        item = _as_item(event)
        if item is not None:
            scalars.append(_Scalar(where, event.start_mark.line + 1, event.value, is_key, item))

    data = parse_yaml_text(text, source, on_scalar=collect)
    _refuse_directives(text, source)
    _check_scalars(scalars, source)
    _check_whole(text, data, source)
    return data


def _as_item(event: yaml.ScalarEvent) -> str | None:
    """``event`` as a list item that both parsers read as they read it in place; None when both read it as
    the same text (a quoted or block scalar without a tag, a ``!!str``, a multi-line plain scalar)."""
    if event.tag in (None, "!"):
        if event.tag == "!" or not event.implicit[0] or event.style or "\n" in event.value:  # style: "" or None when plain
            return None
        if event.value in ("<<", "="):  # a merge key (checked by the whole-document comparison); "=" never loads
            return None
        return event.value
    if event.tag == _STR_TAG:
        return None
    return f"!<{event.tag}> {json.dumps(event.value)}"  # a JSON string is a YAML double-quoted scalar


def _dvc_load(text: str) -> Any:
    """``text`` loaded exactly as DVC loads a params file (``dvc.utils.serialize.parse_yaml``)."""
    from ruamel.yaml import YAML

    return YAML(typ="safe").load(text)


def _refuse_directives(text: str, source: str) -> None:
    """A ``%YAML``/``%TAG`` directive changes how one parser reads the file and not the other: refused."""
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.DocumentStartEvent):
            if event.version or event.tags:
                raise UserError(f"{source} (line {event.start_mark.line + 1}): a %YAML or %TAG directive; "
                                "remove it (DVC reads params files as YAML 1.2, the stages as YAML 1.1)")
            return


def _check_scalars(scalars: list[_Scalar], source: str) -> None:
    """Refuse the first scalar that the two YAML versions read as different values."""
    if not scalars:
        return
    ours, theirs = _both(scalars)
    for scalar, a, b in zip(scalars, ours, theirs):
        if not same(a, b):
            raise UserError(_disagreement(scalar, a, b, source))


_FAILED = object()  # a reading that raised


def _both(scalars: list[_Scalar]) -> tuple[list[Any], list[Any]]:
    """Every scalar as PyYAML (YAML 1.1) and as DVC's parser (YAML 1.2) reads it: one list document each;
    when one of them cannot read that document, item by item (an item it cannot read is :data:`_FAILED`)."""
    doc = "".join(f"- {s.item}\n" for s in scalars)
    try:
        return yaml.load(doc, Loader=_LOADER), _dvc_load(doc)  # noqa: S506 - a safe loader
    except Exception:  # noqa: BLE001 - found item by item below
        pass
    ours, theirs = [], []
    for s in scalars:
        for reader, out in ((lambda d: yaml.load(d, Loader=_LOADER), ours), (_dvc_load, theirs)):  # noqa: S506
            try:
                out.append(reader(f"- {s.item}\n")[0])
            except Exception:  # noqa: BLE001 - a reading that fails is a disagreement
                out.append(_FAILED)
    return ours, theirs


def same(a: Any, b: Any) -> bool:
    """Whether two readings are the same value of the same kind (NaN is NaN; a date is a date)."""
    if isinstance(a, datetime.date) and isinstance(b, datetime.date):
        return isinstance(a, datetime.datetime) == isinstance(b, datetime.datetime) and a == b
    if type(a) is not type(b) or a is _FAILED or b is _FAILED:
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _describe(value: Any) -> str:
    if value is _FAILED:
        return "an error"
    if isinstance(value, str):
        return f"the text {show(value)}"
    return show(value)


def float_text(text: str) -> str:
    """``1e-4`` written so YAML 1.1 and 1.2 both read a float: a dot in the mantissa, a signed exponent (``1.0e-4``)."""
    mantissa, _, exponent = text.lower().replace("_", "").partition("e")
    if mantissa.rstrip("0123456789").endswith("."):
        mantissa += "0"
    if "." not in mantissa:
        mantissa += ".0"
    if exponent and exponent[0] not in "+-":
        exponent = "+" + exponent
    return f"{mantissa}e{exponent}" if exponent else mantissa


def _fix(scalar: _Scalar, ours: Any, theirs: Any) -> str:
    """How to write ``scalar`` so that both versions read what the user most likely meant."""
    quoted = json.dumps(scalar.text) if "'" in scalar.text else f"'{scalar.text}'"
    if isinstance(theirs, float) and not isinstance(ours, (int, float)):
        return f"write {float_text(scalar.text)}"
    if isinstance(theirs, int) and not isinstance(theirs, bool):
        other = f", or {ours} if you meant octal" if isinstance(ours, int) and not isinstance(ours, bool) else f", or quote it ({quoted}) for the text"
        return f"write {theirs}{other}"
    if isinstance(theirs, str):
        if isinstance(ours, bool):
            return f"write {'true' if ours else 'false'}, or quote it ({quoted}) for the text"
        if isinstance(ours, (int, float)):
            return f"write {ours} for the number, or quote it ({quoted}) for the text"
        return f"quote it ({quoted}) for the text"
    return f"quote it ({quoted}), or write it so that both read one value"


def _disagreement(scalar: _Scalar, ours: Any, theirs: Any, source: str) -> str:
    """The one line for a scalar the two versions read differently."""
    if scalar.is_key:
        section = scalar.path.rpartition(".")[0]
        where = f"{section + ': ' if section else ''}the key {show(scalar.text)}"
    else:
        where = f"{scalar.path}: {show(scalar.text)}"
    return cut(f"{source}: {where} (line {scalar.line}): {_DVC} reads it as {_describe(theirs)}, {_STAGES} as "
               f"{_describe(ours)}; {_fix(scalar, ours, theirs)}")


def _check_whole(text: str, ours: Any, source: str) -> None:
    """The whole document as DVC's parser loads it must equal what the stages read."""
    try:
        theirs = _dvc_load(text)
    except Exception as exc:  # noqa: BLE001 - DVC's parser refuses the file: so do we
        problem = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(cut(f"{source}{where}: DVC's YAML 1.2 parser cannot read this file: {problem}; "
                            "write it so that both DVC and the stages read it")) from None
    found = first_difference(ours, theirs, "")
    if found is not None:
        where, a, b = found
        raise UserError(cut(f"{source}: {where or 'the top level'}: {_DVC} reads {b}, {_STAGES} {a}; "
                            "write it so that both read one value"))


def first_difference(ours: Any, theirs: Any, where: str) -> tuple[str, str, str] | None:
    """``(dotted path, what we read there, what they read)`` at the first place two loaded documents
    differ (a value, a list's length, a mapping's keys), or None when they are the same."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        mine, other = {(type(k), k) for k in ours}, {(type(k), k) for k in theirs}
        if mine != other:
            def keys(found: set) -> str:
                return "the keys " + ", ".join(sorted(show(k) for _, k in found)) if found else "no other key"
            return where, keys(mine - other), keys(other - mine)
        for key in ours:
            found = first_difference(ours[key], theirs[key], f"{where}.{show_key(key)}" if where else show_key(key))
            if found is not None:
                return found
        return None
    if isinstance(ours, list) and isinstance(theirs, list):
        if len(ours) != len(theirs):
            return where, f"{len(ours)} items", f"{len(theirs)} items"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            found = first_difference(a, b, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    return None if same(ours, theirs) else (where, _describe(ours), _describe(theirs))
