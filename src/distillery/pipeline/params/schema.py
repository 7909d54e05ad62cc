"""The typed schema of ``params.yaml``: every key a stage reads, its type, its default and its range.

:func:`validate_params` checks the WHOLE file (not only the keys one stage reads) so that
``distillery stage <name>`` refuses a bad value before any stage does work, and names the key as the
user wrote it: ``params.yaml: teacher.steps: -3: must be ≥ 1``. Unknown keys are refused with the
nearest valid key (``did you mean steps?``). Absent keys take the defaults below, which are the
values of the shipped ``params.yaml``.

Each section is a dataclass converted by the run configs' converter
(:func:`distillery.config.typed.from_mapping`: one set of type rules, one set of bounds). A field is
declared with :func:`rule`: its default, its range (``low``/``high``, as
:func:`distillery.config.typed.bounded`) and, where the range alone does not say it, a ``check``
returning what is wrong with the value as written (4k+1 frames, a host:port, a range worded as
``in [0, 1]``), run before the range. The keys each stage reads are its dvc.yaml ``params:`` list
(:func:`distillery.pipeline.dvcfile.stage_params`).

A training stage's knob declares the run-config key(s) it sets (``rule(..., sets="training.optimizer.learning_rate")``),
and, for a knob only one recipe of its stage takes, ``when`` (``{"method": ("self_forcing",)}``: the section's
``method`` is one of these): :func:`run_config_settings` lists them, and the stage's run config takes each
(:meth:`distillery.pipeline.launch.training_table.TrainingStageSpec.config_overrides`) — a knob is its
``params.yaml`` line and its field here. A subclass changes a default with
:func:`~distillery.config.typed.with_default`, keeping the field's rule and keys.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from distillery.common.errors import UserError
from distillery.config.limits import path_problem, show
from distillery.config.schema import MAX_LEARNING_RATE, MAX_LORA_RANK, MAX_SEED, t_list_problem  # the run config's: params feed them
from distillery.config.typed import Check, FieldError, bounded, from_mapping, positive_finite, with_default
from distillery.config.validation import MAX_PROMPTS

TRAINING_STAGES = ("teacher", "pretrain", "distill", "pdd")  # stages that train a model (training_table.TRAINING_STAGES); export picks one
# Upper bounds: far beyond any real run, low enough that what they size (a tensor, a loop) fits a machine.
MAX_GPUS_PER_NODE = 64
MAX_NODES = 1024
MAX_CLIPS = 100_000  # synthetic clips of one set
MAX_FRAMES = 1025  # frames per clip (Wan2.1: 81; 4k+1)
MAX_LATENT_FRAMES = (MAX_FRAMES - 1) // 4 + 1
MAX_PIXELS = 4096  # frame height or width (Wan2.1 at 720p: 1280)
MIN_FPS, MAX_FPS = 1, 240  # frames per second (a video stream's rate must be a ratio of small integers)
MAX_STEPS = 10_000_000  # optimizer steps of one stage
MAX_BATCH = 4096  # samples per rank per step
MAX_ROWS_PER_SHARD = 100_000
MAX_SAMPLING_STEPS = 1000  # a sampler or grid over the 1000 training timesteps (docs/architecture.md §3)
MAX_GUIDANCE = 100.0
MAX_TIMESTEP = 1000.0  # a timestep of the 1000 training timesteps (exclusive)
MAX_SEEDS = 1000
MAX_CURVE = 64  # step counts / NFEs in one validation curve
MAX_WEIGHT_DECAY = 1.0  # AdamW's decoupled weight decay (published recipes: 0.01)
MAX_SHIFT = 100.0  # a flow shift (Wan2.1: 3 at 480p, 5 at 720p and in the Self-Forcing recipe)
MAX_PROMPT_CHARS = 4000  # a negative prompt (Wan's default: 139 characters)


# -- checks: each returns what is wrong with an already type-checked value, or None --------------
# (positive_finite: distillery.config.typed's, the run config's learning rates' own rule too)
def non_negative_finite(v: float) -> str | None:
    return None if math.isfinite(v) and v >= 0 else "must be a finite number ≥ 0"


def guidance_at_least_one(v: float) -> str | None:
    """Every guidance knob's one rule (pretrain's trajectories, distill's real score, pdd's targets, validate's teacher
    baselines): 1 is the conditional model alone, above 1 CFG ``u + w (c − u)``. A scale below 1 is refused: the
    samplers (:func:`distillery.sampling.base.guide`) run the conditional model alone for every w ≤ 1, so w = 0.5 would
    be recorded while w = 1 ran."""
    return None if math.isfinite(v) and v >= 1 else "must be a finite number ≥ 1 (1: no guidance)"


def fraction(v: float) -> str | None:
    return None if 0 <= v <= 1 else "must be in [0, 1]"


def seed_range(v: int) -> str | None:
    return None if 0 <= v <= MAX_SEED else f"must be in [0, {MAX_SEED}]"


def four_k_plus_one(v: int) -> str | None:
    return None if v >= 5 and (v - 1) % 4 == 0 else "must be 4k+1 and ≥ 5 (5, 9, 13, 17, ...): the Wan VAE keeps frame 1 and packs 4 per latent"


def frame_size(v: int) -> str | None:
    return None if v >= 16 and v % 16 == 0 else "must be a positive multiple of 16 pixels (16, 32, 48, ...)"


def optional(check: Check) -> Check:
    """``check`` for a value that may also be null."""
    return lambda v: None if v is None else check(v)


def usable_path(v: str) -> str | None:
    if not v.strip():
        return "must not be empty"
    return path_problem(v)


def optional_path(v: str | None) -> str | None:
    return None if v is None else usable_path(v)


# What a path key's default stands for, written as the path it is: dvc.yaml names these keys as dependencies of the
# stage reading them (``${latents.data}``), so DVC hashes what they name — a caption edited in one's own videos, a given
# teacher's weights swapped — and reruns the stage; a dependency is never null (DVC cannot name an empty one).
SHIPPED_TINY_BASE = "src/distillery/assets/tiny-wan"  # base.path: the fitted tiny Wan shipped in the package (the clone's)
CLIPS_VIDEOS = "artifacts/clips/data"  # latents.data: the clips stage's captioned videos
BASE_MODEL = "artifacts/base/model"  # teacher.path, pretrain.path: the base artifact's model


def given_path(value: str, stands_for: str) -> str | None:
    """``value`` as given, or None when it names ``stands_for`` (the in-tree default of its key: nothing given)."""
    return None if os.path.normpath(value) == os.path.normpath(stands_for) else value


def dependency_path(stands_for: str) -> Check:
    """The rule of a path key dvc.yaml makes a dependency (above): a usable path, never null — which names the
    default it stands for."""
    def check(v: str | None) -> str | None:
        if v is None or v == "tiny":
            return (f"must name a path: dvc.yaml makes it a dependency of the stage that reads it (DVC reruns the stage "
                    f"when a file there changes); the default is {stands_for}")
        return usable_path(v)
    return check


def host_port(v: str | None) -> str | None:
    if v is None:
        return None
    host, sep, port = v.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c.isspace() for c in v):
        return "must be host:port (e.g. node0.cluster:29500, port in 1..65535)"
    return None


def device_name(v: str) -> str | None:
    if v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v):
        return None
    return "must be auto, cpu, cuda or cuda:N"


def step_list(v: list[int]) -> str | None:
    if not v:
        return "must list at least one step count"
    if len(v) > MAX_CURVE:
        return f"at most {MAX_CURVE} step counts"
    bad = [s for s in v if s < 1]
    if bad:
        return f"step counts must be ≥ 1, got {show(bad[0])}"
    big = [s for s in v if s > MAX_SAMPLING_STEPS]
    return f"step counts must be ≤ {MAX_SAMPLING_STEPS}, got {show(big[0])}" if big else None


def ema_decay_range(v: float) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1): shadow ← decay·shadow + (1 − decay)·weights (null: no EMA)"


def prompt_text(v: str) -> str | None:
    if len(v) > MAX_PROMPT_CHARS:
        return f"at most {MAX_PROMPT_CHARS} characters"
    return "must be one line" if "\n" in v or "\r" in v else None


SETS = "sets"  # field metadata: the run-config keys a training stage's knob sets (a tuple)
WHEN = "when"  # field metadata: {sibling field: values}: the knob is set only while the section's sibling is one of them


def rule(default: Any, low: float | None = None, high: float | None = None, check: Check | None = None, *,
         sets: str | tuple[str, ...] = (), when: dict[str, tuple[str, ...]] | None = None) -> Any:
    """A schema field: its default (a list default is copied per instance), its range and its check; for a training
    stage's knob, the run-config key(s) it ``sets`` and ``when`` its recipe takes it (module doc)."""
    facts: dict[str, Any] = {}
    if sets:
        facts[SETS] = (sets,) if isinstance(sets, str) else tuple(sets)
    if when:
        facts[WHEN] = dict(when)
    if isinstance(default, list):
        return bounded(low=low, high=high, check=check, default_factory=lambda: list(default), **facts)
    return bounded(default, low, high, check=check, **facts)


@dataclass(frozen=True)
class Setting:
    """A knob of ``params.yaml`` that sets run-config keys: its dotted ``key``, the run-config keys it ``sets``,
    and ``when``: ``{params key: values}`` that must all hold for its stage's recipe to take it (empty: always)."""

    key: str
    sets: tuple[str, ...]
    when: dict[str, tuple[str, ...]]

    def taken(self, get: Callable[[str], Any]) -> bool:
        """Whether the recipe the params (``get``: a key → its typed value) pick takes this knob."""
        return all(get(key) in values for key, values in self.when.items())


def run_config_settings(section: type, prefix: str) -> list[Setting]:
    """The knobs of the dataclass ``section`` (at the params key ``prefix``; ``""``: the top level) that declare
    the run-config keys they set (:func:`rule`'s ``sets`` and ``when``), in field order."""
    def dotted(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    return [Setting(dotted(f.name), f.metadata[SETS], {dotted(k): v for k, v in f.metadata.get(WHEN, {}).items()})
            for f in dataclasses.fields(section) if f.metadata.get(SETS)]


def trajectory_points(v: list[float]) -> str | None:
    """``pretrain.t_list``: the KD method's own rule (:func:`distillery.config.schema.t_list_problem`)."""
    return t_list_problem(v, MAX_TIMESTEP)


# -- the sections -------------------------------------------------------------------------------
@dataclass
class GpusParams:
    nproc_per_node: int = rule(1, 1, MAX_GPUS_PER_NODE)  # processes (GPUs) per node that torchrun starts
    nnodes: int = rule(1, 1, MAX_NODES)  # nodes: one torchrun agent each (pipeline/launch/launcher.py)
    launcher: Literal["local", "slurm"] = "local"  # local: the agents on this machine; slurm: srun over the stage's Slurm allocation
    rdzv_endpoint: str | None = rule(None, check=host_port)  # host:port of the c10d rendezvous; null: the stage serves it (a free port here)
    replicate_size: int = rule(1, 1, MAX_NODES * MAX_GPUS_PER_NODE)  # HSDP: copies of each trained model (1: FSDP over every GPU; nnodes: one per node)

    @property
    def world_size(self) -> int:
        """The training ranks of a launch: ``nnodes × nproc_per_node``."""
        return self.nnodes * self.nproc_per_node


@dataclass
class ClipsParams:
    num_train: int = rule(96, 1, MAX_CLIPS)  # synthetic training clips
    num_validation: int = rule(24, 0, MAX_CLIPS)  # synthetic validation clips (0: validate on train captions)
    num_frames: int = rule(17, 5, MAX_FRAMES, four_k_plus_one)  # frames per clip (also the latents' and validation videos' length)
    size: int = rule(32, 16, MAX_PIXELS, frame_size)  # frame height = width in pixels (clips, latents, validation)
    fps: float = rule(8.0, MIN_FPS, MAX_FPS, positive_finite)  # frames per second of the clips (and of the latents' resampling)


@dataclass
class BaseParams:
    path: str | None = rule(SHIPPED_TINY_BASE, check=dependency_path(SHIPPED_TINY_BASE))  # the shipped fitted tiny Wan, or a Wan2.1 diffusers folder


@dataclass
class LatentsParams:
    data: str | None = rule(CLIPS_VIDEOS, check=dependency_path(CLIPS_VIDEOS))  # the clips stage's output, or a folder of videos/ + captions
    rows_per_shard: int = rule(64, 1, MAX_ROWS_PER_SHARD)  # caption entries per parquet shard
    max_bad_fraction: float = rule(0.5, 0, 1, fraction)  # fail when more than this fraction of the clips is unusable
    num_frames: int | None = rule(None, 5, MAX_FRAMES, optional(four_k_plus_one))  # frames per latent clip; null: clips.num_frames
    height: int | None = rule(None, 16, MAX_PIXELS, optional(frame_size))  # pixels; null: clips.size (Wan2.1 at 480p: 480)
    width: int | None = rule(None, 16, MAX_PIXELS, optional(frame_size))  # pixels; null: clips.size (Wan2.1 at 480p: 832)
    fps: float | None = rule(None, MIN_FPS, MAX_FPS, optional(positive_finite))  # resampling rate; null: clips.fps
    device: str = rule("auto", check=device_name)  # VAE + text encoder: auto (the GPU when gpus.nproc_per_node >= 1 and CUDA is there), cpu, cuda[:N]
    negative_prompt: str | None = rule(None, check=optional(prompt_text))  # distill's and pdd's teacher CFG unconditional; null: the empty prompt


MAX_PROMPTS_FILE_BYTES = 4 << 30  # distillery.data.prompts.MAX_FILE_BYTES
MAX_PROMPT_LINE_CHARS = 100_000  # distillery.data.prompts.MAX_PROMPT_CHARS


@dataclass
class PromptsParams:
    path: str = rule("src/distillery/assets/prompts/tiny.txt", check=usable_path)  # the prompts file: one a line, or .jsonl ({"prompt": ...} a line)
    rows_per_shard: int = rule(256, 1, MAX_ROWS_PER_SHARD)  # prompts per parquet shard (a changed prompt re-encodes its shard)
    num_frames: int | None = rule(None, 5, MAX_FRAMES, optional(four_k_plus_one))  # frames the rollouts stand for; null: latents.num_frames, else clips'
    height: int | None = rule(None, 16, MAX_PIXELS, optional(frame_size))  # pixels; null: latents.height, else clips.size
    width: int | None = rule(None, 16, MAX_PIXELS, optional(frame_size))  # pixels; null: latents.width, else clips.size
    device: str = rule("auto", check=device_name)  # the text encoder: auto (the GPU when gpus.nproc_per_node >= 1 and CUDA is there), cpu, cuda[:N]
    max_file_bytes: int = rule(1 << 30, 1, MAX_PROMPTS_FILE_BYTES)  # a larger prompts file is refused before it is read
    max_prompt_chars: int = rule(10_000, 1, MAX_PROMPT_LINE_CHARS)  # a longer prompt is refused, naming its line


@dataclass
class TrainingStageParams:
    steps: int = rule(120, 1, MAX_STEPS, sets="training.loop.max_train_steps")  # optimizer steps of the stage's run
    batch_size: int = rule(16, 1, MAX_BATCH, sets="training.data.batch_size")  # samples per rank per step
    learning_rate: float = rule(2.0e-4, 0, MAX_LEARNING_RATE, positive_finite, sets="training.optimizer.learning_rate")  # peak learning rate
    # the decay after warmup (to 0.1 of the peak: the template's min_lr_ratio)
    lr_scheduler: Literal["constant", "cosine", "linear"] = rule("cosine", sets="training.optimizer.lr_scheduler")
    warmup_steps: int = rule(10, 0, MAX_STEPS, sets="training.optimizer.warmup_steps")  # linear warmup from 0 over this many optimizer steps
    # AdamW's decoupled weight decay (every trained role)
    weight_decay: float = rule(0.0, 0.0, MAX_WEIGHT_DECAY, non_negative_finite, sets="training.optimizer.weight_decay")
    ema_decay: float | None = rule(None, 0.0, 1.0, optional(ema_decay_range))  # EMA of the trained model; null: off; on: the artifact ships the EMA weights
    ema_start_step: int = rule(0, 0, MAX_STEPS)  # with EMA on: the shadow copies the weights until this optimizer step, then averages
    save_every: int = rule(40, 0, MAX_STEPS, sets="training.checkpoint.save_every")  # steps between checkpoints (0: only the final one)
    # recompute block activations in backward (real-shape causal/distill runs need it on one GPU)
    activation_checkpointing: bool = rule(False, sets="training.model.activation_checkpointing")
    # the share of blocks recomputed (evenly spread; 1: all)
    activation_checkpointing_fraction: float = rule(1.0, 0.0, 1.0, sets="training.model.activation_checkpointing_fraction")
    lora_rank: int = rule(0, 0, MAX_LORA_RANK)  # 0: the model's full weights train; > 0: a LoRA adapter of this rank on it (docs/training.md)
    lora_alpha: float | None = rule(None, 0.0, 65536.0, optional(positive_finite))  # the LoRA update's scale is alpha / rank; null: alpha = rank


@dataclass
class TeacherParams(TrainingStageParams):
    source: Literal["sft", "base"] = rule("sft")  # sft: a fine-tune of the base on the latents; base: a given model (teacher.path, else the base) as is
    # source base: a Wan diffusers folder (e.g. the 14B beside a 1.3B base); the default: the base's
    path: str | None = rule(BASE_MODEL, check=dependency_path(BASE_MODEL))


@dataclass
class PretrainParams(TrainingStageParams):
    # latent frames that share one timestep (Diffusion-Forcing); the causal student attends block-causally over them
    chunk_size: int = rule(1, 1, MAX_LATENT_FRAMES, sets=("method.chunk_size", "models.student.chunk_size"),
                           when={"method": ("dfsft", "ode_init")})
    student_init: Literal["teacher", "base"] = rule("teacher")  # the causal student's init: the teacher artifact, or the base (a given, larger teacher)
    # dfsft: Diffusion-Forcing SFT on the latents; ode_init: KD onto the teacher's ODE trajectories (a causal student;
    # ode_init_bidirectional: a bidirectional one, distill.method dmd2's init)
    method: Literal["dfsft", "ode_init", "ode_init_bidirectional"] = rule("dfsft")
    t_list: list[float] = rule([999.0, 937.0, 833.0, 624.0, 0.0], 0, MAX_TIMESTEP, check=trajectory_points, sets="method.t_list",
                               when={"method": ("ode_init", "ode_init_bidirectional")})  # ode_init: the trajectory points
    teacher_steps: int = rule(8, 1, MAX_SAMPLING_STEPS)  # ode_init: the teacher's Euler steps (t_list's points added to its grid)
    guidance_scale: float = rule(4.0, 0, MAX_GUIDANCE, guidance_at_least_one)  # ode_init: the teacher's CFG, u + w (c - u)
    seeds_per_prompt: int = rule(1, 1, MAX_SEEDS)  # ode_init: trajectories (noise draws) per prompt
    trajectory_batch_size: int = rule(8, 1, MAX_BATCH)  # ode_init: prompts per teacher batch while generating
    trajectory_rows_per_shard: int = rule(32, 1, MAX_ROWS_PER_SHARD)  # ode_init: trajectories per shard (the unit of resume)
    data: Literal["latents", "prompts"] = rule("latents")  # ode_init: whose prompts the trajectories start from (dfsft: latents)
    # train: made by pretrain.method; given: pretrain.path published as is — e.g. the Self-Forcing repo's ode_init.pt
    # after `distillery import-weights` (docs/training.md) — the init of distill, nothing trained
    source: Literal["train", "given"] = rule("train")
    path: str | None = rule(BASE_MODEL, check=dependency_path(BASE_MODEL))  # source given: that folder (import-weights' output, or a diffusers folder)


def score_ratio(v: float) -> str | None:
    return None if 0 <= v < MAX_TIMESTEP else f"must be in [0, {MAX_TIMESTEP:g}): a timestep"


@dataclass
class DistillParams(TrainingStageParams):
    steps: int = with_default(TrainingStageParams, "steps", 150)
    learning_rate: float = with_default(TrainingStageParams, "learning_rate", 1.0e-4)  # the student's peak learning rate
    lr_scheduler: Literal["constant", "cosine", "linear"] = with_default(TrainingStageParams, "lr_scheduler", "constant")  # the student's and the critic's
    warmup_steps: int = with_default(TrainingStageParams, "warmup_steps", 0)
    save_every: int = with_default(TrainingStageParams, "save_every", 50)
    method: Literal["self_forcing", "dmd2"] = rule("self_forcing")  # self_forcing: causal student rolled out chunk by chunk; dmd2: bidirectional
    student_steps: int = rule(4, 1, MAX_SAMPLING_STEPS, sets="method.num_student_steps")  # the student's timestep ladder length (its sampling steps)
    # the critic's (fake score's) peak learning rate
    critic_learning_rate: float = with_default(TrainingStageParams, "learning_rate", 2.0e-4,
                                               sets=("models.critic.optimizer.learning_rate",))
    # the student steps every k-th step; the critic every step
    generator_update_interval: int = rule(2, 1, 1000, sets="method.generator_update_interval")
    # the teacher's CFG scale in the real score
    guidance_scale: float = rule(4.0, 0, MAX_GUIDANCE, guidance_at_least_one, sets="method.real_score_guidance_scale")
    # self_forcing: timestep of the KV-cached context chunks (0: clean)
    context_noise: float = rule(0.0, 0, MAX_TIMESTEP, score_ratio, sets="method.context_noise", when={"method": ("self_forcing",)})
    critic_init: Literal["teacher", "base"] = rule("teacher")  # the critic's init: the teacher artifact, or the base (the student's; the published recipes')
    # self_forcing: one exit-step draw for every chunk of a rollout (false: one per chunk)
    same_step_across_chunks: bool = rule(False, sets="method.same_step_across_chunks", when={"method": ("self_forcing",)})
    # the student's flow shift (warps its ladder); null: its init's
    student_shift: float | None = rule(None, 0, MAX_SHIFT, optional(positive_finite), sets="models.student.shift")
    data: Literal["latents", "prompts"] = rule("latents")  # what it trains on: the latents stage's set, or the prompts stage's (text embeddings only)


@dataclass
class PDDParams(TrainingStageParams):
    steps: int = with_default(TrainingStageParams, "steps", 120)
    learning_rate: float = with_default(TrainingStageParams, "learning_rate", 1.0e-4)  # the student's (trunk and heads) peak learning rate
    lr_scheduler: Literal["constant", "cosine", "linear"] = with_default(TrainingStageParams, "lr_scheduler", "constant")
    warmup_steps: int = with_default(TrainingStageParams, "warmup_steps", 0)
    save_every: int = with_default(TrainingStageParams, "save_every", 40)
    student_init: Literal["teacher", "distill"] = rule("teacher")  # the student starts from the teacher or the distill student
    # fine-grid intervals = the student's output heads (its most-NFE sampling)
    pdd_steps: int = rule(8, 1, MAX_SAMPLING_STEPS, sets="models.student.pdd_steps")
    block_size_min: int = rule(1, 1, MAX_SAMPLING_STEPS, sets="method.block_size_min")  # block starts are multiples of this (simulate: the carried block)
    # widest block trained; sampling at N NFE needs ⌈pdd_steps / N⌉ ≤ this
    block_size_max: int = rule(8, 1, MAX_SAMPLING_STEPS, sets="method.block_size_max")
    # carried on-policy trajectories, or noised data at the block start
    rollout: Literal["data_latent", "simulate"] = rule("simulate", sets="method.rollout")
    integrator: Literal["euler", "midpoint"] = rule("euler", sets="method.integrator")  # the teacher's target over one interval (1 or 2 teacher calls)
    # the teacher's CFG in the targets (distilled in: sampled without); 1: none
    guidance_scale: float = rule(4.0, 0, MAX_GUIDANCE, guidance_at_least_one, sets="method.teacher_guidance_scale")
    # the NFE the artifact's sampling contract (and export) default to
    sampling_steps: int = rule(4, 1, MAX_SAMPLING_STEPS, sets="method.sampling_steps")
    method: Literal["pdd", "dm_pdd"] = rule("pdd")  # pdd: head regression; dm_pdd: + DMD2's distribution matching against a critic
    # dm_pdd: weight of the distribution-matching term
    dm_weight: float = rule(1.0, 0, MAX_GUIDANCE, non_negative_finite, sets="method.dm_weight", when={"method": ("dm_pdd",)})
    # dm_pdd: the critic's (fake score's) peak learning rate
    critic_learning_rate: float = with_default(TrainingStageParams, "learning_rate", 2.0e-4,
                                               sets=("models.critic.optimizer.learning_rate",), when={"method": ("dm_pdd",)})
    data: Literal["latents", "prompts"] = rule("latents")  # the latents stage's set, or the prompts stage's (rollout: simulate only)


@dataclass
class ValidateParams:
    num_prompts: int = rule(8, 1, MAX_PROMPTS)  # validation captions sampled per model (config.validation.ValidationSampling.num_prompts)
    num_seeds: int = rule(2, 1, MAX_SEEDS)  # noise draws per prompt (spreads are over them)
    teacher_steps: list[int] = rule([40, 8, 4, 2, 1], 1, MAX_SAMPLING_STEPS, step_list)  # the teacher's sampling step counts (the first: the reference)
    pretrain_steps: int = rule(40, 1, MAX_SAMPLING_STEPS)  # the pretrain student's sampling steps
    guidance_scale: float = rule(4.0, 0, MAX_GUIDANCE, guidance_at_least_one)  # CFG scale of the teacher baselines
    pdd_nfe: list[int] = rule([1, 2, 4, 8], 1, MAX_SAMPLING_STEPS, step_list)  # the PDD student's NFE curve (blocks of pdd_steps / NFE)
    device: str = rule("auto", check=device_name)  # auto: the GPU when gpus.nproc_per_node >= 1 and CUDA is there, else cpu
    vae_precision: Literal["auto", "fp32", "bf16"] = rule("fp32")  # the VAE decode's dtype; auto: bf16 on a GPU, fp32 on CPU
    vae_chunk_frames: int | None = rule(None, 1, MAX_LATENT_FRAMES)  # VAE decoder call's latent frames after the first; null: sized to the GPU, 1 on CPU
    compile: bool | None = rule(None)  # compile each transformer block of the candidates; null: on for bf16 on a GPU
    clip_model: str | None = rule(None, check=optional_path)  # a CLIP folder (transformers' layout): CLIP text/consistency + motion scores; null: off


@dataclass
class ExportParams:
    student: Literal["teacher", "pretrain", "distill", "pdd"] = rule("distill")  # which training stage's model is exported
    lora: Literal["merged", "adapter"] = rule("merged")  # a student that trained a LoRA (<stage>.lora_rank > 0): merged weights, or the adapter file alone


@dataclass
class ParamsSchema:
    """The whole params.yaml."""

    seed: int = rule(0, 0, MAX_SEED, seed_range, sets="training.loop.seed")  # seeds clips, training and validation
    gpus: GpusParams = field(default_factory=GpusParams)
    clips: ClipsParams = field(default_factory=ClipsParams)
    base: BaseParams = field(default_factory=BaseParams)
    latents: LatentsParams = field(default_factory=LatentsParams)
    prompts: PromptsParams = field(default_factory=PromptsParams)
    teacher: TeacherParams = field(default_factory=TeacherParams)
    pretrain: PretrainParams = field(default_factory=PretrainParams)
    distill: DistillParams = field(default_factory=DistillParams)
    pdd: PDDParams = field(default_factory=PDDParams)
    validate: ValidateParams = field(default_factory=ValidateParams)
    export: ExportParams = field(default_factory=ExportParams)


# -- validation ---------------------------------------------------------------------------------
def _check_together(params: ParamsSchema, source: str) -> None:
    """Rules that tie keys of a section together."""
    g = params.gpus
    world = g.world_size
    if world % g.replicate_size:
        raise UserError(f"{source}: gpus.replicate_size: {g.replicate_size}: must divide the {world} processes of gpus.nnodes "
                        f"({g.nnodes}) x gpus.nproc_per_node ({g.nproc_per_node})")


def _check_pdd_blocks(params: ParamsSchema, source: str) -> None:
    """The PDD student's block sizes fit its grid, and every NFE it is sampled at (its contract's,
    validate's curve) splits the grid into blocks no wider than it was trained on."""
    p = params.pdd
    if not p.block_size_min <= p.block_size_max <= p.pdd_steps:
        raise UserError(f"{source}: pdd.block_size_max: {p.block_size_max}: need pdd.block_size_min ({p.block_size_min}) "
                        f"≤ block_size_max ≤ pdd.pdd_steps ({p.pdd_steps})")
    for key, values in (("pdd.sampling_steps", [p.sampling_steps]), ("validate.pdd_nfe", params.validate.pdd_nfe)):
        for n in values:
            if n > p.pdd_steps:
                raise UserError(f"{source}: {key}: {n}: more NFE than the {p.pdd_steps} intervals of pdd.pdd_steps")
            wide = -(-p.pdd_steps // n)  # the widest block of models.schedule.block_partition(pdd_steps, n)
            if wide > p.block_size_max:
                raise UserError(f"{source}: {key}: {n}: {n} NFE samples {wide}-interval blocks of the {p.pdd_steps}-interval "
                                f"grid, wider than pdd.block_size_max ({p.block_size_max}) the student is trained on")


def _check_ema(params: ParamsSchema, source: str) -> None:
    """An EMA that starts averaging at or after a stage's last step would ship the raw weights under its name."""
    for stage in TRAINING_STAGES:
        p = getattr(params, stage)
        if p.ema_decay is not None and p.ema_start_step >= p.steps:
            raise UserError(f"{source}: {stage}.ema_start_step: {p.ema_start_step}: must be below {stage}.steps ({p.steps}): "
                            f"an EMA that starts averaging at or after the last step is the raw weights")


def validate_params(data: Any, source: str = "params.yaml") -> ParamsSchema:
    """The typed params of the parsed ``params.yaml`` mapping ``data``; a bad key or value is a one-line UserError.

    Messages start with ``source`` (the file as the user named it) and name the key as written.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{source}: the top level must be a mapping")
    try:
        params = from_mapping(ParamsSchema, data, "")
    except FieldError as exc:  # the converter's facts, worded for params.yaml
        raise UserError(exc.worded(source)) from None
    _check_together(params, source)
    _check_pdd_blocks(params, source)
    _check_ema(params, source)
    if params.pdd.data == "prompts" and params.pdd.rollout == "data_latent":
        raise UserError(f"{source}: pdd.data: prompts: pdd.rollout data_latent noises video latents, which a prompt-only "
                        f"set has none of; use pdd.rollout: simulate, or pdd.data: latents")
    if params.pretrain.data == "prompts" and params.pretrain.method == "dfsft":
        raise UserError(f"{source}: pretrain.data: prompts: pretrain.method {params.pretrain.method} trains on video "
                        f"latents, which a prompt-only set has none of; use pretrain.method: ode_init (its trajectories "
                        f"start from the prompts), or pretrain.data: latents")
    given_student = given_path(params.pretrain.path, BASE_MODEL)
    if (given_student is None) == (params.pretrain.source == "given"):
        raise UserError(f"{source}: pretrain.path: {params.pretrain.path}: " + (
            "pretrain.source: given needs pretrain.path: the folder to publish as the student (e.g. what `distillery "
            "import-weights ode_init.pt` wrote)" if given_student is None else
            "a given student needs pretrain.source: given (pretrain.source: train makes it with pretrain.method)"))
    if given_path(params.teacher.path, BASE_MODEL) is not None and params.teacher.source != "base":
        raise UserError(f"{source}: teacher.path: {params.teacher.path}: a given teacher needs teacher.source: base "
                        f"(teacher.source: sft fine-tunes base.path)")
    return params


# the distill recipes' students and the pretrain recipe each starts from (docs/training.md): Self-Forcing streams a causal
# student (dfsft or ode_init makes one), DMD2 samples a bidirectional one (ode_init_bidirectional makes one)
CAUSAL_PRETRAIN = ("dfsft", "ode_init")
DISTILL_INIT = {"self_forcing": CAUSAL_PRETRAIN, "dmd2": ("ode_init_bidirectional",)}


def chain_notes(params: ParamsSchema) -> list[str]:
    """One line per stage chain that runs but is not a recipe the docs describe: a distill method whose student starts
    from a pretrain student of the other kind (DMD2 from the causal DFSFT student — it then trains that causal student's
    weights as a bidirectional one; Self-Forcing from a bidirectional one). Empty for the recipes; the given-student
    path (``pretrain.source: given``) is the user's to say."""
    wanted = DISTILL_INIT[params.distill.method]
    if params.pretrain.source != "train" or params.pretrain.method in wanted:
        return []
    kind = "causal" if params.pretrain.method in CAUSAL_PRETRAIN else "bidirectional"
    return [f"distill.method: {params.distill.method} starts from pretrain.method: {params.pretrain.method} (a {kind} "
            f"student), not its recipe's init: add -S pretrain.method={wanted[0]} (docs/training.md)"]


def as_written(data: Any, defaults: Any) -> Any:
    """The params as the file wrote them (what DVC records in ``dvc.lock``) with every absent key at its
    default: ``data`` (the validated mapping, or a section of it) over ``defaults`` (the plain defaults)."""
    if isinstance(defaults, dict):
        given = data if isinstance(data, dict) else {}
        return {k: as_written(given[k], v) if k in given else v for k, v in defaults.items()}
    return data


def to_plain(params: ParamsSchema) -> dict[str, Any]:
    """The typed params as a nested mapping (every key present; numbers as the schema types them)."""
    return dataclasses.asdict(params)
