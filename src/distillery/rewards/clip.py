"""CLIP text–video similarity as a reward (a plugin of :mod:`distillery.methods.rl.rewards`).

:class:`ClipTextReward` scores with validate's ``clip_text`` (:mod:`distillery.evaluation.clip_scores`, with the same
folder rules, preprocessing and embeddings): the mean over the frames it reads of ``cos(e_text, e_frame)``, in
[−1, 1]. ``model_from``: a CLIP folder in transformers' layout (``CLIPModel``: e.g. ``openai/clip-vit-large-patch14``,
or PickScore's ``CLIPModel`` weights, whose similarity is its preference score up to a scale). Default frames: all.
Its folder's layout is checked when the run config is built (one line naming the key, before any weights load); the
weights load when the method starts, and weights that do not load are one line too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from distillery.common.errors import UserError
from distillery.methods.rl.rewards import Reward, RewardConfig


def load_problem(folder: str, exc: BaseException) -> UserError:
    """The one line for a reward model folder whose weights do not load."""
    return UserError(f"method.rewards: the model in {folder} does not load ({type(exc).__name__}: {str(exc)[:160]})")


@dataclass
class ClipTextRewardConfig(RewardConfig):
    model_from: str = ""  # a CLIP model folder in transformers' layout (config.json model_type clip, safetensors, tokenizer)

    def __post_init__(self) -> None:
        from distillery.evaluation.clip_scores import check_clip_folder

        if not self.model_from:
            raise ValueError("model_from is required: a CLIP model folder in transformers' layout")
        try:
            check_clip_folder(self.model_from, "model_from")
        except UserError as exc:
            raise ValueError(str(exc)) from None


class ClipTextReward(Reward):
    """Mean CLIP cosine between the prompt and the frames it reads (module doc)."""

    config_class = ClipTextRewardConfig

    def __init__(self, config: ClipTextRewardConfig, device: torch.device | str = "cpu") -> None:
        from distillery.evaluation.clip_scores import ClipScorer

        super().__init__(config, device)
        try:
            self.scorer = ClipScorer(config.model_from, self.device)
        except UserError:
            raise
        except Exception as exc:  # a corrupt or truncated safetensors file, a config the class refuses
            raise load_problem(config.model_from, exc) from None

    @classmethod
    def model_folder(cls, config: ClipTextRewardConfig) -> Path:
        return Path(config.model_from)

    def score(self, frames: np.ndarray, prompts: list[str]) -> np.ndarray:
        out = np.zeros(len(prompts))
        for i, (video, prompt) in enumerate(zip(frames, prompts)):
            images = self.scorer.image_embeddings(video)  # [T', D], unit norm
            out[i] = float((images @ self.scorer.text_embedding(prompt)).mean())
        return out
