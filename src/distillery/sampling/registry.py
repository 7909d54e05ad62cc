"""The sampler registry: a sampler name in an artifact's ``sampling.json`` → the class that samples it.

Register a sampler with one decorator line::

    @register_sampler("causal_streaming")
    class CausalStreamingSampler(Sampler): ...

and build one from a contract (``sampling.json`` content) with :func:`build_sampler`. The built-in
samplers register when :mod:`distillery.sampling` is imported (importing this module imports the
package first).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from distillery.common.errors import UserError
from distillery.sampling.base import Sampler

_REGISTRY: dict[str, type[Sampler]] = {}
S = TypeVar("S", bound=type[Sampler])


def register_sampler(name: str) -> Callable[[S], S]:
    """Class decorator: register a :class:`Sampler` subclass under ``name`` (sets ``cls.name``)."""

    def decorate(cls: S) -> S:
        if not (isinstance(cls, type) and issubclass(cls, Sampler)):
            raise TypeError(f"{cls!r} is not a Sampler subclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"sampler {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def sampler_names() -> list[str]:
    """Names of every registered sampler, sorted."""
    return sorted(_REGISTRY)


def sampler_class(name: str) -> type[Sampler]:
    """The class registered as ``name``; :class:`UserError` naming the valid ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UserError(f"unknown sampler {name!r}; valid: {', '.join(sampler_names())}") from None


def build_sampler(contract: Mapping[str, Any]) -> Sampler:
    """A sampler configured by ``contract`` (``sampling.json`` content; ``"sampler"`` names it)."""
    if not isinstance(contract, Mapping) or "sampler" not in contract:
        raise UserError(f"sampling contract {dict(contract) if isinstance(contract, Mapping) else contract!r} has no "
                        f"'sampler' key; valid samplers: {', '.join(sampler_names())}")
    return sampler_class(contract["sampler"])(contract)
