"""One scalar as YAML 1.1 and YAML 1.2 read it: where the two disagree, and how to write it so they agree.

DVC reads ``params.yaml`` with ruamel.yaml, YAML 1.2 (``dvc.utils.serialize.parse_yaml``:
``YAML(typ="safe").load``); PyYAML (the stages, run-config files) reads YAML 1.1. The two read some
plain scalars differently (1.2's reading first, 1.1's in brackets):

- octal-looking integers: ``010``, ``+010``, ``0_10`` → 10 (8); ``0o10`` → 8 (the text); ``08`` → 8 (the text);
- base 60: ``1:00``, ``-1:30``, ``1:00.5`` → the text (60, -90, 60.5);
- ``yes``, ``no``, ``on``, ``off`` in any case → the text (true, false);
- exponents without a dot: ``1e-4``, ``1E4``, ``12e-05`` → floats (the text) — here read as floats by the stages
  too (:class:`distillery.config.limits.SafeLoader`), since DVC writes small floats back that way.

:func:`collector` gathers a document's scalars while :func:`distillery.config.limits.parse_yaml_text`
checks it; :func:`disagreements` reads them all both ways. :mod:`distillery.pipeline.params.file` refuses a params
file at the first disagreement; a dotted command-line override (:func:`distillery.config.loader.parse_override_value`)
takes 1.2's float for an exponent without a dot and refuses the rest. Each refusal is one line saying how
to write the value so that both read it alike (:func:`disagreement_line`).
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from distillery.config.limits import SafeLoader, cut, show

_LOADER: type = SafeLoader  # the stages' reader (YAML 1.1, exponents without a dot read as 1.2 reads them)
_STR_TAG = "tag:yaml.org,2002:str"
YAML_11 = "the stages (YAML 1.1)"
YAML_12 = "DVC (YAML 1.2)"
FAILED = object()  # a reading that raised


@dataclass(frozen=True)
class Scalar:
    """One scalar of a document whose two readings may differ."""

    path: str  # dotted path of the value (of the value it names, for a key)
    line: int
    text: str  # as written (the scalar's value before any resolution)
    is_key: bool
    item: str  # the scalar as one item of a YAML list, resolved and constructed as in place


def collector(into: list[Scalar]) -> Callable[[str, yaml.ScalarEvent, bool], None]:
    """An ``on_scalar`` hook for :func:`~distillery.config.limits.parse_yaml_text` that appends to ``into``
    every scalar the two versions might read differently."""

    def collect(where: str, event: yaml.ScalarEvent, is_key: bool) -> None:
        item = _as_item(event)
        if item is not None:
            into.append(Scalar(where, event.start_mark.line + 1, event.value, is_key, item))

    return collect


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


def dvc_load(text: str) -> Any:
    """``text`` loaded exactly as DVC loads a params file (``dvc.utils.serialize.parse_yaml``)."""
    from ruamel.yaml import YAML

    return YAML(typ="safe").load(text)


def disagreements(scalars: list[Scalar]) -> list[tuple[Scalar, Any, Any]]:
    """``(scalar, YAML 1.1 reading, YAML 1.2 reading)`` of every scalar the two read as different values."""
    if not scalars:
        return []
    ours, theirs = _both(scalars)
    return [(s, a, b) for s, a, b in zip(scalars, ours, theirs) if not same(a, b)]


def _both(scalars: list[Scalar]) -> tuple[list[Any], list[Any]]:
    """Every scalar as PyYAML (YAML 1.1) and as DVC's parser (YAML 1.2) reads it: one list document each;
    when one of them cannot read that document, item by item (an item it cannot read is :data:`FAILED`)."""
    doc = "".join(f"- {s.item}\n" for s in scalars)
    try:
        return yaml.load(doc, Loader=_LOADER), dvc_load(doc)  # noqa: S506 - a safe loader
    except Exception:  # noqa: BLE001 - found item by item below
        pass
    ours, theirs = [], []
    for s in scalars:
        for reader, out in ((lambda d: yaml.load(d, Loader=_LOADER), ours), (dvc_load, theirs)):  # noqa: S506
            try:
                out.append(reader(f"- {s.item}\n")[0])
            except Exception:  # noqa: BLE001 - a reading that fails is a disagreement
                out.append(FAILED)
    return ours, theirs


def same(a: Any, b: Any) -> bool:
    """Whether two readings are the same value of the same kind (NaN is NaN; a date is a date)."""
    if isinstance(a, datetime.date) and isinstance(b, datetime.date):
        return isinstance(a, datetime.datetime) == isinstance(b, datetime.datetime) and a == b
    if type(a) is not type(b) or a is FAILED or b is FAILED:
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def is_dotless_float(ours: Any, theirs: Any) -> bool:
    """YAML 1.2 reads a float where YAML 1.1 reads the text (``1e-4``: an exponent without a dot)."""
    return isinstance(theirs, float) and isinstance(ours, str)


def describe(value: Any) -> str:
    if value is FAILED:
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


def _fix(scalar: Scalar, ours: Any, theirs: Any) -> str:
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


def disagreement_line(scalar: Scalar, ours: Any, theirs: Any, source: str, *, line: bool = True,
                      readers: tuple[str, str] = (YAML_12, YAML_11)) -> str:
    """The one line for a scalar the two versions read differently (``line``: name its line in the file;
    ``readers``: what reads it as YAML 1.2 and as YAML 1.1, as the line names them)."""
    if scalar.is_key:
        section = scalar.path.rpartition(".")[0]
        where = f"{section + ': ' if section else ''}the key {show(scalar.text)}"
    else:
        where = f"{scalar.path + ': ' if scalar.path else ''}{show(scalar.text)}"
    at = f" (line {scalar.line})" if line else ""
    return cut(f"{source}: {where}{at}: {readers[0]} reads it as {describe(theirs)}, {readers[1]} as "
               f"{describe(ours)}; {_fix(scalar, ours, theirs)}")
