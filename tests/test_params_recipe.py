"""The published recipes' knobs in params.yaml (issue 42): each a bounded key whose default is today's
behaviour, and what each one does, against hand-computed values.

- the schema: the defaults are the shipped file's (EMA off, weight decay 0, one exit step per chunk, the
  init's shift, no negative prompt), and a value out of its range is one line naming the key;
- the student's flow shift warps its ladder: shift 5 gives 1000, 937.5, 833.3, 625 (t = 1000·5u / (1 + 4u)
  at u = 1, 3/4, 1/2, 1/4), the ladder its sampling contract ships; the tiny base's own shift 3 gives
  1000, 900, 750, 500;
- the negative prompt: the latents stage encodes it with the base's text encoder beside the empty
  prompt (the shards do not change), and with ``training.data.unconditional: negative`` (the distill
  and pdd templates) it is what the teacher's unconditional forward sees; with ``empty`` (SFT's caption
  dropout) the empty prompt is.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from helpers import nudge_weights, run_config
from workspace import shipped_params_text

from distillery.common.errors import UserError
from distillery.pipeline.params.loading import validate_params

ROOT = Path(__file__).resolve().parents[1]
WAN_NEGATIVE = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，丑陋的，"
                "残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，"
                "三条腿，背景人很多，倒着走")  # Wan2.1's default negative prompt (docs/training.md gives its source)


def _shipped() -> dict:
    return yaml.safe_load(shipped_params_text())


def _with(**dotted) -> dict:
    data = copy.deepcopy(_shipped())
    for key, value in dotted.items():
        section, leaf = key.split("__")
        data[section][leaf] = value
    return data


def test_the_knobs_default_to_todays_recipe():
    p = validate_params(_shipped())
    for stage in ("teacher", "pretrain", "distill", "pdd"):
        s = getattr(p, stage)
        assert (s.ema_decay, s.ema_start_step, s.weight_decay) == (None, 0, 0.0), stage
    # the schedules the templates held before the keys existed
    assert [(getattr(p, s).lr_scheduler, getattr(p, s).warmup_steps) for s in ("teacher", "pretrain", "distill", "pdd")] == \
        [("cosine", 10), ("cosine", 10), ("constant", 0), ("constant", 0)]
    assert p.distill.same_step_across_chunks is False and p.distill.student_shift is None and p.latents.negative_prompt is None
    assert validate_params(_with(latents__negative_prompt=WAN_NEGATIVE)).latents.negative_prompt == WAN_NEGATIVE


@pytest.mark.parametrize("edit,message", [
    ({"distill__ema_decay": 1.0}, "distill.ema_decay: 1.0: must be in [0, 1)"),
    ({"teacher__ema_decay": -0.1}, "teacher.ema_decay: -0.1: must be in [0, 1)"),
    ({"pdd__ema_decay": 0.99, "pdd__ema_start_step": 120}, "pdd.ema_start_step: 120: must be below pdd.steps (120)"),
    ({"pretrain__weight_decay": 2.0}, "pretrain.weight_decay"),
    ({"distill__lr_scheduler": "step"}, "distill.lr_scheduler"),
    ({"distill__student_shift": 0.0}, "distill.student_shift: 0.0: must be a finite number > 0"),
    ({"distill__same_step_across_chunks": "yes"}, "distill.same_step_across_chunks"),
    ({"latents__negative_prompt": "blurry\nstatic"}, "latents.negative_prompt"),
])
def test_a_knob_out_of_range_is_one_line_naming_it(edit, message):
    with pytest.raises(UserError) as info:
        validate_params(_with(**edit))
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


# -- the student's flow shift ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def training(tiny_base: Path, latent_set: Path):
    from distillery.config import allowed_prefixes, load_run_config

    return load_run_config(raw=run_config(tiny_base, latent_set, Path("unused")), prefixes=allowed_prefixes()).training


def _self_forcing(tiny_base: Path, training, student_shift: float | None, **knobs):
    from distillery.methods.self_forcing import SelfForcingConfig, SelfForcingMethod
    from distillery.models.wan import CausalWanModel, CausalWanModelConfig, WanModel, WanModelConfig

    models = {"student": CausalWanModel(CausalWanModelConfig(init_from=str(tiny_base), trainable=True, chunk_size=1,
                                                             shift=student_shift), "student")}
    for role in ("teacher", "critic"):
        models[role] = WanModel(WanModelConfig(init_from=str(tiny_base), trainable=role == "critic"), role)
    for model in models.values():
        model.bind_device(torch.device("cpu"))
    nudge_weights(models["critic"].transformer)
    method = SelfForcingMethod(SelfForcingConfig(**knobs), models, training)
    method.on_train_start(torch.device("cpu"))
    method.build_optimizers()
    return method


@pytest.mark.parametrize("shift,ladder", [(5.0, [1000.0, 937.5, 2500.0 / 3.0, 625.0]),  # the paper's 999, 937, 833, 624
                                          (None, [1000.0, 900.0, 750.0, 500.0])])  # the tiny base's scheduler: shift 3
def test_the_students_shift_warps_its_ladder_to_the_hand_computed_values(tiny_base, training, shift, ladder):
    method = _self_forcing(tiny_base, training, shift, num_student_steps=4)
    assert method.ladder == pytest.approx(ladder, abs=1e-9)
    contract = method.sampling_contract()
    assert contract["timesteps"] == pytest.approx(ladder, abs=1e-9) and contract["shift"] == (shift or 3.0)
    assert method.teacher.schedule.shift == 3.0  # the teacher's score timesteps keep the base's shift


def test_same_step_across_chunks_draws_one_exit_step_for_every_chunk(tiny_base, training):
    batch = {"latents": torch.zeros(1, 8, 3, 8, 8)}  # 3 latent frames: 3 chunks of 1
    same = _self_forcing(tiny_base, training, None, same_step_across_chunks=True)
    draws = [same.draw_exit_step(batch) for _ in range(16)]
    assert all(len(set(d)) == 1 and len(d) == 3 for d in draws) and len({d[0] for d in draws}) > 1
    apart = _self_forcing(tiny_base, training, None)
    assert any(len(set(apart.draw_exit_step(batch))) > 1 for _ in range(16))


# -- the negative prompt ---------------------------------------------------------------------------
NEGATIVE = "blurry, static, worst quality, extra fingers"


@pytest.fixture(scope="module")
def negative_latents(tmp_path_factory, tiny_base) -> Path:
    from distillery.clips.synthetic import ClipSetConfig, make_clip_set
    from distillery.data.preprocess import PreprocessConfig, preprocess

    clips = make_clip_set(tmp_path_factory.mktemp("clips") / "clips", ClipSetConfig(num_train=4, num_validation=1, num_frames=9))
    out = tmp_path_factory.mktemp("neg") / "lat"
    preprocess(tiny_base, clips, out, PreprocessConfig(num_frames=9, height=32, width=32, fps=8.0, rows_per_shard=4,
                                                       batch_size=4, negative_prompt=NEGATIVE))
    return out


def test_the_latents_stage_encodes_the_negative_prompt_beside_the_empty_one(tmp_path, tiny_base, negative_latents):
    import shutil

    from distillery.data import read_empty_prompt_embedding
    from distillery.data.encoders import BaseEncoders
    from distillery.data.preprocess import PreprocessConfig, preprocess

    enc = BaseEncoders(tiny_base)
    negative, empty = enc.encode_prompts([NEGATIVE, ""])
    assert torch.equal(read_empty_prompt_embedding(negative_latents, "negative"), negative)
    assert torch.equal(read_empty_prompt_embedding(negative_latents), empty)  # the caption-dropout prompt stays ""
    assert not torch.equal(negative[: empty.shape[0]], empty[: negative.shape[0]])
    # another negative prompt into the same folder re-encodes that prompt only (the shards do not depend on it);
    # none removes the file (the unconditional is then the empty prompt)
    out = tmp_path / "lat"
    shutil.copytree(negative_latents, out)
    cfg = PreprocessConfig(num_frames=9, height=32, width=32, fps=8.0, rows_per_shard=4, batch_size=4)
    again = preprocess(tiny_base, _clips_of(negative_latents), out, cfg)
    assert again["clips_this_run"] == 0 and not (out / "negative_prompt.safetensors").exists()
    assert torch.equal(read_empty_prompt_embedding(out, "negative"), empty)


def _clips_of(latents: Path) -> Path:
    import json

    return Path(json.loads((latents / "preprocess.json").read_text())["data"])


def _teacher_texts(method) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    method.teacher.transformer.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(kwargs["encoder_hidden_states"].detach().clone()), with_kwargs=True)
    return seen


@pytest.mark.parametrize("unconditional", ["negative", "empty"])
def test_the_negative_prompt_is_what_the_unconditional_branch_sees(tiny_base, negative_latents, unconditional):
    """The latent set's batches (engine/batches, as the trainer builds them) through one Self-Forcing generator
    step with teacher CFG: the teacher's second forward (the unconditional) gets the negative prompt's
    embedding (padded to the run's text length) under ``unconditional: negative``, the empty prompt's under
    ``empty``; its first forward gets the captions'."""
    from distillery.components.distributed import DistEnv
    from distillery.config import allowed_prefixes, load_run_config
    from distillery.data import pad_prompt_embedding
    from distillery.data.encoders import BaseEncoders
    from distillery.engine.batches import build_batches

    raw = run_config(tiny_base, negative_latents, Path("unused"), batch_size=2)
    raw["training"]["data"].update(text_max_length=32, unconditional=unconditional)
    training = load_run_config(raw=raw, prefixes=allowed_prefixes()).training
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", mesh=None,
                  compute_dtype=torch.float32)
    batch = next(build_batches(negative_latents, training.data, 0, env, with_latents=True))
    method = _self_forcing(tiny_base, training, None, real_score_guidance_scale=3.0, generator_update_interval=1)
    seen = _teacher_texts(method)
    method.single_train_step(batch, 1)
    assert len(seen) == 2, "one conditional and one unconditional teacher forward"
    prompt = NEGATIVE if unconditional == "negative" else ""
    expected = pad_prompt_embedding(BaseEncoders(tiny_base).encode_prompts([prompt])[0], 32, torch.float32)
    assert torch.equal(seen[0], batch["text_embeds"].float())
    assert torch.equal(seen[1], expected.expand_as(seen[1]))


def test_the_profiles_set_wans_negative_prompt_and_the_papers_recipe():
    profiles = {p.name: yaml.safe_load(p.read_text())["overrides"] for p in (ROOT / "docs" / "profiles").glob("*.yaml")}
    for name, overrides in profiles.items():
        if "base.path" in overrides or any(k.startswith("latents.height") for k in overrides):  # a real Wan's profile
            assert overrides.get("latents.negative_prompt") == WAN_NEGATIVE, name
    assert {"wan-1.3b-1gpu.yaml", "wan-1.3b-8gpu.yaml", "self-forcing-paper.yaml", "fastvideo-dmd2.yaml"} <= {
        n for n, o in profiles.items() if o.get("latents.negative_prompt") == WAN_NEGATIVE}
    paper = profiles["self-forcing-paper.yaml"]
    assert {k: paper[k] for k in ("distill.learning_rate", "distill.critic_learning_rate", "distill.weight_decay",
                                  "distill.guidance_scale", "distill.student_shift", "distill.same_step_across_chunks",
                                  "distill.ema_decay", "distill.ema_start_step", "distill.generator_update_interval")} == {
        "distill.learning_rate": 2e-6, "distill.critic_learning_rate": 4e-7, "distill.weight_decay": 0.01,
        "distill.guidance_scale": 4.0, "distill.student_shift": 5.0, "distill.same_step_across_chunks": True,
        "distill.ema_decay": 0.99, "distill.ema_start_step": 200, "distill.generator_update_interval": 5}
