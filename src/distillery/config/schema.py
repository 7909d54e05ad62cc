"""Typed sections of a run config (the ``training:`` block) and the whole ``RunConfig``.

A run config YAML has four top-level keys::

    models:    {role: {_target_: ..., <the model class's config fields>}}
    method:    {_target_: ..., <the method class's config fields>}
    training:  {distributed, data, optimizer, loop, checkpoint, tracker, model}
    callbacks: {name: {_target_: ..., <the callback class's config fields>}}

Every class named by ``_target_`` declares its knobs as a dataclass in ``config_class``. Every number
is bounded (:func:`distillery.config.typed.bounded`; the others by the defaults of that module): a
value past a bound is a one-line error before anything is built, never an allocation the machine
cannot make. A bound is written once, in the field's declaration: a section built in Python rather
than read (``dataclasses.replace``, a test) is held to the same declarations by
:func:`~distillery.config.typed.check_fields` from its ``__post_init__`` (:class:`Checked`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from distillery.config.typed import bounded, check_fields, positive_finite, to_plain, with_default

MAX_STEPS = 1_000_000_000  # optimizer steps of one run
MAX_BATCH = 4096  # samples per rank per micro-batch
MAX_TEXT_TOKENS = 4096  # prompt tokens (Wan2.1's UMT5: 512)
MAX_SEED = 2**32 - 1  # numpy and torch both take seeds in [0, 2**32)
MAX_RANKS = 65536
MAX_LEARNING_RATE = 1e12  # sizes nothing; a diverging loss stops at the first NaN step (the NaN guard)


class Checked:
    """A config section whose fields' declared rules (:func:`~distillery.config.typed.bounded`) hold however it
    is made: read from a file (the converter checks them) or built in Python (``__post_init__`` checks them,
    a :class:`~distillery.config.typed.FieldError` naming ``<where>.<field>``)."""

    where: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_fields(self, self.where)


@dataclass
class DistributedConfig(Checked):
    where: ClassVar[str] = "training.distributed"

    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl when CUDA is present, else gloo
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when present, else cpu
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"  # auto: bf16 compute on cuda, fp32 on cpu
    replicate_size: int = bounded(1, 1, MAX_RANKS)  # HSDP: size of the replicate mesh dim (1 = plain FSDP over all ranks)
    shard_single_rank: bool = False  # true: FSDP2 even on a world of one; false: a plain module there (bf16 compute copy + fp32 master, faster: BENCHMARKS.md)
    reshard_after_forward: bool | None = None  # FSDP2: free gathered params after forward (ZeRO-3); null: only when the shard group has >1 rank
    sp_size: int = bounded(1, 1, MAX_RANKS)  # Ulysses sequence parallelism: ranks a sample's tokens are split over (1: off; divides node and heads)
    tp_size: int = bounded(1, 1, MAX_RANKS)  # tensor parallelism: ranks each block's heads and FFN are split over (1: off; divides node and heads)


def model_parallel_problem(sp_size: int, tp_size: int, world: int, local: int, replicate_size: int = 1) -> tuple[str, str] | None:
    """What is wrong with an SP group of ``sp_size`` and a TP group of ``tp_size`` ranks on a launch of ``world`` ranks,
    ``local`` per node (and HSDP's ``replicate_size`` copies), as ``(key, why)`` — the key among ``sp_size``,
    ``tp_size``, ``sp_size × tp_size``, ``replicate_size`` —, or None. Each group, and their product, divides the world
    and the processes per node (an SP group's all-to-alls and a TP group's all-reduces run in every block and stay
    inside a node) and the ranks of one replica. The one rule, read by the trainer
    (:func:`distillery.components.distributed.check_model_parallel`) and by ``params.yaml``'s check."""
    checks = [("sp_size", sp_size), ("tp_size", tp_size)]
    if sp_size > 1 and tp_size > 1:
        checks.append(("sp_size × tp_size", sp_size * tp_size))
    for key, size in checks:
        if size == 1:
            continue
        if world % size:
            return key, f"{size} does not divide the world size {world} (nodes x processes per node)"
        if size > local:
            return key, f"a group of {size} ranks is larger than a node's {local} processes (its collectives stay in a node)"
        if local % size:
            return key, f"{size} does not divide the {local} processes per node; its groups are consecutive ranks of one node"
    if replicate_size > 1 and (world // replicate_size) % (sp_size * tp_size):
        return "replicate_size", (f"{replicate_size} copies leave {world // replicate_size} ranks each, which sp_size "
                                  f"{sp_size} × tp_size {tp_size} does not divide")
    return None


@dataclass
class RoleDistributedOverride:
    """``models.<role>.distributed``: the role's own FSDP2/HSDP mesh (null: ``training.distributed``'s).

    E.g. a frozen teacher sharded over every rank (``replicate_size: 1``: the least memory per GPU, no
    gradient traffic) beside a student and critic in HSDP (``replicate_size: <nodes>``: shards stay
    inside a node, gradients cross nodes once per step as an all-reduce of a shard)."""

    replicate_size: int | None = bounded(None, 1, MAX_RANKS)  # HSDP replicate dim of this role's mesh; must divide the world size


MAX_LORA_RANK = 1024  # a LoRA's rank (published video LoRAs: 16–128; Wan2.1-14B's width is 5120)
MAX_LORA_TARGETS = 64  # module names in one target_modules list
MAX_LORA_TARGET_CHARS = 100


def _lora_target_names(value: list[str]) -> str | None:
    """``target_modules``: 1..64 dotted module names (``to_q``, ``attn1.to_q``, ``ffn.net.0.proj``)."""
    if not value:
        return "must name at least one module (e.g. [to_q, to_k, to_v, to_out.0])"
    if len(value) > MAX_LORA_TARGETS:
        return f"at most {MAX_LORA_TARGETS} module names"
    for name in value:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_TARGET_CHARS or not all(
                part.isidentifier() or part.isdigit() for part in name.split(".")):
            return f"{name!r} is not a module name (dotted names such as to_q, attn1.to_q, ffn.net.0.proj)"
    return None


@dataclass
class LoraConfig:
    """``models.<role>.lora``: train a LoRA adapter on the role's transformer instead of its weights (PEFT; docs/training.md).

    Every Linear layer whose dotted path ends with one of ``target_modules`` (on a ``.`` boundary, as PEFT matches) gets
    ``W x + (alpha / rank) · B A x`` with ``A`` ``[rank, in]`` (Kaiming) and ``B`` ``[out, rank]`` (zeros: the first
    forward is the base's). The base weights are frozen: only ``A``/``B`` train, are sharded with the role, carry
    optimizer state and go into checkpoints. Only a trainable role may have one."""

    rank: int = bounded(16, 1, MAX_LORA_RANK)  # r: the adapter's inner width
    alpha: float = bounded(16.0, 1e-6, 65536.0)  # the update is scaled by alpha / rank
    target_modules: list[str] = bounded(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"], check=_lora_target_names)
    dropout: float = bounded(0.0, 0.0, 0.9)  # dropout on the adapter's input (training only)


@dataclass
class DataConfig(Checked):
    where: ClassVar[str] = "training.data"
    path: str = ""  # folder of latent parquet shards (holds train/ and validation/)
    split: str = "train"  # sub-folder of path to train on
    batch_size: int = bounded(1, 1, MAX_BATCH)  # samples per rank per micro-batch
    text_max_length: int = bounded(512, 1, MAX_TEXT_TOKENS)  # prompt embeddings are zero-padded/truncated to this many tokens
    drop_last: bool = True  # every rank gets only full batches
    unconditional: Literal["empty", "negative"] = "empty"  # the CFG unconditional (and caption-dropout) prompt: empty, or the set's negative prompt
    # [C, T, H, W] of the samples a prompts-only method's rollouts generate (a prompt-only set has no latents); null: the set's manifest's
    latent_shape: list[int] | None = bounded(None, 1, 65536, check=lambda v: None if v is None or len(v) == 4
                                             else "must be [C, T, H, W] (4 sizes)")


@dataclass
class OptimizerConfig(Checked):
    where: ClassVar[str] = "training.optimizer"

    learning_rate: float = bounded(1e-4, 0.0, MAX_LEARNING_RATE, check=positive_finite)  # peak learning rate (0 trains nothing)
    betas: tuple[float, float] = bounded((0.9, 0.999), 0.0, 0.999999)  # AdamW betas
    weight_decay: float = bounded(0.01, 0.0, 1000.0)  # decoupled weight decay
    eps: float = bounded(1e-8, 0.0, 1.0)  # AdamW epsilon
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"  # decay after warmup
    warmup_steps: int = bounded(0, 0, MAX_STEPS)  # linear warmup from 0 over this many optimizer steps
    min_lr_ratio: float = bounded(0.0, 0.0, 1.0)  # floor of cosine/linear decay, as a fraction of learning_rate


@dataclass
class OptimizerOverride:
    """``models.<role>.optimizer``: fields that replace ``training.optimizer``'s for that role (null: keep);
    each held to its :class:`OptimizerConfig` field's rule (declared there, once)."""

    learning_rate: float | None = with_default(OptimizerConfig, "learning_rate", None)
    betas: tuple[float, float] | None = with_default(OptimizerConfig, "betas", None)
    weight_decay: float | None = with_default(OptimizerConfig, "weight_decay", None)
    eps: float | None = with_default(OptimizerConfig, "eps", None)
    lr_scheduler: Literal["constant", "cosine", "linear"] | None = None
    warmup_steps: int | None = with_default(OptimizerConfig, "warmup_steps", None)
    min_lr_ratio: float | None = with_default(OptimizerConfig, "min_lr_ratio", None)


@dataclass
class LoopConfig(Checked):
    where: ClassVar[str] = "training.loop"
    max_train_steps: int = bounded(100, 0, MAX_STEPS)  # optimizer steps in the whole run (a resumed run stops here too)
    grad_accum_steps: int = bounded(1, 1, 65536)  # micro-batches per optimizer step
    seed: int = bounded(0, 0, MAX_SEED)  # seeds python/numpy/torch, the data order and the method's random stream
    stop_at_step: int | None = bounded(None, 0, MAX_STEPS)  # end this invocation at this step (checkpointed); rerun to continue
    log_every: int = bounded(1, 1, MAX_STEPS)  # steps between metric logs
    progress_bar: bool = True  # rank-0 progress: a bar on a terminal, else a log line per 10 % or minute (distillery.common.progress)
    # skip (no update) up to this many steps whose loss or grad norm is NaN/Inf per invocation; 0: stop at the first
    skip_nonfinite_steps: int = bounded(0, 0, 1_000_000)


@dataclass
class CheckpointConfig(Checked):
    where: ClassVar[str] = "training.checkpoint"
    output_dir: str = "runs/train"  # checkpoint-<step>/ folders are written here
    save_every: int = bounded(0, 0, MAX_STEPS)  # steps between checkpoints; 0 = only at the end of the run
    keep_last: int = bounded(2, 0, 1_000_000)  # keep this many newest checkpoints (0 = keep all)
    resume: str = "latest"  # "latest" (newest complete checkpoint in output_dir, if any), "none", or a checkpoint path
    save_final: bool = True  # always write a checkpoint at the last step


@dataclass
class TrackerConfig:
    backend: Literal["mlflow", "none"] = "mlflow"
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db
    experiment: str = "distillery"
    run_name: str | None = None
    parent_run_id: str | None = None  # nest this run under a pipeline-level parent run
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelRuntimeConfig:
    compile: bool | None = None  # torch.compile the transformer (see compile_mode); null: on for bf16 on CUDA, off otherwise
    compile_mode: Literal["blocks", "model"] = "blocks"  # blocks: each transformer block compiled once (regional); model: the whole transformer
    activation_checkpointing: bool = False  # recompute block activations in backward
    # the share of blocks recomputed when activation_checkpointing is on, spread evenly (1: every block, diffusers' own;
    # 0.2: 6 of Wan's 30 blocks: ~20% of the activations freed for ~20% of one forward recomputed)
    activation_checkpointing_fraction: float = bounded(1.0, 0.0, 1.0)
    # auto: FlashAttention-4 (fa4) on an SM90+ GPU where flash_attn.cute imports (pip install -e ".[gpu]"), else native;
    # native: torch SDPA picks the kernel; cudnn | flash | efficient: only that SDPA kernel (CUDA);
    # fa4: FA4 everywhere, block-causal attention as per-chunk prefix calls; fa4_sparse: block-causal as one block-sparse FA4 call
    attention_backend: Literal["auto", "native", "cudnn", "flash", "efficient", "fa4", "fa4_sparse"] = "auto"


@dataclass
class TrainingConfig:
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    model: ModelRuntimeConfig = field(default_factory=ModelRuntimeConfig)


@dataclass
class Component:
    """One ``_target_`` entry: the dotted path, the resolved class and its typed config."""

    target: str
    cls: Any
    config: Any
    optimizer: OptimizerOverride | None = None  # models.<role>.optimizer (model components only)
    distributed: RoleDistributedOverride | None = None  # models.<role>.distributed (model components only)
    lora: LoraConfig | None = None  # models.<role>.lora (model components only): a LoRA adapter trains instead of the weights
    # the plugins its config names (the config class's ``plugin_fields``: a dotted ``_target_`` path each), resolved
    # under the run's allowed prefixes when the config is built; the config keeps the path (what to_plain writes)
    plugins: dict[str, Any] = field(default_factory=dict)

    def to_plain(self) -> dict[str, Any]:
        plain = {"_target_": self.target, **to_plain(self.config)}
        if self.optimizer is not None:
            plain["optimizer"] = {k: v for k, v in to_plain(self.optimizer).items() if v is not None}
        if self.distributed is not None:
            plain["distributed"] = {k: v for k, v in to_plain(self.distributed).items() if v is not None}
        if self.lora is not None:
            plain["lora"] = to_plain(self.lora)
        return plain


@dataclass
class RunConfig:
    models: dict[str, Component]
    method: Component
    training: TrainingConfig
    callbacks: dict[str, Component]

    def to_plain(self) -> dict[str, Any]:
        return {
            "models": {k: v.to_plain() for k, v in self.models.items()},
            "method": self.method.to_plain(),
            "training": to_plain(self.training),
            "callbacks": {k: v.to_plain() for k, v in self.callbacks.items()},
        }


def t_list_problem(values: list[float], scale: float = 1000.0) -> str | None:
    """What is wrong with a knowledge-distillation ``t_list`` (None: nothing): at least 2 points, strictly descending,
    in ``[0, scale]`` (``scale``: the timestep scale, 1000 for every Wan model), the last 0 (the trajectory's clean
    end point). The KD method's config and ``params.yaml``'s ``pretrain.t_list`` both follow it."""
    if len(values) < 2:
        return "must list at least 2 timesteps (the trajectory points, then 0)"
    if any(not math.isfinite(v) or v < 0 or v > scale for v in values):
        return f"every timestep must be in [0, {scale:g}]"
    if any(b >= a for a, b in zip(values, values[1:])):
        return "must be strictly descending (999, 937, 833, 624, 0)"
    if values[-1] != 0:
        return "must end at 0 (the trajectory's clean end point, the regression target)"
    return None
