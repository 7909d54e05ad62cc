"""The caption grammar of the synthetic clip set.

Every synthetic clip shows one flat-coloured shape moving in a straight line at constant speed
over a flat background, and its caption says exactly that::

    a <colour> <shape> moving <direction> [slowly|quickly] on a <background> background

- ``<colour>``: red, green, blue, yellow, cyan, magenta — six hues 60° apart, each drawn with the
  fixed RGB in :data:`COLOURS`.
- ``<shape>``: circle, square, triangle (all fit the same ``2r × 2r`` box; the triangle points up).
- ``<direction>``: left, right, up, down (image directions; "up" is towards row 0).
- speed (optional word): ``slowly`` ≈ 0.6 px/frame and ``quickly`` ≈ 1.2 px/frame on a 32-px frame,
  scaled with the frame size; a caption without a speed word moves at ≈ 0.9 px/frame.
- ``<background>``: black, white, gray (flat RGB in :data:`BACKGROUNDS`).

Examples: ``a red circle moving left on a black background``,
``a cyan triangle moving up quickly on a gray background``.

:func:`parse_caption` accepts any letter case, any run of whitespace between words and one
trailing full stop; it returns ``None`` for text outside the grammar.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from distillery.common.errors import UserError

RGB = tuple[int, int, int]

COLOURS: dict[str, RGB] = {
    "red": (230, 25, 25),
    "green": (25, 230, 25),
    "blue": (25, 25, 230),
    "yellow": (230, 230, 25),
    "cyan": (25, 230, 230),
    "magenta": (230, 25, 230),
}
"""Shape colour name → the RGB it is drawn with (uint8 levels)."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
"""Shape names; every shape fits a ``2r × 2r`` box (circle of radius r, square of side 2r,
upward isosceles triangle of base 2r and height 2r)."""

DIRECTIONS: dict[str, tuple[int, int]] = {
    "left": (-1, 0),
    "right": (1, 0),
    "up": (0, -1),
    "down": (0, 1),
}
"""Direction name → unit step ``(dx, dy)`` in image coordinates (x to the right, y downwards)."""

SPEEDS: dict[str, float] = {
    "slowly": 0.6,
    "quickly": 1.2,
}
"""Speed word → nominal speed in pixels per frame on a 32-pixel frame (scaled with frame size)."""

UNSPECIFIED_SPEED = 0.9
"""Nominal speed (px/frame on a 32-pixel frame) of a clip whose caption has no speed word."""

BACKGROUNDS: dict[str, RGB] = {
    "black": (0, 0, 0),
    "white": (255, 255, 255),
    "gray": (128, 128, 128),
}
"""Background name → its flat RGB (uint8 levels)."""

_CAPTION_RE = re.compile(
    r"a\s+(?P<colour>[a-z]+)\s+(?P<shape>[a-z]+)\s+moving\s+(?P<direction>[a-z]+)"
    r"(?:\s+(?P<speed>[a-z]+))?\s+on\s+a\s+(?P<background>[a-z]+)\s+background\.?"
)


@dataclass(frozen=True)
class ClipAttributes:
    """What a caption says about its clip; every field is a word of the grammar."""

    colour: str  # key of COLOURS
    shape: str  # one of SHAPES
    direction: str  # key of DIRECTIONS
    speed: str | None  # key of SPEEDS, or None when the caption has no speed word
    background: str  # key of BACKGROUNDS

    def __post_init__(self) -> None:
        check_vocabulary("colour", [self.colour], COLOURS)
        check_vocabulary("shape", [self.shape], SHAPES)
        check_vocabulary("direction", [self.direction], DIRECTIONS)
        if self.speed is not None:
            check_vocabulary("speed", [self.speed], SPEEDS)
        check_vocabulary("background", [self.background], BACKGROUNDS)


def check_vocabulary(kind: str, words: Iterable[str], allowed: Iterable[str]) -> None:
    """Raise :class:`UserError` unless every word is in ``allowed`` (e.g. a vocabulary dict or tuple)."""
    allowed_words = list(allowed)
    for word in words:
        if word not in allowed_words:
            raise UserError(f"unknown {kind} {word!r}; the caption grammar knows {', '.join(allowed_words)}")


def format_caption(attrs: ClipAttributes) -> str:
    """The caption of ``attrs``, lower case, single spaces, no trailing full stop."""
    speed = f" {attrs.speed}" if attrs.speed else ""
    return f"a {attrs.colour} {attrs.shape} moving {attrs.direction}{speed} on a {attrs.background} background"


def parse_caption(text: str) -> ClipAttributes | None:
    """The attributes a caption states, or ``None`` when it does not follow the grammar.

    Tolerates letter case, extra whitespace and one trailing full stop; every word must be in the
    grammar's vocabulary (no synonyms).
    """
    if not isinstance(text, str):
        return None
    match = _CAPTION_RE.fullmatch(text.strip().lower())
    if match is None:
        return None
    g = match.groupdict()
    if (
        g["colour"] not in COLOURS
        or g["shape"] not in SHAPES
        or g["direction"] not in DIRECTIONS
        or (g["speed"] is not None and g["speed"] not in SPEEDS)
        or g["background"] not in BACKGROUNDS
    ):
        return None
    return ClipAttributes(g["colour"], g["shape"], g["direction"], g["speed"], g["background"])
