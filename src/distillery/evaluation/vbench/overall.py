"""VBench's *overall consistency* of one video, as VBench 0.1.5 computes it (``overall_consistency.py``): the
cosine between ViCLIP's embedding of 8 frames (:func:`~distillery.evaluation.vbench.frames.middle_indices`;
VBench's ``clip_transform(224)`` on the uint8 frames, so the bicubic resize is rounded back to integers) and
ViCLIP's embedding of the prompt (its 32-token context). The prompt is VBench's own one (not an extended rewrite
the video was sampled from: :mod:`~distillery.evaluation.vbench.protocol`).
"""

from __future__ import annotations

import numpy as np
import torch

from distillery.evaluation.vbench.viclip import CONTEXT, FRAMES


class TextEmbeddings:
    """Unit-norm ViCLIP text embeddings, kept per prompt."""

    def __init__(self, viclip: torch.nn.Module, tokenizer) -> None:
        self.viclip, self.tokenizer, self.cache = viclip, tokenizer, {}

    def __call__(self, prompt: str, device: torch.device) -> torch.Tensor:
        if prompt not in self.cache:
            ids = torch.tensor([self.tokenizer.tokenize(prompt, CONTEXT)], dtype=torch.int, device=device)
            with torch.no_grad():
                e = self.viclip.text_encoder(ids).float()
            self.cache[prompt] = e / e.norm(dim=-1, keepdim=True)
        return self.cache[prompt]


def overall_consistency(viclip: torch.nn.Module, text: TextEmbeddings, frames: np.ndarray, prompt: str,
                        device: torch.device) -> float:
    """The video's overall consistency (module doc)."""
    from distillery.evaluation.vbench.frames import as_tensor, clip_pixels, middle_indices

    picked = frames[middle_indices(FRAMES, frames.shape[0])]
    pixels = clip_pixels(as_tensor(picked, device), integer=True)  # [8, 3, 224, 224]
    with torch.no_grad():
        video = viclip.vision_encoder(pixels.unsqueeze(0).permute(0, 2, 1, 3, 4).contiguous()).float()
    video = video / video.norm(dim=-1, keepdim=True)
    return float((video @ text(prompt, device).T)[0][0])
