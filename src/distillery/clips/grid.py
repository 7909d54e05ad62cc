"""Video mosaics: many videos of one size tiled into one, for validation grids.

A grid is ``uint8 [T, R·H + R − 1, C·W + C − 1, 3]`` (rows × columns of ``H × W`` tiles separated by
1-px lines of :data:`SEPARATOR_RGB`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SEPARATOR_RGB = (96, 96, 96)  # colour of the 1-px lines between grid tiles


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


def write_gif(path: Path, pixels: np.ndarray, fps: float) -> Path:
    """Write ``uint8 [T, H, W, 3]`` as a looping GIF at ``fps`` frames per second."""
    import imageio.v3 as iio

    iio.imwrite(path, pixels, extension=".gif", duration=1000.0 / fps, loop=0)
    return Path(path)
