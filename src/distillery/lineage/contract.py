"""The names every lineage module shares: the manifest's file name, its seal's key, and how much of a user
value a message echoes (:func:`distillery.config.limits.cut` at that length). The lowest module of
:mod:`distillery.lineage`: it imports none of the others.
"""

from __future__ import annotations

import functools

from distillery.config.limits import cut

LINEAGE_FILE = "lineage.json"


DIGEST_KEY = "manifest_sha256"  # the manifest's seal: manifest_digest() of every other key


SHOWN = 120  # characters of a user value a lineage message echoes
cut = functools.partial(cut, limit=SHOWN)  # the one cut (distillery.config.limits), at the lineage messages' length
