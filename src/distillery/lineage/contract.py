"""The names every lineage module shares: the manifest's file name, its seal's key, and how much of a user
value a message echoes. The lowest module of :mod:`distillery.lineage`: it imports none of the others.

Stdlib only.
"""

from __future__ import annotations

from typing import Any

LINEAGE_FILE = "lineage.json"


DIGEST_KEY = "manifest_sha256"  # the manifest's seal: manifest_digest() of every other key


_SHOWN = 120  # characters of a user value echoed in a message


def cut(value: Any, limit: int = _SHOWN) -> str:
    """``value`` as text, cut to ``limit`` characters for a readable message."""
    s = str(value)
    return s if len(s) <= limit else s[: limit - 1] + "…"
