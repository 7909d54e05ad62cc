"""An image classifier's preference as a reward (a plugin of :mod:`distillery.methods.rl.rewards`).

:class:`ImagePreferenceReward`: an image classifier's score of the frames it reads, averaged. ``model_from`` is a
folder transformers' ``AutoModelForImageClassification`` and ``AutoImageProcessor`` load (``config.json`` naming a
``*ForImageClassification`` architecture, ``*.safetensors`` weights, ``preprocessor_config.json``; never remote
code): a CLIP-based aesthetic or preference head (``CLIPForImageClassification``), a ViT / BEiT aesthetic classifier
(e.g. ``cafeai/cafe_aesthetic``'s ``aesthetic`` label). ``label``: the class whose softmax probability is the reward;
null: the head must have one output (a regression head), whose value is the reward. It reads no prompt. Default
frames: first. The folder's layout and label are checked when the run config is built; its weights load when the
method starts (one line when they do not).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from distillery.config.typed import with_default
from distillery.methods.rl.rewards import Reward, RewardConfig
from distillery.rewards.clip import load_problem


@dataclass
class ImagePreferenceRewardConfig(RewardConfig):
    model_from: str = ""  # a folder AutoModelForImageClassification + AutoImageProcessor load (safetensors, no code)
    label: str | None = None  # the class whose probability is the reward; null: a one-output (regression) head's value
    frames: Literal["first", "all"] = with_default(RewardConfig, "frames", "first")

    def __post_init__(self) -> None:
        if not self.model_from:
            raise ValueError("model_from is required: an image-classification model folder in transformers' layout")
        check_classifier_folder(Path(self.model_from), self.label)


def check_classifier_folder(folder: Path, label: str | None) -> None:
    """A ValueError (one line) unless ``folder`` holds an image classifier ``label`` can be read from (module doc);
    reads only its JSON files."""
    from distillery.common.model_folders import read_model_config, require_safetensors

    hint = "point it at an image-classification model folder in transformers' layout"
    config = read_model_config(folder, hint, ValueError)
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(archs, list) or not any(isinstance(a, str) and a.endswith("ForImageClassification") for a in archs):
        raise ValueError(f"{folder} is not an image classifier (config.json architectures {archs!r}, expected a "
                         f"*ForImageClassification); {hint}")
    require_safetensors(folder, ValueError)
    if not (folder / "preprocessor_config.json").is_file():
        raise ValueError(f"{folder} has no preprocessor_config.json (the image processor's settings)")
    labels = {str(v) for v in (config.get("id2label") or {}).values()}
    count = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
    if label is None and count != 1:
        raise ValueError(f"{folder}'s head has {count} outputs ({', '.join(sorted(labels)) or 'unnamed'}); name the label "
                         "whose probability is the reward")
    if label is not None and label not in labels:
        raise ValueError(f"label {label!r} is not one of {folder}'s classes ({', '.join(sorted(labels)) or 'none named'})")


class ImagePreferenceReward(Reward):
    """An image classifier's probability of ``label`` (or its one output), averaged over the frames it reads."""

    config_class = ImagePreferenceRewardConfig

    def __init__(self, config: ImagePreferenceRewardConfig, device: torch.device | str = "cpu") -> None:
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        super().__init__(config, device)
        try:
            self.processor = AutoImageProcessor.from_pretrained(config.model_from)
            model = AutoModelForImageClassification.from_pretrained(config.model_from, dtype=torch.float32,
                                                                    use_safetensors=True)
        except Exception as exc:  # a corrupt weights file, a class transformers does not know
            raise load_problem(config.model_from, exc) from None
        self.model = model.to(self.device).eval()
        id2label = {int(k): str(v) for k, v in (self.model.config.id2label or {}).items()}
        self.index = None if config.label is None else next(i for i, name in id2label.items() if name == config.label)

    @classmethod
    def model_folder(cls, config: ImagePreferenceRewardConfig) -> Path:
        return Path(config.model_from)

    @torch.no_grad()
    def score(self, frames: np.ndarray, prompts: list[str]) -> np.ndarray:
        del prompts  # an image preference: the frames alone
        b, t = frames.shape[:2]
        images = list(frames.reshape(b * t, *frames.shape[2:]))
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].to(self.device, torch.float32)
        logits = self.model(pixel_values=pixels).logits.float()  # [B·T', labels]
        values = logits[:, 0] if self.index is None else logits.softmax(dim=-1)[:, self.index]
        return values.view(b, t).mean(dim=1).double().cpu().numpy()
