"""DiffusionNFT (src/distillery/methods/nft.py) and its reward plugins, in process.

- against FastVideo 0.2.1's own code on the same tensors: its ``DiffusionNFTMethod._training_timestep_loss`` (the
  objective and its gradient, every advantage mode), ``_compute_advantages`` and ``_return_decay``, compiled from
  the unpacked wheel's source file and run here (the module itself imports FastVideo's whole package tree —
  torchvision, its pipelines — which this environment does not install: its functions are taken out of the file
  with ``ast``, unchanged, and run with torch);
- the method on the tiny Wan: a rollout group is K samples of each prompt sampled by the old policy through the
  student's sampling contract (at the start, the student itself: the same latents as its own sampler from the same
  noise), decoded and scored, its advantages group-normalised; the micro-steps of an update are its minibatches ×
  the training timesteps the contract's sampler visits; a group's minibatches partition it; the old policy
  follows the student after each group; the weight copies give the role back bit for bit;
- the rewards: the synthetic clips' adherence (partial credit per attribute), CLIP text–video similarity (validate's
  ``clip_text``) and an image classifier's preference, each against its definition; their refusals, one line each.
"""

from __future__ import annotations

import __future__
import ast
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import run_config
from test_clip_scores import make_clip_folder

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.methods.nft import DiffusionNFTMethod
from distillery.methods.nft_objective import clip_advantages, group_advantages, nft_loss, old_policy_decay
from distillery.models.wan import WanModel, WanModelConfig
from distillery.tinybase.shipped import shipped_tiny_base

FASTVIDEO = Path(os.environ.get("DISTILLERY_FASTVIDEO_SRC", "/work/peer/fastvideo"))
FASTVIDEO_NFT = FASTVIDEO / "fastvideo" / "train" / "methods" / "rl" / "diffusion_nft.py"
NFT = "distillery.methods.nft.DiffusionNFTMethod"
ADHERENCE = "distillery.clips.reward.AdherenceReward"
CAPTIONS = [
    "a red circle moving left slowly on a black background",
    "a blue square moving up quickly on a black background",
    "a yellow triangle moving right slowly on a black background",
    "a green circle moving down quickly on a black background",
]
LATENT_SHAPE = (8, 3, 8, 8)  # the tiny base's VAE: 9 frames × 32 × 32
CONTRACT = {"sampler": "few_step_x0", "shift": 3.0, "num_train_timesteps": 1000, "timesteps": [1000.0, 750.0, 500.0]}


# -- FastVideo's own functions ------------------------------------------------------------------------
class _TrainingBatch:
    """What FastVideo's ``_make_training_batch`` fills (its ``fastvideo.pipelines.TrainingBatch``, a dataclass of
    attributes defaulting to None; the loss returns its ``attn_metadata``)."""

    attn_metadata = None


def fastvideo_nft_class() -> type:
    """A class holding FastVideo 0.2.1's ``DiffusionNFTMethod`` methods that the tests call, compiled from its source
    file as they are written there (module doc: its package cannot be imported here)."""
    if not FASTVIDEO_NFT.is_file():
        pytest.skip(f"FastVideo 0.2.1's source is not unpacked at {FASTVIDEO} (DISTILLERY_FASTVIDEO_SRC)")
    tree = ast.parse(FASTVIDEO_NFT.read_text(), filename=str(FASTVIDEO_NFT))
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "DiffusionNFTMethod")
    wanted = {"_training_timestep_loss", "_make_training_batch", "_compute_advantages", "_num_train_timesteps",
              "_return_decay", "_gather_tensor", "_gather_prompts"}
    funcs = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {f.name for f in funcs} == wanted
    code = compile(ast.Module(body=funcs, type_ignores=[]), str(FASTVIDEO_NFT), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict[str, Any] = {"torch": torch, "dist": torch.distributed, "defaultdict": defaultdict,
                                 "TrainingBatch": _TrainingBatch}
    exec(code, namespace)
    return type("FastVideoNFT", (), {name: namespace[name] for name in wanted})


class _Fixed:
    """A model whose ``predict_noise`` returns a given velocity and records the ``x_t`` it was asked at."""

    num_train_timesteps = 1000

    def __init__(self, velocity: torch.Tensor) -> None:
        self.velocity, self.seen = velocity, []

    def predict_noise(self, xt, timestep, batch, conditional=True, attn_kind="dense"):
        self.seen.append((xt.detach().clone(), timestep.detach().clone()))
        return self.velocity


@pytest.mark.parametrize("mode", ["all", "positive_only", "negative_only", "one_only", "binary"])
def test_the_objective_and_its_gradient_are_fastvideos_on_the_same_tensors(mode):
    g = torch.Generator().manual_seed(3)
    b, shape = 5, (4, 3, 6, 6)
    x0 = torch.randn(b, *shape, generator=g)
    v_old, v_ref = torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)
    theta = torch.randn(b, *shape, generator=g)
    timesteps = torch.tensor([[1000.0, 750.0], [900.0, 500.0], [800.0, 300.0], [700.0, 250.0], [999.0, 20.0]])
    advantages = torch.tensor([-7.0, -1.5, 0.0, 2.5, 9.0])
    beta, clip_max, kl_beta, column = 0.3, 5.0, 0.01, 1

    fv = fastvideo_nft_class()()
    v_fv = theta.clone().requires_grad_(True)
    fv.old, fv.reference, fv.student = _Fixed(v_old), _Fixed(v_ref), _Fixed(v_fv)
    fv.cuda_generator = torch.Generator().manual_seed(11)
    fv._adv_clip_max, fv._adv_mode, fv._nft_beta, fv._kl_beta = clip_max, mode, beta, kl_beta
    sample = {"latents_clean": x0, "timesteps": timesteps, "encoder_hidden_states": torch.zeros(b, 2, 8),
              "encoder_attention_mask": torch.ones(b, 2)}
    theirs, _ = fv._training_timestep_loss(sample, advantages, column)
    theirs["total_loss"].backward()

    t = timesteps[:, column]
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(11))  # the noise their step drew
    from distillery.models.schedule import renoise

    x_t = renoise(x0, noise, t / 1000)
    assert torch.equal(fv.student.seen[0][0], x_t) and torch.equal(fv.old.seen[0][1], t)
    v_ours = theta.clone().requires_grad_(True)
    ours = nft_loss(x0, x_t, t / 1000, v_ours, v_old, v_ref, clip_advantages(advantages, clip_max, mode), beta, clip_max,
                    kl_beta)
    ours["total_loss"].backward()
    for key, their_key in (("total_loss", "total_loss"), ("policy_loss", "policy_loss"), ("kl_loss", "kl_div_loss"),
                           ("old_deviation", "old_deviate"), ("old_kl", "old_kl_div")):
        assert float(ours[key].detach()) == pytest.approx(float(theirs[their_key].detach()), rel=1e-12, abs=1e-12), key
    assert float(v_fv.grad.abs().max()) > 0
    torch.testing.assert_close(v_ours.grad, v_fv.grad, rtol=1e-12, atol=1e-15)


def test_advantages_training_timesteps_and_old_decay_are_fastvideos():
    fv = fastvideo_nft_class()()
    rewards = torch.tensor([0.1, 0.7, 0.7, 0.2, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.3, 0.9])  # 3 prompts × 4 rollouts
    prompts = [p for p in ("a", "b", "c") for _ in range(4)]
    for steps, fraction in ((4, 0.99), (40, 0.99), (3, 0.5), (1, 0.99)):
        fv._sample_steps, fv._timestep_fraction = steps, fraction
        fv._sampling_config = type("Sampling", (), {"timesteps": None, "sigmas": None})()
        theirs = fv._compute_advantages([{"prompts": prompts}], {"avg": rewards})
        from distillery.methods.nft_policy import train_points

        student = WanModel(WanModelConfig(init_from=str(shipped_tiny_base()), trainable=False), "student")
        points = train_points({"sampler": "euler", "shift": 3.0}, student, steps, fraction)
        assert theirs.shape == (12, len(points)) and len(points) == fv._num_train_timesteps()
        ours = group_advantages(rewards.view(3, 4)).view(-1)
        assert torch.equal(theirs[:, 0], ours) and torch.equal(theirs[:, -1], ours)
    assert torch.equal(ours[4:8], torch.zeros(4))  # a group of equal rewards has no advantage
    presets = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}  # FastVideo's decay_type → ours
    for decay_type, (flat, rate, cap) in presets.items():
        for group in (1, 2, 60, 74, 75, 76, 300, 1000):
            assert old_policy_decay(group, flat, rate, cap) == fv._return_decay(group, decay_type), (decay_type, group)
