"""``posttrain.method: nft``: DiffusionNFT (:mod:`distillery.methods.rl.nft`) — the student of ``posttrain.student``
samples K rollouts of each prompt with its own sampling contract (its artifact's ``sampling.json``), the rollouts are
decoded with the base's VAE and scored by the rewards weighted here, and the NFT objective (with its KL term to the
student's initial weights) trains it on them. The artifact samples as the student did.

Rewards (a weight of 0 leaves a reward out; at least one is on): ``reward_adherence`` — the clip set's analyzer reading
each video back against its caption (the base's ``analyzer.json``: the synthetic set's verifiable reward; a real base
has none) —, ``reward_clip`` — CLIP text–video similarity with the CLIP folder ``clip_model`` —, ``reward_preference``
— an image-preference classifier's score of the first frame, from ``preference_model`` (``preference_label``: the class
whose probability is the reward; null: a one-output head's value). A reward model's folder is an input of the stage:
its files are pinned in the lineage and are part of the resume key (:func:`reads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distillery.pipeline.params.schema import MAX_SAMPLING_STEPS, PosttrainParams, optional, optional_path, rule

if TYPE_CHECKING:
    from distillery.config import RunConfig
    from distillery.pipeline.launch.run_config import RunInputs

BASE_MODEL = "artifacts/base/model"  # the base's folder: the VAE that decodes rollouts, the analyzer's thresholds
MAX_REWARD_WEIGHT = 1000.0  # distillery.methods.rl.rewards.RewardConfig.weight's bound


def _above_zero(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _label(v: str) -> str | None:
    return None if v.strip() and len(v) <= 200 else "must be a class name of the preference model (1-200 characters)"


@dataclass
class Params(PosttrainParams):
    """``posttrain.*`` with DiffusionNFT's knobs and the rewards' weights and folders."""

    samples_per_prompt: int = rule(4, 2, 1024)  # K rollouts of each prompt: its advantage group
    minibatch_size: int | None = rule(None, 1, 1 << 16)  # samples per rank in one update; null: posttrain.batch_size
    inner_epochs: int = rule(1, 1, 1000)  # passes over a rollout group
    rollout_steps: int | None = rule(None, 1, MAX_SAMPLING_STEPS)  # the student's sampling steps in rollouts; null: its contract's
    timestep_fraction: float = rule(1.0, 0.0, 1.0, _above_zero)  # trained at the first int(n · this) of the n timesteps it samples at
    beta: float = rule(0.1, 1e-6, 1000.0)  # β of the implicit positive / negative policies
    kl_beta: float = rule(1e-4, 0.0, 1e6)  # the KL term's weight (to the student's initial weights; 0: none)
    reward_adherence: float = rule(1.0, -MAX_REWARD_WEIGHT, MAX_REWARD_WEIGHT)  # the clip analyzer's adherence (0: off)
    reward_clip: float = rule(0.0, -MAX_REWARD_WEIGHT, MAX_REWARD_WEIGHT)  # CLIP text-video similarity (0: off; needs clip_model)
    reward_preference: float = rule(0.0, -MAX_REWARD_WEIGHT, MAX_REWARD_WEIGHT)  # an image-preference score (0: off; needs preference_model)
    clip_model: str | None = rule(None, check=optional_path)  # a CLIP folder in transformers' layout
    preference_model: str | None = rule(None, check=optional_path)  # a folder AutoModelForImageClassification loads
    preference_label: str | None = rule(None, check=optional(_label))  # its class whose probability is the reward

    def problem(self, stage: str) -> str | None:
        weights = {"reward_adherence": self.reward_adherence, "reward_clip": self.reward_clip,
                   "reward_preference": self.reward_preference}
        if not any(weights.values()):
            return f"{stage}.reward_adherence, reward_clip, reward_preference: all 0; weight at least one reward"
        for weight, folder in (("reward_clip", "clip_model"), ("reward_preference", "preference_model")):
            if weights[weight] and getattr(self, folder) is None:
                return f"{stage}.{weight}: {weights[weight]:g} needs {stage}.{folder}: the model folder that scores it"
        return None


def inputs(p: Params) -> dict[str, str]:
    """The student: the distill or the PDD stage's (``posttrain.student``)."""
    return {"student": p.student}


def reads(p: Params) -> dict[str, Path]:
    """What else the run reads, by lineage name: the base (its VAE decodes the rollouts; its ``analyzer.json`` scores
    adherence) and each reward model's folder that is on."""
    found = {"base": Path(BASE_MODEL).parent}
    if p.reward_clip:
        found["reward_clip"] = Path(str(p.clip_model))
    if p.reward_preference:
        found["reward_preference"] = Path(str(p.preference_model))
    return found


def rewards(p: Params) -> dict[str, dict[str, Any]]:
    """The method's ``rewards``: each reward that is on, its ``_target_``, weight and folder."""
    from distillery.config.loader import public_path
    from distillery.rewards.adherence import AdherenceReward
    from distillery.rewards.clip import ClipTextReward
    from distillery.rewards.preference import ImagePreferenceReward

    found: dict[str, dict[str, Any]] = {}
    if p.reward_adherence:
        found["adherence"] = {"_target_": public_path(AdherenceReward), "weight": p.reward_adherence, "folder": BASE_MODEL}
    if p.reward_clip:
        found["clip"] = {"_target_": public_path(ClipTextReward), "weight": p.reward_clip, "model_from": p.clip_model}
    if p.reward_preference:
        found["preference"] = {"_target_": public_path(ImagePreferenceReward), "weight": p.reward_preference,
                               "model_from": p.preference_model, "label": p.preference_label}
    return found


def student_contract(folder: str) -> dict[str, Any]:
    """The sampling contract of the student in ``folder`` (its ``sampling.json``, as the stage that made it wrote it)."""
    from distillery.common.errors import UserError
    from distillery.common.fsutil import read_json_file

    path = Path(folder) / "sampling.json"
    try:
        contract = read_json_file(path, 1 << 20)
    except (OSError, ValueError) as exc:
        raise UserError(f"stage posttrain: {path}: unreadable ({getattr(exc, 'strerror', None) or exc}); rerun the "
                        "stage that made the student") from None
    if not isinstance(contract, dict) or not isinstance(contract.get("sampler"), str):
        raise UserError(f"stage posttrain: {path}: not a sampling contract (no sampler); rerun the stage that made it")
    return contract


def recipe(p: Params, run: RunInputs) -> RunConfig:
    from distillery.config import RunConfig
    from distillery.methods.rl.nft import DiffusionNFTMethod
    from stages.recipes.parts import callbacks, method, student

    contract = student_contract(run.init["student"])
    if contract["sampler"] == "pdd_fused":  # a PDD student: its head bank, as many heads as its grid has intervals
        model = student(p, "pdd", run.init["student"], pdd_steps=int(contract["pdd_steps"]))
    else:
        model = student(p, "bidirectional", run.init["student"], shift=contract.get("shift"))
    nft = method(DiffusionNFTMethod, rewards=rewards(p), samples_per_prompt=p.samples_per_prompt,
                 minibatch_size=p.minibatch_size, inner_epochs=p.inner_epochs, sampling=contract,
                 rollout_steps=p.rollout_steps, timestep_fraction=p.timestep_fraction, beta=p.beta, kl_beta=p.kl_beta,
                 vae_from=BASE_MODEL)
    return RunConfig(models={"student": model}, method=nft, training=p.training(run), callbacks=callbacks(p))
