"""A params file read as DVC reads it, or refused: the stages never see a value ``dvc.lock`` does not.

DVC reads ``params.yaml`` with ruamel.yaml, YAML 1.2, and records those values in ``dvc.lock``; the
stages, their lineage and the MLflow parent run read it with PyYAML, YAML 1.1. The scalars the two
read differently are listed in :mod:`distillery.config.yaml_versions` (``tests/reliability/test_yaml_trust.py``
checks each against DVC's own parser).

:func:`read_params_file` parses the file within the bounds of :mod:`distillery.config.limits` (alias
bombs, merge chains, depth, size: refused before either parser builds anything), then reads each
scalar as both versions would and refuses the file in one line at the first key (or key name)
whose two readings differ, saying how to write it so both agree. A last comparison of the whole
document as DVC's parser loads it catches anything else (a syntax one of them does not take, two
merge keys), so a params file the stages accept holds exactly the values DVC records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from distillery.common.errors import UserError
from distillery.config.limits import cut, parse_yaml_text, read_text_file, show, show_key
from distillery.config.yaml_versions import YAML_11, YAML_12, Scalar, collector, describe, disagreement_line, disagreements, dvc_load, same

_LOADER: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_params_file(path: str | Path, source: str, missing: str) -> Any:
    """The parsed params file ``path`` (None when empty), read as DVC reads it; messages start with ``source``.

    ``missing`` is the text after ``source`` when ``path`` is not a readable regular file.
    """
    return parse_params_text(read_text_file(path, source, missing), source)


def parse_params_text(text: str, source: str) -> Any:
    """Parse params ``text`` within the input bounds and check that DVC reads every value alike (module doc)."""
    scalars: list[Scalar] = []
    data = parse_yaml_text(text, source, on_scalar=collector(scalars))
    _refuse_directives(text, source)
    found = disagreements(scalars)
    if found:
        raise UserError(disagreement_line(*found[0], source))
    _check_whole(text, data, source)
    return data


def _refuse_directives(text: str, source: str) -> None:
    """A ``%YAML``/``%TAG`` directive changes how one parser reads the file and not the other: refused."""
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.DocumentStartEvent):
            if event.version or event.tags:
                raise UserError(f"{source} (line {event.start_mark.line + 1}): a %YAML or %TAG directive; "
                                "remove it (DVC reads params files as YAML 1.2, the stages as YAML 1.1)")
            return


def _check_whole(text: str, ours: Any, source: str) -> None:
    """The whole document as DVC's parser loads it must equal what the stages read."""
    try:
        theirs = dvc_load(text)
    except Exception as exc:  # noqa: BLE001 - DVC's parser refuses the file: so do we
        problem = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(cut(f"{source}{where}: DVC's YAML 1.2 parser cannot read this file: {problem}; "
                            "write it so that both DVC and the stages read it")) from None
    found = first_difference(ours, theirs, "")
    if found is not None:
        where, a, b = found
        raise UserError(cut(f"{source}: {where or 'the top level'}: {YAML_12} reads {b}, {YAML_11} {a}; "
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
    return None if same(ours, theirs) else (where, describe(ours), describe(theirs))
