"""Small helpers on nested mappings (configs, manifests, metrics files): the one implementation.

:func:`flatten` turns ``{"a": {"b": 1}}`` into ``{"a.b": 1}``. Users: lineage's summary lines,
the Prefect metrics tables (with ``lists=True``) and MLflow params (:mod:`distillery.components.tracking`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def flatten(tree: Any, prefix: str = "", *, lists: bool = False, sep: str = ".") -> dict[str, Any]:
    """Nested mappings (and lists, when ``lists``: keys ``0``, ``1``, ...) → one flat mapping.

    Contract: keys are the path joined with ``sep`` (``prefix`` first when given); insertion order
    follows the tree; an empty mapping or list is kept as a leaf value; a leaf is returned as it is
    (not copied). ``tree`` itself being a leaf gives ``{prefix: tree}`` when ``prefix`` is given,
    else ``{}`` (a leaf has no key).
    """
    out: dict[str, Any] = {}
    _flatten_into(out, tree, prefix, lists, sep)
    return out


def _is_branch(node: Any, lists: bool) -> bool:
    return isinstance(node, Mapping) or (lists and isinstance(node, list))


def _flatten_into(out: dict[str, Any], node: Any, key: str, lists: bool, sep: str) -> None:
    if not _is_branch(node, lists) or (not node and key):
        if key:
            out[key] = node
        return
    items: Iterable[tuple[Any, Any]] = node.items() if isinstance(node, Mapping) else enumerate(node)
    for k, v in items:
        _flatten_into(out, v, f"{key}{sep}{k}" if key else str(k), lists, sep)
