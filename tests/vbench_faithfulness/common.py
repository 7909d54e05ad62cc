"""What both sides of the VBench faithfulness comparison build from the same recipe, with numpy and torch only (the
reference side runs in a venv of vbench 0.1.5's pins, without distillery): the test clips, the prompts, the random
weights (a tensor's values from its name's position in the sorted key list and the seed, through numpy's stable
``default_rng``, scaled like an initialisation so activations stay informative) and a small BPE vocabulary.

``make_reference.py`` (run in that venv) records vbench's own numbers into ``reference.json`` together with the
key → shape lists it filled; ``tests/test_vbench_faithfulness.py`` refills the same tensors from those lists, loads
them into our models and compares.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np

SEED = 20240101
FPS = 16.0
HEIGHT, WIDTH, FRAMES = 128, 160, 9
PROMPTS = ("a red square moving to the right", "a quiet room with a lamp", "a car driving on a road at night")
HERE = Path(__file__).resolve().parent
STUDENT_SAMPLE = HERE / "student_sample.npz"  # a decoded sample of the tiny student (frames uint8 [T, H, W, 3])


def clip_moving_square(seed: int = SEED) -> np.ndarray:
    """A textured background with a bright square moving right and down, light sensor noise: ``uint8 [9, 128, 160, 3]``."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH]
    base = np.stack([40 + 80 * xx / WIDTH, 60 + 60 * yy / HEIGHT, 90 + 30 * np.sin(xx / 5.0)], axis=-1)
    frames = []
    for t in range(FRAMES):
        f = base + rng.normal(0, 2.0, base.shape)
        top, left = 10 + t, 5 + 4 * t
        f[top:top + 16, left:left + 16] = (230, 40, 40)
        frames.append(f)
    return np.clip(np.stack(frames), 0, 255).round().astype(np.uint8)


def clip_static_flicker(seed: int = SEED + 1) -> np.ndarray:
    """A still scene whose brightness flickers a few grey levels frame to frame: ``uint8 [9, 128, 160, 3]``."""
    rng = np.random.default_rng(seed)
    scene = rng.integers(30, 220, size=(HEIGHT // 8, WIDTH // 8, 3)).repeat(8, 0).repeat(8, 1).astype(np.float64)
    frames = [scene + rng.normal(0, 1.5, scene.shape) + 6 * math.sin(t) for t in range(FRAMES)]
    return np.clip(np.stack(frames), 0, 255).round().astype(np.uint8)


def clips() -> dict[str, np.ndarray]:
    """The comparison's videos: two synthetic clips and, when present, the decoded student sample."""
    out = {"moving_square": clip_moving_square(), "static_flicker": clip_static_flicker()}
    if STUDENT_SAMPLE.is_file():
        out["student_sample"] = np.load(STUDENT_SAMPLE)["frames"]
    return out


def fill(shapes: dict[str, list[int]], seed: int, half: bool = False) -> dict[str, np.ndarray]:
    """Deterministic float32 values for each named tensor shape (module doc); integer counters (``num_batches_tracked``) 0.
    ``half``: values rounded to float16 first (OpenAI's ``clip.load`` puts a state dict through a half-precision model
    even on the CPU, so only such values reach its float32 model unchanged)."""
    out = {}
    for i, name in enumerate(sorted(shapes)):
        shape = tuple(shapes[name])
        if name.endswith("num_batches_tracked"):
            out[name] = np.zeros(shape, dtype=np.int64)
            continue
        n = np.random.default_rng([seed, i]).standard_normal(shape)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "running_var":
            v = 1.0 + 0.1 * np.abs(n)
        elif leaf == "running_mean":
            v = 0.1 * n
        elif leaf == "bias" or leaf.endswith("_bias"):
            v = 0.02 * n
        elif len(shape) >= 2 and "embedding" not in leaf and leaf not in ("proj", "text_projection", "position_emb",
                                                                         "pos_embed", "cls_token", "cls"):
            fan_in = int(np.prod(shape[1:]))
            v = n / math.sqrt(fan_in)
        elif len(shape) == 1 and ("norm" in name or "ln" in name or leaf == "weight" or "gn" in name):
            v = 1.0 + 0.1 * n
        elif leaf in ("proj", "text_projection"):
            v = n / math.sqrt(shape[0])
        else:
            v = 0.02 * n
        v = np.asarray(v)
        out[name] = v.astype(np.float16).astype(np.float32) if half else v.astype(np.float32)
    return out


def learned_merges(texts: tuple[str, ...] | list[str], count: int = 300) -> list[tuple[str, str]]:
    """A small deterministic BPE merge list learnt from ``texts`` (most frequent adjacent pair first, ties by the pair's
    text) over CLIP's pre-tokenised, byte-mapped, ``</w>``-marked words — enough vocabulary for the comparison's prompts."""
    from collections import Counter

    words = Counter()
    for t in texts:
        for w in t.lower().split():
            word = "".join(c for c in w if c.isalnum())
            if word:
                words[tuple(word[:-1]) + (word[-1] + "</w>",)] += 1
    merges = []
    for _ in range(count):
        pairs = Counter()
        for w, c in words.items():
            for a, b in zip(w[:-1], w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i < len(w) - 1 and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return merges


def write_bpe(path: Path, texts=PROMPTS) -> Path:
    """A ``bpe_simple_vocab_16e6.txt.gz``-format file (a header line, then merges) of :func:`learned_merges`."""
    lines = ["#version: test"] + [f"{a} {b}" for a, b in learned_merges(texts)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path
