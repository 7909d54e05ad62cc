"""Resolution of ``_target_`` strings to callables, restricted to allowed module prefixes.

Configs are shared files, so a config can never widen what it may instantiate: the allowed
prefixes are ``distillery.`` plus those the user grants on the command line
(``--allow-target-prefix``) or in the environment (``DISTILLERY_ALLOWED_TARGET_PREFIXES``,
comma separated). Both the dotted path and the resolved object's own ``__module__`` must lie
under an allowed prefix, so ``distillery.some_module.os.system`` is refused.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from typing import Any

from distillery.common.errors import UserError

DEFAULT_PREFIXES = ("distillery.",)
ENV_PREFIXES = "DISTILLERY_ALLOWED_TARGET_PREFIXES"


def allowed_prefixes(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """Default prefixes, plus those from the environment, plus ``extra`` (from the command line)."""
    env = [p.strip() for p in os.environ.get(ENV_PREFIXES, "").split(",") if p.strip()]
    out: list[str] = []
    for prefix in (*DEFAULT_PREFIXES, *env, *extra):
        norm = prefix if prefix.endswith(".") else prefix + "."
        if norm not in out:
            out.append(norm)
    return tuple(out)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any((name + ".").startswith(p) for p in prefixes)


def resolve_target(target: str, where: str, prefixes: tuple[str, ...]) -> Any:
    """Import ``target`` ("pkg.module.Name") and return the object, or raise a one-line UserError."""
    if not isinstance(target, str) or "." not in target:
        raise UserError(f"config error: {where}._target_: expected a dotted path like distillery.models.wan.WanModel, got {target!r}")
    if not _under(target, prefixes):
        raise UserError(
            f"config error: {where}._target_: {target} is outside the allowed prefixes ({', '.join(prefixes)}); "
            f"grant a prefix with --allow-target-prefix or {ENV_PREFIXES}"
        )
    parts = target.split(".")
    module = None
    for cut in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name and not ".".join(parts[:cut]).startswith(exc.name):
                raise  # a real missing dependency inside the module, not a bad path
            continue
        attrs = parts[cut:]
        break
    if module is None:
        raise UserError(f"config error: {where}._target_: no module found for {target}")
    obj: Any = module
    for attr in attrs:
        if not hasattr(obj, attr):
            raise UserError(f"config error: {where}._target_: {target} does not exist ({module.__name__} has no {'.'.join(attrs)})")
        obj = getattr(obj, attr)
    owner = getattr(obj, "__module__", None)
    if not isinstance(owner, str) or not _under(owner, prefixes):
        raise UserError(
            f"config error: {where}._target_: {target} is defined in {owner or 'an unknown module'}, outside the allowed prefixes "
            f"({', '.join(prefixes)})"
        )
    if not callable(obj):
        raise UserError(f"config error: {where}._target_: {target} is not callable")
    return obj
