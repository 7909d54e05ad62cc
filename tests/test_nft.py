"""DiffusionNFT (src/distillery/methods/rl/nft.py) and its reward plugins, in process.

- against FastVideo 0.2.1's own code on the same tensors: its ``DiffusionNFTMethod._training_timestep_loss`` (the
  objective and its gradient, every advantage mode), ``_compute_advantages`` and ``_return_decay``, compiled from
  the unpacked wheel's source file and run here (the module itself imports FastVideo's whole package tree —
  torchvision, its pipelines — which this environment does not install: its functions are taken out of the file
  with ``ast``, unchanged, and run with torch);
- the method on the tiny Wan: a rollout group is K samples of each prompt sampled by the old policy through the
  student's sampling contract (at the start, the student itself: the same latents as its own sampler from the same
  noise), decoded and scored, its advantages group-normalised; the micro-steps of an update are its minibatches ×
  the training timesteps the contract's sampler visits; a group's minibatches partition it; the old policy (shadow
  weights of the student, ``shadows["old"]``) follows the student after each group;
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
from distillery.methods.rl.nft import DiffusionNFTMethod
from distillery.methods.rl.objective import clip_advantages, group_advantages, nft_loss, old_policy_decay
from distillery.models.wan import WanModel, WanModelConfig
from distillery.tinybase.shipped import shipped_tiny_base

FASTVIDEO = Path(os.environ.get("DISTILLERY_FASTVIDEO_SRC", "/work/peer/fastvideo"))
FASTVIDEO_NFT = FASTVIDEO / "fastvideo" / "train" / "methods" / "rl" / "diffusion_nft.py"
NFT = "distillery.methods.rl.nft.DiffusionNFTMethod"
ADHERENCE = "distillery.rewards.adherence.AdherenceReward"
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
        from distillery.methods.rl.policy import train_points

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


# -- the method on the tiny Wan ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def grammar_set(tmp_path_factory) -> Path:
    """Captions of the clip grammar with the shipped base's text embeddings (a latent set whose latents only give
    the shape: DiffusionNFT reads prompts)."""
    from distillery.data import LatentRecord, write_empty_prompt_embedding, write_latent_shards
    from distillery.data.encoders import BaseEncoders

    root = tmp_path_factory.mktemp("nft-data") / "data"
    enc = BaseEncoders(shipped_tiny_base())
    embeds = enc.encode_prompts(CAPTIONS + [""])
    records = [LatentRecord(id=f"v{i}", caption=c, latent=torch.zeros(LATENT_SHAPE), text_embedding=e, num_frames=9,
                            height=32, width=32, fps=8.0, source="test") for i, (c, e) in enumerate(zip(CAPTIONS, embeds))]
    write_latent_shards(records, root, rows_per_shard=4, split="train")
    write_empty_prompt_embedding(root, embeds[-1])
    return root


def nft_config(data: Path, out: Path, batch_size: int = 2, steps: int = 4, knobs: dict | None = None,
               rewards: dict | None = None, base: Path | None = None, **kw) -> dict:
    """A run config of DiffusionNFT on the shipped tiny base with the adherence reward."""
    base = base or shipped_tiny_base()
    method = {"samples_per_prompt": 3, "minibatch_size": batch_size, "sampling": CONTRACT, "kl_beta": 0.05,
              "rewards": rewards or {"adherence": {"_target_": ADHERENCE, "folder": str(shipped_tiny_base())}},
              **(knobs or {})}
    cfg = run_config(base, data, out, method=NFT, method_knobs=method, steps=steps, batch_size=batch_size, lr=1e-4, **kw)
    cfg["training"]["data"]["text_max_length"] = 32
    return cfg


def make_method(raw: dict) -> DiffusionNFTMethod:
    config = load_run_config(raw=raw, prefixes=allowed_prefixes())
    student = WanModel(config.models["student"].config, "student")
    student.bind_device(torch.device("cpu"))
    method = DiffusionNFTMethod(config.method.config, {"student": student}, config.training,
                                plugins=config.method.plugins)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    return method


def batches(data: Path, batch_size: int):
    from distillery.components.distributed import DistEnv
    from distillery.config.schema import DataConfig
    from distillery.engine.batches import build_batches

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), compute_dtype=torch.float32,
                  backend="gloo", mesh=None)
    return build_batches(data, DataConfig(path=str(data), batch_size=batch_size, text_max_length=32), 0, env,
                         with_latents=False)


def test_a_rollout_group_is_k_samples_of_each_prompt_from_the_old_policy_scored_and_normalised(grammar_set, tmp_path):
    from distillery.data.encoders import BaseEncoders
    from distillery.models.base import Conditioning
    from distillery.rewards.adherence import AdherenceReward, AdherenceRewardConfig
    from distillery.sampling import build_sampler

    method = make_method(nft_config(grammar_set, tmp_path))
    k = method.config.samples_per_prompt
    stream = batches(grammar_set, 2)
    state = method.rng.generator.get_state()
    peek = batches(grammar_set, 2)
    raw = next(peek)
    plan = method.plan_step(stream, 1)
    group = method.group
    assert group.index == 1 and group.x0.shape == (2 * k, *LATENT_SHAPE)
    # the old policy is the student at the start: the group is what the student's own sampler gives from that noise
    method.rng.generator.set_state(state)
    rows = torch.arange(2).repeat_interleave(k)
    noise = method.rng.randn((2 * k, *LATENT_SHAPE))
    text = raw["text_embeds"][rows].float()
    with torch.no_grad():
        expected = build_sampler(CONTRACT).sample(method.student, Conditioning(text), LATENT_SHAPE, method.rng, initial=noise)
    torch.testing.assert_close(group.x0, expected, rtol=0, atol=0)
    assert torch.equal(group.cond["text_embeds"], text)
    # scored by the reward on the decoded frames, then normalised within each prompt's k rollouts
    videos = BaseEncoders(shipped_tiny_base(), text_encoder=False).decode_latents(expected)
    reward = AdherenceReward(AdherenceRewardConfig(folder=str(shipped_tiny_base())))
    scores = torch.tensor(reward(videos, [raw["captions"][int(i)] for i in rows]), dtype=torch.float32)
    torch.testing.assert_close(group.advantages, group_advantages(scores.view(2, k)).view(-1))
    assert float(plan.metrics["reward"]) == pytest.approx(float(scores.mean()))
    assert float(plan.metrics["reward/adherence"]) == pytest.approx(float(scores.mean()))
    # the step: one minibatch (grad_accum_steps 1) × the contract's first int(3 · 0.99) = 2 timesteps
    assert len(plan.micro_steps) == 2 and len(method.points) == 2
    assert [p.t for p in method.points] == CONTRACT["timesteps"][:2]
    outs = []
    for micro in plan.micro_steps:
        out = micro()
        method.backward(out, grad_accum_rounds=len(plan.micro_steps))
        outs.append(out)
    # old policy = reference = student at the start: no deviation, no KL; the policy loss pulls by advantage
    for out in outs:
        assert float(out.losses["old_deviation"]) == 0.0 and float(out.losses["kl_loss"]) == 0.0
        assert torch.isfinite(out.losses["total_loss"])
    grads = [p.grad for p in method.student.transformer.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(float(g.abs().max()) > 0 for g in grads)


def test_the_updates_of_a_group_cover_it_and_the_old_policy_follows_the_student(grammar_set, tmp_path):
    raw = nft_config(grammar_set, tmp_path, batch_size=2, knobs={"minibatch_size": 3, "inner_epochs": 2})
    raw["training"]["loop"]["grad_accum_steps"] = 2
    method = make_method(raw)
    assert (method.group_size, method.minibatches, method.updates_per_group) == (6, 2, 2)
    stream = batches(grammar_set, 2)
    student = method.student.transformer
    seen: list[list[int]] = []
    for step in (1, 2):
        plan = method.plan_step(stream, step)
        assert len(plan.micro_steps) == 2 * 2  # two minibatches × two timesteps
        order = method.group.orders[step - 1]
        assert sorted(order.tolist()) == list(range(6))  # each epoch's order is a permutation ...
        for p in range(2):  # ... that keeps each prompt's samples in its own block
            assert sorted(order[3 * p: 3 * p + 3].tolist()) == [3 * p, 3 * p + 1, 3 * p + 2]
        seen.append(sorted(order[m::2].tolist() for m in range(2)))
        for micro in plan.micro_steps:
            method.backward(micro(), grad_accum_rounds=4)
        method.optimizers_step(step)
        method.zero_grad(step)
    assert all(sorted(i for mb in epoch for i in mb) == list(range(6)) for epoch in seen)  # the minibatches partition it
    old = {n: t.clone() for n, t in method.shadows["old"].tensors["transformer"].items()}
    live = {n: p.detach().clone() for n, p in student.named_parameters()}
    assert any(not torch.equal(old[n], live[n]) for n in old)  # the student moved, the old policy did not yet
    method.plan_step(stream, 3)  # group 2: the old policy first moves toward the student (decay 0.001 after group 1)
    assert method.group.index == 2
    for n, t in method.shadows["old"].tensors["transformer"].items():
        torch.testing.assert_close(t, torch.lerp(old[n], live[n], 1 - 0.001), rtol=0, atol=1e-7)


# -- the rewards -----------------------------------------------------------------------------------------
def test_the_adherence_reward_gives_a_third_per_attribute_read_back():
    from distillery.clips.grammar import format_caption
    from distillery.clips.synthetic import ClipSetConfig, plan_clips, render_clip
    from distillery.rewards.adherence import AdherenceReward, AdherenceRewardConfig

    cfg = ClipSetConfig(num_train=6, num_validation=0, num_frames=9)
    specs = plan_clips(cfg)[:3]
    videos = np.stack([render_clip(s, cfg) for s in specs])
    reward = AdherenceReward(AdherenceRewardConfig(folder=str(shipped_tiny_base())))
    right = [s.caption for s in specs]
    assert reward(videos, right).tolist() == [1.0, 1.0, 1.0]
    from dataclasses import replace

    other_colour = {"red": "blue", "blue": "green", "green": "red", "yellow": "red", "white": "red"}
    other_dir = {"left": "right", "right": "left", "up": "down", "down": "up"}
    one_wrong = [format_caption(replace(s.attrs, colour=other_colour.get(s.attrs.colour, "red"))) for s in specs]
    two_wrong = [format_caption(replace(s.attrs, colour=other_colour.get(s.attrs.colour, "red"),
                                        direction=other_dir[s.attrs.direction])) for s in specs]
    assert reward(videos, one_wrong).tolist() == pytest.approx([2 / 3] * 3)
    assert reward(videos, two_wrong).tolist() == pytest.approx([1 / 3] * 3)
    only_colour = AdherenceReward(AdherenceRewardConfig(folder=str(shipped_tiny_base()), attributes=["colour"]))
    assert only_colour(videos, one_wrong).tolist() == [0.0] * 3
    with pytest.raises(UserError, match="not one"):
        reward(videos[:1], ["a purple elephant dancing"])


def _preference_folder(where: Path, seed: int = 0) -> Path:
    """A CLIP-based image classifier in transformers' layout: random tiny weights of the real class
    (``CLIPForImageClassification``, 3 labels) and its ``CLIPImageProcessor`` (32-px crops)."""
    from transformers import CLIPConfig, CLIPForImageClassification, CLIPImageProcessor

    torch.manual_seed(seed)
    vision = dict(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = CLIPConfig(vision_config=vision, text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                               num_attention_heads=2), projection_dim=8,
                        id2label={0: "bad", 1: "aesthetic", 2: "neutral"}, label2id={"bad": 0, "aesthetic": 1, "neutral": 2})
    CLIPForImageClassification(config).save_pretrained(where)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(where)
    return where


def test_clip_and_preference_rewards_are_their_definitions(tmp_path):
    from transformers import AutoImageProcessor, CLIPForImageClassification

    from distillery.evaluation.clip_scores import ClipScorer
    from distillery.rewards.clip import ClipTextReward, ClipTextRewardConfig
    from distillery.rewards.preference import ImagePreferenceReward, ImagePreferenceRewardConfig

    rng = np.random.default_rng(0)
    videos = rng.integers(0, 256, size=(2, 5, 32, 48, 3), dtype=np.uint8)
    clip = make_clip_folder(tmp_path / "clip", 0)
    scorer = ClipScorer(clip)
    every = ClipTextReward(ClipTextRewardConfig(model_from=str(clip)))(videos, CAPTIONS[:2])
    assert every.tolist() == pytest.approx([scorer.score(v, p)["clip_text"] for v, p in zip(videos, CAPTIONS[:2])], abs=1e-6)
    first = ClipTextReward(ClipTextRewardConfig(model_from=str(clip), frames="first"))(videos, CAPTIONS[:2])
    assert first.tolist() == pytest.approx([scorer.score(v[:1], p)["clip_text"] for v, p in zip(videos, CAPTIONS[:2])], abs=1e-6)

    folder = _preference_folder(tmp_path / "pref")
    model = CLIPForImageClassification.from_pretrained(folder).eval()
    processor = AutoImageProcessor.from_pretrained(folder)
    with torch.no_grad():
        by_hand = [float(model(**processor(images=list(v[::2]), return_tensors="pt")).logits.softmax(-1)[:, 1].mean())
                   for v in videos]
    reward = ImagePreferenceReward(ImagePreferenceRewardConfig(model_from=str(folder), label="aesthetic", frames="all",
                                                               frame_stride=2))
    assert reward(videos, ["", ""]).tolist() == pytest.approx(by_hand, abs=1e-6)
    assert ImagePreferenceReward(ImagePreferenceRewardConfig(model_from=str(folder), label="aesthetic")).config.frames == "first"


def _reward_config(grammar_set: Path, tmp_path: Path, reward: dict) -> dict:
    return nft_config(grammar_set, tmp_path, rewards={"r": reward})


@pytest.mark.parametrize("reward, message", [
    ({"_target_": "os.system"}, "outside the allowed prefixes"),
    ({"_target_": "distillery.rewards.adherence.NoSuchReward"}, "does not exist"),
    ({"_target_": "distillery.methods.sft.SFTMethod"}, "is not a distillery reward"),
    ({"_target_": ADHERENCE, "folder": "/nonexistent"}, "analyzer.json does not exist"),
    ({"_target_": ADHERENCE, "folder": "SHIPPED", "frames": "first"}, "cannot be scored"),
    ({"_target_": "distillery.rewards.clip.ClipTextReward", "model_from": "SHIPPED"}, "has no config.json|not a CLIPModel"),
    ({"_target_": "distillery.rewards.preference.ImagePreferenceReward", "model_from": "SHIPPED"}, "config.json"),
])
def test_a_bad_reward_is_one_line_when_the_config_is_built(grammar_set, tmp_path, reward, message):
    reward = {k: (str(shipped_tiny_base()) if v == "SHIPPED" else v) for k, v in reward.items()}
    with pytest.raises(UserError, match=message) as err:
        load_run_config(raw=_reward_config(grammar_set, tmp_path, reward), prefixes=allowed_prefixes())
    assert "\n" not in str(err.value) and "method.rewards.r" in str(err.value)


def test_a_reward_folder_that_does_not_load_or_a_label_it_lacks_is_one_line(grammar_set, tmp_path):
    folder = _preference_folder(tmp_path / "pref")
    target = "distillery.rewards.preference.ImagePreferenceReward"
    with pytest.raises(UserError, match="label 'pretty' is not one of"):
        load_run_config(raw=_reward_config(grammar_set, tmp_path, {"_target_": target, "model_from": str(folder),
                                                                    "label": "pretty"}), prefixes=allowed_prefixes())
    with pytest.raises(UserError, match="has 3 outputs"):
        load_run_config(raw=_reward_config(grammar_set, tmp_path, {"_target_": target, "model_from": str(folder)}),
                        prefixes=allowed_prefixes())
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors")  # corrupt weights
    raw = _reward_config(grammar_set, tmp_path, {"_target_": target, "model_from": str(folder), "label": "aesthetic"})
    with pytest.raises(UserError, match="does not load") as err:
        make_method(raw)  # the layout passes; the weights load when the method starts
    assert "\n" not in str(err.value)


def test_a_reward_that_returns_nan_stops_the_rollout_in_one_line(grammar_set, tmp_path, monkeypatch):
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    monkeypatch.setenv("DISTILLERY_ALLOWED_TARGET_PREFIXES", "nan_reward")
    raw = _reward_config(grammar_set, tmp_path, {"_target_": "nan_reward.NaNReward"})
    method = make_method(raw)
    with pytest.raises(UserError, match=r"reward r returned nan for the sample of prompt 'a red circle") as err:
        method.plan_step(batches(grammar_set, 2), 1)
    assert "\n" not in str(err.value)
    sys.modules.pop("nan_reward", None)


def test_the_points_follow_the_contract_and_a_causal_student_is_refused(grammar_set, tmp_path):
    from distillery.methods.rl.policy import train_points
    from distillery.models.wan import CausalWanModel, CausalWanModelConfig, PDDWanModel, PDDWanModelConfig

    base = str(shipped_tiny_base())
    pdd = PDDWanModel(PDDWanModelConfig(init_from=base, pdd_steps=4), "student")
    points = train_points({"sampler": "pdd_fused", "shift": 3.0, "pdd_steps": 4, "num_steps": 2}, pdd, None, 1.0)
    sigmas = pdd.schedule.inference_sigmas(4)
    assert [p.t for p in points] == pytest.approx([float(sigmas[0]) * 1000, float(sigmas[2]) * 1000])
    from distillery.models.base import Conditioning

    x, cond = torch.randn(1, *LATENT_SHAPE), Conditioning(torch.randn(1, 8, 32))
    with torch.no_grad():
        t = torch.tensor([points[1].t])
        assert torch.equal(points[1].velocity(pdd, x, t, cond), pdd.predict_pdd_fused(x, t, cond, 2, 4))
    causal = CausalWanModel(CausalWanModelConfig(init_from=base, chunk_size=2), "student")
    with pytest.raises(UserError, match="KV cache"):
        train_points({"sampler": "causal_streaming", "chunk_size": 2, "shift": 3.0}, causal, None, 1.0)
    with pytest.raises(UserError, match="does not divide a rank's rollout group"):
        make_method(nft_config(grammar_set, tmp_path, knobs={"minibatch_size": 4}))
    with pytest.raises(UserError, match="has no vae/ folder"):
        make_method(nft_config(grammar_set, tmp_path, knobs={"vae_from": str(tmp_path)}))


@pytest.mark.parametrize(("key", "what"), [("sp_size", "sequence"), ("tp_size", "tensor")])
def test_sequence_and_tensor_parallelism_are_refused_from_the_config(grammar_set, tmp_path, key, what):
    """Its rollouts decode and score on every rank of a group, untested there: refused before any model loads."""
    from distillery.engine.builder import check_roles_early

    raw = nft_config(grammar_set, tmp_path)
    raw["training"]["distributed"] = {key: 2}
    with pytest.raises(UserError, match=f"{key}: 2, but DiffusionNFTMethod does not take {what} parallelism"):
        check_roles_early(load_run_config(raw=raw, prefixes=allowed_prefixes()))


@pytest.mark.parametrize("student", ["teacher", "pdd"])
def test_a_teacher_and_a_pdd_student_are_post_trained_on_their_own_schedule(grammar_set, tmp_path, student):
    """The many-step teacher samples its group with Euler and trains at its grid's timesteps; the PDD student samples
    with its fused blocks and trains each block's fused velocity (its head bank gets gradients)."""
    if student == "teacher":
        raw = nft_config(grammar_set, tmp_path, knobs={"sampling": None, "rollout_steps": 3})
    else:
        raw = nft_config(grammar_set, tmp_path, knobs={"sampling": {"sampler": "pdd_fused", "shift": 3.0, "num_train_timesteps": 1000,
                                                                    "pdd_steps": 4, "num_steps": 2}, "timestep_fraction": 1.0})
        raw["models"]["student"].update(_target_="distillery.models.wan.PDDWanModel", pdd_steps=4)
    config = load_run_config(raw=raw, prefixes=allowed_prefixes())
    model = config.models["student"].cls(config.models["student"].config, "student")
    model.bind_device(torch.device("cpu"))
    method = DiffusionNFTMethod(config.method.config, {"student": model}, config.training, plugins=config.method.plugins)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    schedule = model.schedule
    if student == "teacher":
        assert method.sampling_contract()["sampler"] == "euler"
        assert [p.t for p in method.points] == pytest.approx(schedule.inference_timesteps(3).tolist()[:2])
    else:
        sigmas = schedule.inference_sigmas(4)
        assert [p.t for p in method.points] == pytest.approx([float(sigmas[0]) * 1000, float(sigmas[2]) * 1000])
    plan = method.plan_step(batches(grammar_set, 2), 1)
    assert "reward" in plan.metrics and method.group.x0.shape == (6, *LATENT_SHAPE)
    for micro in plan.micro_steps:
        method.backward(micro(), grad_accum_rounds=len(plan.micro_steps))
    for name, module in model.trainable_modules().items():
        grads = [p.grad for p in module.parameters() if p.requires_grad and p.grad is not None]
        assert grads and any(float(g.abs().max()) > 0 for g in grads), name
