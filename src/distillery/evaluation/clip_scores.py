"""Scores a user can put beside a paper's: CLIP text–video similarity, CLIP frame consistency, motion.

On when ``validate.clip_model`` names a CLIP model folder in transformers' layout (``config.json`` of
``model_type`` ``clip``, ``*.safetensors`` weights, a tokenizer: e.g. a download of
``openai/clip-vit-base-patch32`` or ``openai/clip-vit-large-patch14``); off (None, the default) the
validate stage computes none of them and its other numbers do not change. The folder is loaded with
transformers' own :class:`~transformers.CLIPModel` and :class:`~transformers.AutoTokenizer` (float32,
safetensors only, never remote code) on validate's device.

Per video (frames ``uint8 [T, H, W, 3]`` RGB, its prompt), :meth:`ClipScorer.score`:

- ``clip_text`` — CLIP text–video similarity: the mean over the T frames of ``cos(e_text, e_t)``,
  ``e_text`` the prompt's text embedding (``text_projection`` of the text tower's pooled output; the
  prompt tokenized with the folder's tokenizer, truncated to the text tower's
  ``max_position_embeddings``, 77 for OpenAI's) and ``e_t`` frame ``t``'s image embedding
  (``visual_projection`` of the vision tower's pooled output). A cosine in [−1, 1], not ×100 and not
  clipped at 0 (CLIPScore's ``100·max(cos, 0)`` is 100× it where it is positive);
- ``clip_consistency`` — frame-to-frame consistency: the mean over the T − 1 consecutive pairs of
  ``cos(e_t, e_{t+1})``, in [−1, 1]; 1 for a still video (and for a video of one frame). VBench's
  *subject consistency* idea (it uses DINO features and also compares each frame with the first);
- ``motion`` — how much the pixels move: the mean over the T − 1 consecutive pairs, every pixel and
  channel of ``|x_{t+1} − x_t|`` with ``x`` the RGB values in [0, 1] (×255: grey levels per pixel
  per frame step); 0 for a still video. Computed from the frames alone (exact integer sums, one
  division), so it is not a second reading of ``clip_consistency`` (``1 − cos`` of the same
  embeddings would be).

A frame's image preprocessing (:meth:`ClipScorer.pixels`) is CLIP's, written with torch ops: resize so
the shorter side is the processor's ``shortest_edge`` (bicubic, antialiased; the longer side
``int(S · long / short)``; skipped when it already is), centre crop to the crop size (top-left corner
``((H − h) // 2, (W − w) // 2)``), scale to [0, 1] and normalise by ``image_mean`` / ``image_std`` — all
from the folder's ``preprocessor_config.json``, else the vision tower's ``image_size`` and OpenAI's
mean and std (:data:`OPENAI_MEAN`, :data:`OPENAI_STD`). It matches ``CLIPImageProcessor`` up to the
resize's interpolation (PIL's bicubic on uint8 there), exactly where no resize happens.

A candidate's score is the mean of its P·S videos' scores with a 95% bootstrap interval
(:func:`summarise`: ``<score>_lo``, ``<score>_hi``, the 2.5th and 97.5th percentiles of the mean over
``resamples`` resamples of the videos with replacement, drawn by ``numpy.random.default_rng(seed)``;
``lo = hi = mean`` with fewer than 2 resamples or one video).

These are not VBench's numbers: VBench samples its own prompt suite, reads text–video alignment with
ViCLIP (*overall consistency*), subject consistency with DINO and motion with RAFT optical flow
(*dynamic degree*), and turns the mean absolute frame difference into ``(255 − MAE) / 255`` on static
scenes (*temporal flickering*). They are the same ideas, with the model the user points at, on validate's prompts
and seeds — comparable between runs and candidates scored with the same CLIP folder, and with papers
that report CLIP text similarity with the same CLIP model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distillery.common.errors import UserError

if TYPE_CHECKING:
    import torch

CLIP_SCORES = ("clip_text", "clip_consistency", "motion")  # per video and (mean) per candidate
CLIP_METRICS = tuple(k for s in CLIP_SCORES for k in (s, f"{s}_lo", f"{s}_hi"))  # a candidate's keys in metrics.json
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's image normalisation (OpenAI's, CLIPImageProcessor's default)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
INTERVAL = (2.5, 97.5)  # percentiles of the bootstrap means: a 95% interval (kid.INTERVAL)
FRAME_BATCH = 64  # frames per image-tower forward
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))  # a fast tokenizer, or a BPE's vocabulary + merges


def check_clip_folder(path: str | Path, where: str = "validate.clip_model") -> Path:
    """``path`` as a CLIP model folder (module doc), or a one-line :class:`UserError` naming ``where``: it must be a
    folder holding a ``config.json`` of ``model_type`` ``clip``, ``*.safetensors`` weights and a tokenizer
    (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``). Reads only ``config.json``."""
    from distillery.common.model_folders import read_model_config, require_safetensors

    folder = Path(path).expanduser()
    hint = "point it at a CLIP model folder in transformers' layout (e.g. a download of openai/clip-vit-base-patch32)"

    def fail(message: str) -> UserError:
        return UserError(f"{where}: {message}")

    config = read_model_config(folder, hint, fail)
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind != "clip":
        raise fail(f"{folder} is not a CLIPModel folder (config.json model_type {kind!r}, expected 'clip'); {hint}")
    require_safetensors(folder, fail, "save a copy with CLIPModel.from_pretrained(...).save_pretrained(folder), docs/pipeline.md")
    if not any(all((folder / f).is_file() for f in files) for files in TOKENIZER_FILES):
        raise UserError(f"{where}: {folder} has no tokenizer (tokenizer.json, or vocab.json + merges.txt); {hint}")
    return folder


def motion(video: np.ndarray) -> float:
    """``motion`` of a ``uint8 [T, H, W, 3]`` video (module doc): mean ``|x_{t+1} − x_t|`` in [0, 1] RGB units; 0 for T = 1."""
    if video.dtype != np.uint8 or video.ndim != 4:
        raise ValueError(f"motion needs a uint8 [T, H, W, 3] video, got {video.dtype}{video.shape}")
    if video.shape[0] < 2:
        return 0.0
    total = 0
    for a, b in zip(video[:-1], video[1:]):  # a frame pair at a time: exact in int64
        total += int(np.abs(b.astype(np.int64) - a).sum())
    return total / (255.0 * (video.shape[0] - 1) * video[0].size)


def summarise(rows: list[dict[str, float]], resamples: int, seed: int) -> dict[str, float]:
    """A candidate's :data:`CLIP_METRICS` from its videos' scores ``rows`` (module doc: the mean and its 95%
    bootstrap interval; the same resample indices for every score and every candidate of one size)."""
    values = np.asarray([[r[k] for k in CLIP_SCORES] for r in rows], dtype=np.float64)  # [N, 3]
    if values.shape[0] < 1:
        raise ValueError("summarise needs the scores of at least one video")
    mean = values.mean(axis=0)
    if resamples < 2 or values.shape[0] < 2:
        lo = hi = mean
    else:
        rng = np.random.default_rng(seed)
        means = np.stack([values[rng.integers(0, values.shape[0], size=values.shape[0])].mean(axis=0)
                          for _ in range(resamples)])  # [B, 3]
        lo, hi = np.percentile(means, INTERVAL, axis=0)
    out: dict[str, float] = {}
    for k, m, low, high in zip(CLIP_SCORES, mean, lo, hi):
        out[k], out[f"{k}_lo"], out[f"{k}_hi"] = float(m), float(low), float(high)
    return out


class ClipScorer:
    """A CLIP folder's model and tokenizer on ``device``, scoring decoded videos (module doc)."""

    def __init__(self, folder: str | Path, device: "str | torch.device" = "cpu") -> None:
        import torch
        from transformers import AutoTokenizer, CLIPModel

        self.folder = check_clip_folder(folder)
        self.device = torch.device(device)
        self.model = CLIPModel.from_pretrained(self.folder, dtype=torch.float32, use_safetensors=True).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.max_tokens = int(self.model.config.text_config.max_position_embeddings)
        size = int(self.model.config.vision_config.image_size)
        self.shortest_edge, self.crop_hw = size, (size, size)
        mean, std = OPENAI_MEAN, OPENAI_STD
        processor = self.folder / "preprocessor_config.json"
        if processor.is_file():
            from distillery.common.fsutil import read_json_file
            from distillery.common.model_folders import CONFIG_BYTES

            pre = read_json_file(processor, CONFIG_BYTES)
            edge, crop = pre.get("size"), pre.get("crop_size")
            self.shortest_edge = int(edge.get("shortest_edge", size) if isinstance(edge, dict) else edge or size)
            if isinstance(crop, dict):
                self.crop_hw = (int(crop.get("height", size)), int(crop.get("width", size)))
            elif crop:
                self.crop_hw = (int(crop), int(crop))
            mean, std = tuple(pre.get("image_mean") or mean), tuple(pre.get("image_std") or std)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self._text: dict[str, torch.Tensor] = {}

    def describe(self) -> dict[str, Any]:
        """What report.json records of the model: its folder, sizes and preprocessing."""
        cfg = self.model.config
        return {"folder": str(self.folder), "projection_dim": int(cfg.projection_dim),
                "image_size": int(cfg.vision_config.image_size), "patch_size": int(cfg.vision_config.patch_size),
                "shortest_edge": self.shortest_edge, "crop_hw": list(self.crop_hw), "max_tokens": self.max_tokens,
                "image_mean": self.mean.flatten().tolist(), "image_std": self.std.flatten().tolist()}

    def pixels(self, frames: np.ndarray) -> "torch.Tensor":
        """``uint8 [T, H, W, 3]`` → CLIP's normalised ``float32 [T, 3, h, w]`` on the device (module doc)."""
        import torch
        import torch.nn.functional as F

        x = torch.from_numpy(np.ascontiguousarray(frames)).to(self.device).permute(0, 3, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        short, long = (h, w) if h <= w else (w, h)
        if short != self.shortest_edge:
            other = int(self.shortest_edge * long / short)
            size = (self.shortest_edge, other) if h <= w else (other, self.shortest_edge)
            x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(0.0, 1.0)
            h, w = size
        ch, cw = self.crop_hw
        if (h, w) != (ch, cw):
            if h < ch or w < cw:
                raise UserError(f"validate.clip_model: frames of {h}×{w} after the resize are smaller than the crop {ch}×{cw}")
            top, left = (h - ch) // 2, (w - cw) // 2
            x = x[:, :, top:top + ch, left:left + cw]
        return (x - self.mean) / self.std

    def text_embedding(self, prompt: str) -> "torch.Tensor":
        """The unit-norm text embedding ``[D]`` of ``prompt`` (kept for the run)."""
        import torch

        if prompt not in self._text:
            ids = self.tokenizer([prompt], truncation=True, max_length=self.max_tokens, return_tensors="pt")
            with torch.no_grad():
                out = self.model.text_model(input_ids=ids["input_ids"].to(self.device),
                                            attention_mask=ids["attention_mask"].to(self.device))
                embed = self.model.text_projection(out.pooler_output)[0]
            self._text[prompt] = embed / embed.norm()
        return self._text[prompt]

    def image_embeddings(self, frames: np.ndarray) -> "torch.Tensor":
        """Unit-norm image embeddings ``[T, D]`` of a ``uint8 [T, H, W, 3]`` video's frames."""
        import torch

        chunks = []
        with torch.no_grad():
            for start in range(0, frames.shape[0], FRAME_BATCH):
                out = self.model.vision_model(pixel_values=self.pixels(frames[start:start + FRAME_BATCH]))
                chunks.append(self.model.visual_projection(out.pooler_output))
        embeds = torch.cat(chunks)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    def score(self, frames: np.ndarray, prompt: str) -> dict[str, float]:
        """:data:`CLIP_SCORES` of one video ``uint8 [T, H, W, 3]`` sampled for ``prompt`` (module doc)."""
        images = self.image_embeddings(frames)
        text = self.text_embedding(prompt)
        consistency = (images[:-1] * images[1:]).sum(dim=-1).mean() if images.shape[0] > 1 else images.new_ones(())
        return {"clip_text": float((images @ text).mean()), "clip_consistency": float(consistency),
                "motion": motion(frames)}
