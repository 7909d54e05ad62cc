"""Video mosaics: many videos of one size tiled into one, for validation grids (the training callback's and the validate stage's).

A grid is ``uint8 [T, R·H + R − 1, C·W + C − 1, 3]`` (rows × columns of ``H × W`` tiles separated by
1-px lines of :data:`SEPARATOR_RGB`). :meth:`VideoGrid.labelled` frames it with readable labels: a
header row (column labels), a label column (row labels) and legend lines below, drawn once with
Pillow's bundled font on a :data:`LABEL_BACKGROUND_RGB` panel; the tiles keep their pixels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SEPARATOR_RGB = (96, 96, 96)  # colour of the 1-px lines between grid tiles
LABEL_BACKGROUND_RGB = (24, 24, 24)  # the label panel around a labelled grid
LABEL_RGB = (235, 235, 235)  # label text
LABEL_FONT_PX = 10


class VideoGrid:
    """Mosaic of ``rows × cols`` videos ``uint8 [T, H, W, 3]``; ``pixels`` is the whole grid."""

    def __init__(self, rows: int, cols: int, frames: int, height: int, width: int) -> None:
        self.h, self.w = height, width
        self.pixels = np.empty((frames, rows * (height + 1) - 1, cols * (width + 1) - 1, 3), dtype=np.uint8)
        self.pixels[...] = np.asarray(SEPARATOR_RGB, dtype=np.uint8)

    def put(self, row: int, col: int, video: np.ndarray) -> None:
        """Place one video ``uint8 [T, H, W, 3]`` at (row, col)."""
        y, x = row * (self.h + 1), col * (self.w + 1)
        self.pixels[:, y: y + self.h, x: x + self.w] = video

    def labelled(self, row_labels: list[str], col_labels: list[str], legend: list[str] = ()) -> tuple[np.ndarray, tuple[int, int]]:
        """The grid inside a label panel → (``uint8 [T, H', W', 3]``, ``(top, left)``: where the grid's
        pixel (0, 0) lands). Row label r is left of row r, column label c above column c (centred),
        the ``legend`` lines under the grid."""
        from PIL import Image, ImageDraw, ImageFont

        frames, height, width, _ = self.pixels.shape
        font = ImageFont.load_default(size=LABEL_FONT_PX)
        probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))

        def text_w(text: str) -> int:
            return int(probe.textbbox((0, 0), text, font=font)[2]) if text else 0

        line = LABEL_FONT_PX + 4
        left = max((text_w(t) for t in row_labels), default=0) + 8
        top = line + 2
        panel_w = max(left + width, max((text_w(t) for t in legend), default=0) + 8)
        panel_h = top + height + (len(legend) * line + 4 if legend else 0)
        canvas = Image.new("RGB", (panel_w, panel_h), LABEL_BACKGROUND_RGB)
        draw = ImageDraw.Draw(canvas)
        for r, text in enumerate(row_labels):
            draw.text((4, top + r * (self.h + 1) + max(0, (self.h - line) // 2)), text, fill=LABEL_RGB, font=font)
        for c, text in enumerate(col_labels):
            x = left + c * (self.w + 1) + max(0, (self.w - text_w(text)) // 2)
            draw.text((x, 1), text, fill=LABEL_RGB, font=font)
        for i, text in enumerate(legend):
            draw.text((4, top + height + 2 + i * line), text, fill=LABEL_RGB, font=font)
        out = np.repeat(np.asarray(canvas, dtype=np.uint8)[None], frames, axis=0)
        out[:, top: top + height, left: left + width] = self.pixels
        return out, (top, left)


def write_gif(path: Path, pixels: np.ndarray, fps: float) -> Path:
    """Write ``uint8 [T, H, W, 3]`` as a looping GIF at ``fps`` frames per second."""
    import imageio.v3 as iio

    iio.imwrite(path, pixels, extension=".gif", duration=1000.0 / fps, loop=0)
    return Path(path)
