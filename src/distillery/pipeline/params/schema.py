"""The typed schema of ``params.yaml``: every key a stage reads, its type, its default and its range.

Absent keys take the defaults below, which are the values of the shipped ``params.yaml``. The file is read
into these sections, checked whole and with the rules that tie keys together, by
:func:`distillery.pipeline.params.loading.validate_params`.

Each section is a dataclass converted by the run configs' converter
(:func:`distillery.config.typed.from_mapping`: one set of type rules, one set of bounds). A field is
declared with :func:`rule`: its default, its range (``low``/``high``, as
:func:`distillery.config.typed.bounded`) and, where the range alone does not say it, a ``check``
returning what is wrong with the value as written (4k+1 frames, a host:port, a range worded as ``in
[0, 1]``), run before the range. The keys each stage reads are its dvc.yaml ``params:`` list
(:func:`distillery.pipeline.dvcfile.stage_params`).

A training stage's section (:class:`TrainingStageParams`) holds the knobs every recipe of the stage
takes and makes the run-config sections they set (:meth:`TrainingStageParams.training`: typed values
into typed sections, no key between them); its ``method`` names the recipe
(``stages/recipes/<stage>/<method>.py``, whose ``Params`` subclasses the section with the recipe's
own knobs: they are read only while it is chosen, and held to their declaration whenever the file
writes them). A subclass changes a default with :func:`~distillery.config.typed.with_default`,
keeping the field's rule. What ties a section's keys together wrongly is its :meth:`~TrainingStageParams.problem`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from distillery.config.attention import DEFAULT_SPARSITY, DEFAULT_TILE, MAX_SPARSITY, MAX_TILE_SIDE, Attention, three_sizes
from distillery.config.limits import path_problem, show
from distillery.config.schema import (  # the run config's: params feed them
    MAX_LEARNING_RATE,
    MAX_LORA_RANK,
    MAX_SEED,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    LoopConfig,
    LoraConfig,
    ModelRuntimeConfig,
    OptimizerConfig,
    TrackerConfig,
    TrainingConfig,
    t_list_problem,
)
from distillery.config.typed import Check, bounded, positive_finite, with_default
from distillery.config.validation import MAX_PROMPTS

TRAINING_STAGES = ("teacher", "pretrain", "distill", "pdd", "posttrain")  # the stages that train a model, in DAG order; export picks one
DATA_ARTIFACT = "latents"  # the stage whose data/ a training stage trains on unless its section says otherwise
# Upper bounds: far beyond any real run, low enough that what they size (a tensor, a loop) fits a
# machine.
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
    """Every guidance knob's one rule (pretrain's trajectories, distill's real score, pdd's targets,
    validate's teacher baselines): 1 is the conditional model alone, above 1 CFG ``u + w (c − u)``.
    A scale below 1 is refused: the samplers (:func:`distillery.sampling.base.guide`) run the
    conditional model alone for every w ≤ 1, so w = 0.5 would be recorded while w = 1 ran."""
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


# What a path key's default stands for, written as the path it is: dvc.yaml names these keys as
# dependencies of the
# stage reading them (``${latents.data}``), so DVC hashes what they name — a caption edited in one's
# own videos, a given
# teacher's weights swapped — and reruns the stage; a dependency is never null (DVC cannot name an
# empty one).
SHIPPED_TINY_BASE = "src/distillery/assets/tiny-wan"  # base.path: the fitted tiny Wan shipped in the package (the clone's)
CLIPS_VIDEOS = "artifacts/clips/data"  # latents.data: the clips stage's captioned videos
BASE_MODEL = "artifacts/base/model"  # teacher.path, pretrain.path: the base artifact's model


def given_path(value: str, stands_for: str) -> str | None:
    """``value`` as given, or None when it names ``stands_for`` (the in-tree default of its key:
    nothing given)."""
    return None if os.path.normpath(value) == os.path.normpath(stands_for) else value


def dependency_path(stands_for: str) -> Check:
    """The rule of a path key dvc.yaml makes a dependency (above): a usable path, never null — which
    names the default it stands for."""
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


def rule(default: Any, low: float | None = None, high: float | None = None, check: Check | None = None) -> Any:
    """A schema field: its default (a list default is copied per instance), its range and its check.
    """
    if isinstance(default, list):
        return bounded(low=low, high=high, check=check, default_factory=lambda: list(default))
    return bounded(default, low, high, check=check)


def timestep(v: float) -> str | None:
    """A timestep of the 1000 training timesteps, ``[0, 1000)`` (0: clean)."""
    return None if 0 <= v < MAX_TIMESTEP else f"must be in [0, {MAX_TIMESTEP:g}): a timestep"


def trajectory_points(v: list[float]) -> str | None:
    """``pretrain.t_list``: the KD method's own rule (:func:`distillery.config.schema.t_list_problem`).
    """
    return t_list_problem(v, MAX_TIMESTEP)


# -- the sections -------------------------------------------------------------------------------
@dataclass
class GpusParams:
    nproc_per_node: int = rule(1, 1, MAX_GPUS_PER_NODE)  # processes (GPUs) per node that torchrun starts
    nnodes: int = rule(1, 1, MAX_NODES)  # nodes: one torchrun agent each (pipeline/launch/launcher.py)
    launcher: Literal["local", "slurm"] = "local"  # local: the agents on this machine; slurm: srun over the stage's Slurm allocation
    rdzv_endpoint: str | None = rule(None, check=host_port)  # host:port of the c10d rendezvous; null: the stage serves it (a free port here)
    replicate_size: int = rule(1, 1, MAX_NODES * MAX_GPUS_PER_NODE)  # HSDP: copies of each trained model (1: FSDP over every GPU; nnodes: one per node)
    sp_size: int = rule(1, 1, MAX_GPUS_PER_NODE)  # sequence parallelism (Ulysses): a sample's tokens over this many GPUs of a node (a stage's sp_size wins)
    tp_size: int = rule(1, 1, MAX_GPUS_PER_NODE)  # tensor parallelism: each block's heads and FFN over this many GPUs of a node (a stage's tp_size wins)

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
    """A training stage's section: the knobs every recipe of the stage takes (a recipe's own knobs are
    declared with it, on its ``Params``: a subclass of its stage's section in
    ``stages/recipes/<stage>/<method>.py``), and the run-config sections they make
    (:meth:`training`, :meth:`student_lora`, :meth:`ema`): a knob's meaning in the run config is
    written here once, as code."""

    method: str = rule("sft")  # the stage's recipe: a module of stages/recipes/<stage>/ (validate_params checks it is one)
    steps: int = rule(120, 1, MAX_STEPS)  # optimizer steps of the stage's run
    batch_size: int = rule(16, 1, MAX_BATCH)  # samples per rank per step
    learning_rate: float = rule(2.0e-4, 0, MAX_LEARNING_RATE, positive_finite)  # peak learning rate
    lr_scheduler: Literal["constant", "cosine", "linear"] = rule("cosine")  # the decay after warmup
    warmup_steps: int = rule(10, 0, MAX_STEPS)  # linear warmup from 0 over this many optimizer steps
    weight_decay: float = rule(0.0, 0.0, MAX_WEIGHT_DECAY, non_negative_finite)  # AdamW's decoupled weight decay (every trained role)
    ema_decay: float | None = rule(None, 0.0, 1.0, optional(ema_decay_range))  # EMA of the trained model; null: off; on: the artifact ships the EMA weights
    ema_start_step: int = rule(0, 0, MAX_STEPS)  # with EMA on: the shadow copies the weights until this optimizer step, then averages
    save_every: int = rule(40, 0, MAX_STEPS)  # steps between checkpoints (0: only the final one)
    activation_checkpointing: bool = rule(False)  # recompute block activations in backward (real-shape causal/distill runs need it on one GPU)
    activation_checkpointing_fraction: float = rule(1.0, 0.0, 1.0)  # the share of blocks recomputed (evenly spread; 1: all)
    lora_rank: int = rule(0, 0, MAX_LORA_RANK)  # 0: the model's full weights train; > 0: a LoRA adapter of this rank on it (docs/training.md)
    lora_alpha: float | None = rule(None, 0.0, 65536.0, optional(positive_finite))  # the LoRA update's scale is alpha / rank; null: alpha = rank
    sp_size: int | None = rule(None, 1, MAX_GPUS_PER_NODE)  # this stage's sequence-parallel group (GPUs per sample); null: gpus.sp_size
    tp_size: int | None = rule(None, 1, MAX_GPUS_PER_NODE)  # this stage's tensor-parallel group; null: gpus.tp_size (not with a LoRA)
    # the trained student's self-attention: sparse (trained block-sparse video attention, docs/training.md) | dense |
    # auto (as its init trained: its config.json's record, dense without one)
    attention: Attention = rule("auto")
    sparsity: float = rule(DEFAULT_SPARSITY, 0.0, MAX_SPARSITY)  # attention sparse: the share of the key tiles each query tile skips
    sparse_tile: list[int] = rule(list(DEFAULT_TILE), 1, MAX_TILE_SIDE, three_sizes)  # attention sparse: a tile's tokens (frames, rows, columns)

    def training(self, run: Any, *, unconditional: Literal["empty", "negative"] = "empty",
                 **optimizer: Any) -> TrainingConfig:
        """The run's ``training`` section: the stage's knobs (steps, batch, the optimizer's,
        checkpoints, activation checkpointing), ``run``'s facts (a
        :class:`distillery.pipeline.launch.run_config.RunInputs`: data, seed, output folder, MLflow
        run, HSDP) and the recipe's own choices — the CFG ``unconditional`` prompt and
        ``optimizer``: further :class:`~distillery.config.schema.OptimizerConfig` fields (``betas``,
        ``min_lr_ratio``)."""
        return TrainingConfig(
            distributed=DistributedConfig(replicate_size=run.replicate_size, sp_size=run.sp_size, tp_size=run.tp_size),
            data=DataConfig(path=run.data, batch_size=self.batch_size, text_max_length=run.text_max_length,
                            unconditional=unconditional, latent_shape=run.latent_shape),
            optimizer=OptimizerConfig(learning_rate=self.learning_rate, weight_decay=self.weight_decay,
                                      lr_scheduler=self.lr_scheduler, warmup_steps=self.warmup_steps, **optimizer),
            loop=LoopConfig(max_train_steps=self.steps, seed=run.seed, log_every=1),
            checkpoint=CheckpointConfig(output_dir=run.output_dir, save_every=self.save_every, keep_last=2),
            tracker=TrackerConfig(parent_run_id=run.parent_run_id, run_name=run.stage, tags={"distillery.stage": run.stage}),
            model=ModelRuntimeConfig(activation_checkpointing=self.activation_checkpointing,
                                     activation_checkpointing_fraction=self.activation_checkpointing_fraction))

    def layout(self, gpus: GpusParams) -> dict[str, int]:
        """The run's sequence- and tensor-parallel group sizes, ``{"sp_size": S, "tp_size": T}``: the section's own,
        else ``gpus``' (every training stage's)."""
        return {"sp_size": gpus.sp_size if self.sp_size is None else self.sp_size,
                "tp_size": gpus.tp_size if self.tp_size is None else self.tp_size}

    def student_lora(self) -> LoraConfig | None:
        """The exported role's LoRA adapter (``lora_rank`` > 0: it trains instead of the full weights,
        and the artifact ships it beside the merged weights; the run config's default target
        modules), None at rank 0."""
        if self.lora_rank <= 0:
            return None
        return LoraConfig(rank=self.lora_rank, alpha=float(self.lora_rank if self.lora_alpha is None else self.lora_alpha))

    def student_attention(self) -> dict[str, Any]:
        """The trained student's attention knobs as its Wan plugin's config fields: none for ``auto`` (the plugin's
        default: as its init trained), ``attention: dense``, or ``attention: sparse`` with ``sparsity`` and
        ``sparse_tile`` (read only then)."""
        if self.attention == "auto":
            return {}
        if self.attention == "dense":
            return {"attention": "dense"}
        return {"attention": "sparse", "sparsity": float(self.sparsity), "sparse_tile": [int(v) for v in self.sparse_tile]}

    def ema(self) -> tuple[float, int] | None:
        """``(decay, start step)`` of the EMA of the trained model the artifact ships, None without
        one."""
        return None if self.ema_decay is None else (float(self.ema_decay), int(self.ema_start_step))

    def given(self) -> bool:
        """Whether the stage publishes a given model untrained (``teacher.source: base``) instead of
        training one."""
        return False

    def off(self) -> bool:
        """Whether the stage is switched off (``posttrain.enabled: false``): it publishes no model, only a
        record that it was off (validate leaves it out, export refuses it)."""
        return False

    def data_artifact(self) -> str:
        """The stage whose ``data/`` the run trains on (or whose prompts a recipe's data is made from).
        """
        return DATA_ARTIFACT

    def problem(self, stage: str) -> str | None:
        """What ties this section's keys together wrongly (one line after ``<file>: ``), or None."""
        return None


@dataclass
class TeacherParams(TrainingStageParams):
    method: str = with_default(TrainingStageParams, "method", "sft")  # sft (stages/recipes/teacher/)
    source: Literal["sft", "base"] = rule("sft")  # sft: a fine-tune of the base on the latents; base: a given model (teacher.path, else the base) as is
    # source base: a Wan diffusers folder (e.g. the 14B beside a 1.3B base); the default: the base's
    path: str | None = rule(BASE_MODEL, check=dependency_path(BASE_MODEL))

    def given(self) -> bool:
        return self.source == "base"

    def problem(self, stage: str) -> str | None:
        if given_path(self.path, BASE_MODEL) is not None and self.source != "base":
            return (f"{stage}.path: {self.path}: a given teacher needs {stage}.source: base ({stage}.source: sft "
                    "fine-tunes base.path)")
        return None


@dataclass
class PretrainParams(TrainingStageParams):
    method: str = with_default(TrainingStageParams, "method", "dfsft")  # dfsft | ode_init | ode_init_bidirectional (stages/recipes/pretrain/)
    # latent frames that share one timestep (Diffusion-Forcing); the causal student attends
    # block-causally over them
    # (the causal recipes' student; distill's self_forcing student attends over the same chunks)
    chunk_size: int = rule(1, 1, MAX_LATENT_FRAMES)
    student_init: Literal["teacher", "base"] = rule("teacher")  # the student's init: the teacher artifact, or the base (a given, larger teacher)
    data: Literal["latents", "prompts"] = rule("latents")  # the data it trains on, or (ode_init) whose prompts the trajectories start from
    # train: made by pretrain.method; given: pretrain.path published as is — e.g. the Self-Forcing
    # repo's ode_init.pt
    # after `distillery import-weights` (docs/training.md) — the init of distill, nothing trained
    source: Literal["train", "given"] = rule("train")
    path: str | None = rule(BASE_MODEL, check=dependency_path(BASE_MODEL))  # source given: that folder (import-weights' output, or a diffusers folder)

    def given(self) -> bool:
        return self.source == "given"

    def data_artifact(self) -> str:
        return self.data

    def problem(self, stage: str) -> str | None:
        given = given_path(self.path, BASE_MODEL)
        if (given is None) == (self.source == "given"):
            return f"{stage}.path: {self.path}: " + (
                f"{stage}.source: given needs {stage}.path: the folder to publish as the student (e.g. what `distillery "
                "import-weights ode_init.pt` wrote)" if given is None else
                f"a given student needs {stage}.source: given ({stage}.source: train makes it with {stage}.method)")
        return None


@dataclass
class DistillParams(TrainingStageParams):
    method: str = with_default(TrainingStageParams, "method", "self_forcing")  # self_forcing | dmd2 | phased_dmd (stages/recipes/distill/)
    steps: int = with_default(TrainingStageParams, "steps", 150)
    learning_rate: float = with_default(TrainingStageParams, "learning_rate", 1.0e-4)  # the student's peak learning rate
    lr_scheduler: Literal["constant", "cosine", "linear"] = with_default(TrainingStageParams, "lr_scheduler", "constant")
    warmup_steps: int = with_default(TrainingStageParams, "warmup_steps", 0)
    save_every: int = with_default(TrainingStageParams, "save_every", 50)
    student_steps: int = rule(4, 1, MAX_SAMPLING_STEPS)  # the student's timestep ladder length (its sampling steps)
    # the student's flow shift (warps its ladder); null: its init's
    student_shift: float | None = rule(None, 0, MAX_SHIFT, optional(positive_finite))
    data: Literal["latents", "prompts"] = rule("latents")  # what it trains on: the latents stage's set, or the prompts stage's (text embeddings only)
    # the collapse watch (callbacks/collapse.py): sample the student every this many steps, track saturation,
    # diversity, motion and distance to the teacher's samples against step 0's (0: off)
    collapse_every: int = rule(0, 0, MAX_STEPS)
    stop_on_collapse: bool = rule(False)  # with the watch: a collapse ends the run; the best pre-collapse checkpoint ships

    def data_artifact(self) -> str:
        return self.data

    def problem(self, stage: str) -> str | None:
        if self.stop_on_collapse and not self.collapse_every:
            return (f"{stage}.stop_on_collapse: true needs the collapse watch on: set {stage}.collapse_every (e.g. 50: "
                    "the student sampled every 50 steps)")
        return super().problem(stage)


@dataclass
class PDDParams(TrainingStageParams):
    method: str = with_default(TrainingStageParams, "method", "pdd")  # pdd | dm_pdd (stages/recipes/pdd/)
    steps: int = with_default(TrainingStageParams, "steps", 120)
    learning_rate: float = with_default(TrainingStageParams, "learning_rate", 1.0e-4)  # the student's (trunk and heads) peak learning rate
    lr_scheduler: Literal["constant", "cosine", "linear"] = with_default(TrainingStageParams, "lr_scheduler", "constant")
    warmup_steps: int = with_default(TrainingStageParams, "warmup_steps", 0)
    save_every: int = with_default(TrainingStageParams, "save_every", 40)
    student_init: Literal["teacher", "distill"] = rule("teacher")  # the student starts from the teacher or the distill student
    pdd_steps: int = rule(8, 1, MAX_SAMPLING_STEPS)  # fine-grid intervals = the student's output heads (its most-NFE sampling)
    block_size_min: int = rule(1, 1, MAX_SAMPLING_STEPS)  # block starts are multiples of this (simulate: the carried block)
    block_size_max: int = rule(8, 1, MAX_SAMPLING_STEPS)  # widest block trained; sampling at N NFE needs ⌈pdd_steps / N⌉ ≤ this
    rollout: Literal["data_latent", "simulate"] = rule("simulate")  # carried on-policy trajectories, or noised data at the block start
    integrator: Literal["euler", "midpoint"] = rule("euler")  # the teacher's target over one interval (1 or 2 teacher calls)
    guidance_scale: float = rule(4.0, 0, MAX_GUIDANCE, guidance_at_least_one)  # the teacher's CFG in the targets (distilled in: sampled without); 1: none
    sampling_steps: int = rule(4, 1, MAX_SAMPLING_STEPS)  # the NFE the artifact's sampling contract (and export) default to
    data: Literal["latents", "prompts"] = rule("latents")  # the latents stage's set, or the prompts stage's (rollout: simulate only)

    def data_artifact(self) -> str:
        return self.data

    def problem(self, stage: str) -> str | None:
        if self.data == "prompts" and self.rollout == "data_latent":
            return (f"{stage}.data: prompts: {stage}.rollout data_latent noises video latents, which a prompt-only set has "
                    f"none of; use {stage}.rollout: simulate, or {stage}.data: latents")
        return None


# VBench's dimensions distillery.evaluation.vbench computes (its score.COMPUTED; tests/test_vbench_validate.py holds
# them equal): named here so that params.yaml is checked without importing the evaluation package
VBenchDimension = Literal["subject_consistency", "background_consistency", "temporal_flickering", "motion_smoothness",
                          "aesthetic_quality", "imaging_quality", "dynamic_degree", "overall_consistency"]


def distinct(v: list[Any]) -> str | None:
    repeated = [x for i, x in enumerate(v) if x in v[:i]]
    return f"{show(repeated[0])} is listed twice" if repeated else None


@dataclass
class VBenchModelsParams:
    """The folder of each model VBench's dimensions run (distillery.evaluation.vbench.models: what each holds, where
    the user gets it); null: not given. Only the models of the chosen dimensions are read."""

    dino: str | None = rule(None, check=optional_path)  # subject consistency: DINO ViT-B/16
    clip_b32: str | None = rule(None, check=optional_path)  # background consistency: CLIP ViT-B/32 (transformers' layout)
    clip_l14: str | None = rule(None, check=optional_path)  # aesthetic quality: CLIP ViT-L/14 (transformers' layout)
    aesthetic: str | None = rule(None, check=optional_path)  # aesthetic quality: LAION's linear head
    amt: str | None = rule(None, check=optional_path)  # motion smoothness: AMT-S
    raft: str | None = rule(None, check=optional_path)  # dynamic degree: RAFT (things)
    musiq: str | None = rule(None, check=optional_path)  # imaging quality: MUSIQ (SPAQ)
    viclip: str | None = rule(None, check=optional_path)  # overall consistency: ViCLIP + CLIP's BPE vocabulary

    def given(self) -> dict[str, str]:
        """``{model key: folder}`` of the models given."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v}


@dataclass
class VBenchValidateParams:
    """VBench's dimensions on the headline candidates' validation videos (docs/vbench.md "In the DAG")."""

    dimensions: list[VBenchDimension] = rule([], check=distinct)  # empty: off
    models: VBenchModelsParams = field(default_factory=VBenchModelsParams)


@dataclass
class PosttrainParams(TrainingStageParams):
    """Reward-driven post-training of a few-step student (``posttrain.method``: ``stages/recipes/posttrain/``), off
    unless ``enabled``: the student of ``posttrain.student``'s artifact trained on rollouts of its own, scored by the
    recipe's rewards; the artifact samples as that student did."""

    method: str = with_default(TrainingStageParams, "method", "nft")  # nft (stages/recipes/posttrain/)
    enabled: bool = rule(False)  # off: the stage publishes no model (validate skips it; export.student posttrain refused)
    student: Literal["distill", "pdd"] = rule("distill")  # whose student is post-trained (its weights and sampling.json)
    steps: int = with_default(TrainingStageParams, "steps", 40)
    batch_size: int = with_default(TrainingStageParams, "batch_size", 2)  # prompts per rank in one rollout group
    learning_rate: float = with_default(TrainingStageParams, "learning_rate", 1.0e-5)
    lr_scheduler: Literal["constant", "cosine", "linear"] = with_default(TrainingStageParams, "lr_scheduler", "constant")
    warmup_steps: int = with_default(TrainingStageParams, "warmup_steps", 0)
    save_every: int = with_default(TrainingStageParams, "save_every", 10)
    data: Literal["latents", "prompts"] = rule("latents")  # whose prompts the rollouts start from: the latents' or the prompts stage's

    def off(self) -> bool:
        return not self.enabled

    def data_artifact(self) -> str:
        return self.data


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
    vbench: VBenchValidateParams = field(default_factory=VBenchValidateParams)  # VBench's dimensions; dimensions empty: off


@dataclass
class ExportParams:
    student: Literal[TRAINING_STAGES] = rule("distill")  # which training stage's model is exported
    lora: Literal["merged", "adapter"] = rule("merged")  # a student that trained a LoRA (<stage>.lora_rank > 0): merged weights, or the adapter file alone


@dataclass
class ParamsSchema:
    """The whole params.yaml."""

    seed: int = rule(0, 0, MAX_SEED, seed_range)  # seeds clips, training and validation
    gpus: GpusParams = field(default_factory=GpusParams)
    clips: ClipsParams = field(default_factory=ClipsParams)
    base: BaseParams = field(default_factory=BaseParams)
    latents: LatentsParams = field(default_factory=LatentsParams)
    prompts: PromptsParams = field(default_factory=PromptsParams)
    teacher: TeacherParams = field(default_factory=TeacherParams)
    pretrain: PretrainParams = field(default_factory=PretrainParams)
    distill: DistillParams = field(default_factory=DistillParams)
    pdd: PDDParams = field(default_factory=PDDParams)
    posttrain: PosttrainParams = field(default_factory=PosttrainParams)
    validate: ValidateParams = field(default_factory=ValidateParams)
    export: ExportParams = field(default_factory=ExportParams)
