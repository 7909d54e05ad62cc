"""Model plugin interface: one role's transformer plus its noise schedule.

Methods talk to models only through this interface (:class:`ModelBase`; a chunk-by-chunk generator
is a :class:`CausalModelBase`, a parallel-decoding student a :class:`PDDModelBase`), never through a
model family's own classes. Tensor layout at the boundary is
``[B, C, T, H, W]`` (latent channels, latent frames, latent height, latent width); timesteps are
``[B]`` (one per sample) or ``[B, T]`` (one per latent frame) in ``[0, 1000]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from distillery.common.errors import UserError
from distillery.common.hashcache import folder_sha256
from distillery.components.precision import ComputeCopy
from distillery.components.rng import BatchRNG
from distillery.models.schedule import FlowMatchSchedule, renoise, x0_from_velocity


@dataclass
class TransformerModelConfig:
    """The knobs every family's plugin takes (its ``config_class`` subclasses this: ``WanModelConfig``,
    ``CosmosModelConfig``, their causal and PDD variants)."""

    init_from: str  # diffusers model folder (with transformer/) or a transformer folder
    trainable: bool = True  # False: frozen (teacher); no optimizer, no gradients
    random_init: bool = False  # build from config.json only with random weights (benchmarks)
    shift: float | None = None  # flow shift; null: read from the scheduler config beside the weights
    timestep_sampling: Literal["uniform", "logit_normal"] = "uniform"  # how training σ are drawn
    logit_mean: float = 0.0  # logit-normal location
    logit_std: float = 1.0  # logit-normal scale

    def __post_init__(self) -> None:
        if self.logit_std <= 0:
            raise ValueError("logit_std must be > 0")
        if self.shift is not None and self.shift <= 0:
            raise ValueError("shift must be > 0")


@dataclass
class Conditioning:
    """What a denoiser is conditioned on (samplers build this; a :class:`TrainingBatch` also is one)."""

    text_embeds: torch.Tensor  # [B, L, D] zero-padded prompt embeddings
    negative_text_embeds: torch.Tensor | None = None  # [B, L, D] empty-prompt embeddings (CFG); None: zeros
    first_frame: torch.Tensor | None = None  # image-to-video: [B, M + C, T, H, W] the first-frame mask then its latent
    image_embeds: torch.Tensor | None = None  # image-to-video: [B, N, D_img] the image encoder's embeddings of the frame


@dataclass
class TrainingBatch:
    """Forward-ready tensors for one micro-batch (all on the model's device)."""

    latents: torch.Tensor | None  # clean x0 [B, C, T, H, W]; None for a batch of prompts only (rollouts from noise)
    text_embeds: torch.Tensor  # [B, L, D] zero-padded prompt embeddings
    negative_text_embeds: torch.Tensor | None = None  # [B, L, D] empty-prompt embeddings (CFG)
    noise: torch.Tensor | None = None  # ε [B, C, T, H, W]
    timesteps: torch.Tensor | None = None  # [B] or [B, T] in [0, 1000]
    sigmas: torch.Tensor | None = None  # same shape as timesteps, σ = t / 1000
    noisy_latents: torch.Tensor | None = None  # x_t [B, C, T, H, W]
    first_frame: torch.Tensor | None = None  # image-to-video: [B, M + C, T, H, W] (as :class:`Conditioning`'s)
    image_embeds: torch.Tensor | None = None  # image-to-video: [B, N, D_img] (as :class:`Conditioning`'s)


def batch_latent_shape(raw: dict[str, Any]) -> tuple[int, ...]:
    """``(B, C, T, H, W)`` of a collated batch: its ``latents``' shape, or — a batch of prompts only — ``B`` prompts
    of its ``latent_shape`` ``[C, T, H, W]`` (:class:`~distillery.engine.batches.TrainBatches` adds it)."""
    latents = raw.get("latents")
    if latents is not None:
        return tuple(int(s) for s in latents.shape)
    shape = raw.get("latent_shape")
    if shape is None:
        raise ValueError("a batch without latents needs latent_shape [C, T, H, W] (training.data.latent_shape)")
    return (int(raw["text_embeds"].shape[0]), *(int(s) for s in shape))


class ModelBase(ABC):
    """Owns one role's transformer (``self.transformer``) and noise schedule (``self.schedule``).

    Subclasses set ``config_class`` (a dataclass of their knobs). The trainer moves the
    transformer to its device and wraps it with FSDP2 after construction; ``self.device`` is then
    set by :meth:`bind_device`.
    """

    component_kind: ClassVar[str] = "model"
    #: The σ grid's form of the family's pipeline (:data:`~distillery.models.schedule.SIGMA_GRIDS`): its schedule's.
    sigma_grid: ClassVar[str] = "table"
    config_class: type
    transformer: torch.nn.Module
    schedule: FlowMatchSchedule
    #: Two experts split by timestep (Wan 2.2 A14B): the first timestep of the high-noise expert (``t >= this`` goes to
    #: it, below to the low-noise one; diffusers' ``boundary_ratio · num_train_timesteps``). None: one transformer.
    boundary_timestep: float | None = None

    def __init__(self, config: Any, role: str) -> None:
        self.config = config
        self.role = role
        self.device = torch.device("cpu")
        self.compute_dtype = torch.float32
        self.compute_copy: ComputeCopy | None = None
        self.lora: Any = None  # the LoraConfig of the adapter that trains on the transformer (apply_lora); None: none
        self.attached: dict[str, torch.nn.Module] = {}  # modules a method trains with this role (attach_trainable)

    @property
    def trainable(self) -> bool:
        return bool(getattr(self.config, "trainable", False))

    @classmethod
    def linear_layers(cls, config: Any) -> dict[str, tuple[int, int]] | None:
        """``{path: (in, out)}`` of the Linear layers of the transformer ``config`` builds, read without loading
        weights (what a LoRA may target, checked before any work: :func:`distillery.models.lora.check_lora`).
        Default None: not known before the model is built (checked then)."""
        del config
        return None

    def apply_lora(self, spec: Any) -> None:
        """Put the adapter ``spec`` (a :class:`~distillery.config.schema.LoraConfig`) on ``self.transformer`` (before
        placement): from now only its parameters train in the transformer (:func:`distillery.models.lora.inject_lora`)."""
        from distillery.models.lora import inject_lora

        inject_lora(self.transformer, spec, f"models.{self.role}.lora")
        self.lora = spec

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        """The modules of this role that train, by name (``{"transformer": ...}``; a PDD model adds
        its head bank; a method may attach its own, :meth:`attach_trainable`). Placement and sharding, optimizers,
        checkpoints (``roles.<role>.<name>``), EMA and export all go through this; nothing else decides what trains."""
        return {"transformer": self.transformer, **self.attached}

    def attach_trainable(self, name: str, module: torch.nn.Module) -> None:
        """Train ``module`` with this role (e.g. a discriminator head on a critic's hidden states): one of its
        :meth:`trainable_modules` from now on, so placed (its own FSDP2 unit), optimized, clipped and checkpointed
        (``roles.<role>.<name>``) with it. Call it before placement (a method's ``__init__``)."""
        if name in self.trainable_modules():
            raise ValueError(f"models.{self.role} already trains a module named {name!r}")
        self.attached[name] = module.requires_grad_(True)

    def hidden_width(self) -> int:
        """The width of the hidden states its blocks return (:meth:`predict_noise_with_features`); a model that does
        not say: one line."""
        raise UserError(f"models.{self.role}: {type(self).__name__} does not expose its hidden states")

    def predict_noise_with_features(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        blocks: list[int],
        conditional: bool = True,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`predict_noise`, and the hidden states ``[B, L, D]`` (the compute dtype, with graph) that the
        repeated blocks ``blocks`` (indices into :meth:`shardable_blocks` of the module that computes) returned in that
        forward — read by forward hooks that live for this call only."""
        modules = self.shardable_blocks(self.forward_module)
        captured: dict[int, torch.Tensor] = {}

        def keep(index: int) -> Any:
            def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
                captured.setdefault(index, output if isinstance(output, torch.Tensor) else output[0])
            return hook

        handles = [modules[i].register_forward_hook(keep(i)) for i in sorted(set(blocks))]
        try:
            velocity = self.predict_noise(noisy_latents, timesteps, batch, conditional)
        finally:
            for handle in handles:
                handle.remove()
        return velocity, [captured[i] for i in blocks]

    def twin(self, name: str) -> "ModelBase":
        """A frozen twin of this role for shadow weights (:mod:`distillery.components.shadow`): a deep copy, made
        before placement (the builder places it as it places this role), with its own caches, its transformer in
        eval mode and its ``role`` ``<role>.<name>`` (log lines). Its parameters keep their ``requires_grad`` (the
        shadow is exactly the set the role trains, and a one-rank compute copy refreshes those); it is only ever
        run without gradient. Call it on an unplaced role."""
        import copy

        if self.compute_copy is not None or self.device.type != "cpu":
            raise RuntimeError(f"models.{self.role}: a twin is made before the role is placed")
        twin = copy.deepcopy(self)
        twin.role = f"{self.role}.{name}"
        twin.transformer.eval()
        return twin

    def source(self) -> dict[str, Any]:
        """Where this role's weights came from (checkpoint metadata of frozen roles): ``path`` (the
        folder they were loaded from: ``self.transformer_dir`` when the plugin sets it, else the
        config's ``init_from``) and ``sha256`` over its files (name + content, in name order)."""
        from pathlib import Path

        folder = Path(getattr(self, "transformer_dir", None) or getattr(self.config, "init_from", ""))
        return {"path": str(folder), "sha256": folder_sha256(folder)}

    def bind_device(self, device: torch.device, compute_dtype: torch.dtype = torch.float32,
                    compute_copy: ComputeCopy | None = None) -> None:
        """Record the device and dtype the transformer computes in.

        ``compute_copy``: a low-precision twin of ``self.transformer`` (the fp32 master) that runs
        forward and backward (one rank without FSDP; see :mod:`distillery.components.precision`).
        """
        self.device = device
        self.compute_dtype = compute_dtype
        self.compute_copy = compute_copy

    def settle_transformer(self, scheduler_dir: Path | None) -> None:
        """After a plugin set ``self.transformer`` (and ``self.transformer_dir``): freeze it unless the role trains (eval
        then), and set ``self.schedule`` to the role's shift (``config.shift``, else ``scheduler_dir``'s config) and the
        family's σ-grid form (:attr:`sigma_grid`)."""
        self.transformer.requires_grad_(self.config.trainable)
        if not self.config.trainable:
            self.transformer.eval()
        self.scheduler_dir = scheduler_dir
        self.schedule = FlowMatchSchedule(shift=scheduler_shift(self.config.shift, scheduler_dir, self.transformer_dir, self.role),
                                          sigma_grid=self.sigma_grid)

    @property
    def forward_module(self) -> torch.nn.Module:
        """The module that computes: the compute copy when there is one, else the transformer."""
        return self.compute_copy.module if self.compute_copy is not None else self.transformer

    def collect_grads(self) -> None:
        """Move gradients of the compute copy (if any) into the fp32 master gradients."""
        if self.compute_copy is not None:
            self.compute_copy.collect_grads()

    def refresh_compute_weights(self) -> None:
        """Write the master weights into the compute copy (if any) after they changed."""
        if self.compute_copy is not None:
            self.compute_copy.refresh()

    def input_dtype(self) -> torch.dtype:
        """dtype for latents/text fed to the transformer: the compute dtype, so the residual stream
        is carried in bf16 under mixed precision."""
        return self.compute_dtype

    def set_attention_backend(self, backend: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        """Select the attention kernel of ``self.transformer`` for ``device`` / ``dtype`` (``auto``: the fastest
        that runs there; ``native``: torch's SDPA dispatch; ``cudnn`` / ``flash`` / ``efficient``: that SDPA kernel
        only; ``fa4`` / ``fa4_sparse``: FlashAttention-4). Default: no choice offered (``auto`` is ``native``)."""
        del device, dtype
        if backend not in ("native", "auto"):
            raise UserError(f"config error: training.model.attention_backend: {type(self).__name__} offers only native")

    @classmethod
    def sequence_parallel_problem(cls, config: Any, sp_size: int) -> str | None:
        """Why this model, built from ``config``, cannot split its token sequence over ``sp_size`` ranks
        (``training.distributed.sp_size``), read without loading weights — None when it can. Default: a model
        offers no sequence parallelism."""
        del config
        return f"{cls.__name__} does not offer sequence parallelism" if sp_size > 1 else None

    def enable_sequence_parallel(self, sp: Any) -> None:
        """Split every forward's token sequence over the SP group ``sp`` (a
        :class:`~distillery.components.sequence_parallel.SequenceParallel`; placement calls this once, before
        FSDP2 wraps the transformer). Inputs and outputs stay whole on every rank of the group."""
        raise UserError(f"config error: training.distributed.sp_size: {type(self).__name__} does not offer sequence parallelism")

    @classmethod
    def tensor_parallel_problem(cls, config: Any, tp_size: int, sp_size: int = 1) -> str | None:
        """Why this model, built from ``config``, cannot split its blocks over ``tp_size`` ranks
        (``training.distributed.tp_size``; with ``sp_size`` ranks of sequence parallelism on each rank's share), read
        without loading weights — None when it can. Default: a model offers no tensor parallelism."""
        del config, sp_size
        return f"{cls.__name__} does not offer tensor parallelism" if tp_size > 1 else None

    def enable_tensor_parallel(self, mesh: Any) -> None:
        """Split the transformer's blocks over the TP ``mesh`` (a 1-D ``DeviceMesh``, the ``tp`` dim of the role's device
        mesh; placement calls this once, before FSDP2 wraps the transformer)."""
        raise UserError(f"config error: training.distributed.tp_size: {type(self).__name__} does not offer tensor parallelism")

    @abstractmethod
    def shardable_blocks(self, module: torch.nn.Module | None = None) -> list[torch.nn.Module]:
        """The repeated blocks of ``module`` (default: ``self.transformer``) that FSDP2 shards one
        by one before the root and regional compilation compiles."""

    @abstractmethod
    def transformer_config(self) -> dict[str, Any]:
        """The transformer's architecture config (diffusers ``config.json`` content)."""

    @abstractmethod
    def sample_timesteps(self, batch_size: int, rng: BatchRNG) -> torch.Tensor:
        """Training timesteps ``[batch_size]`` in ``[0, 1000]`` (float32)."""

    def prepare_batch(
        self,
        raw: dict[str, Any],
        rng: BatchRNG,
        timesteps: torch.Tensor | None = None,
    ) -> TrainingBatch:
        """Move a collated batch to the device (copied as stored, then float32 on the device; the
        forward casts to the compute dtype) and draw noise (and timesteps unless given). Page-locked
        host tensors are copied without waiting for work already queued on the GPU.

        ``raw`` holds ``latents`` [B,C,T,H,W] — or, a batch of prompts only, ``latent_shape`` [C,T,H,W]: the
        noise is drawn in that shape (the same draws as for latents of it) and ``latents``/``noisy_latents`` are
        None —, ``text_embeds`` [B,L,D] and optionally ``negative_text_embeds`` [B,L,D] or ``empty_text_embeds``
        [L,D]; an image-to-video set adds ``first_frame`` [B,M+C,T,H,W] and ``image_embeds`` [B,N,D_img].
        All randomness comes from ``rng`` (per-sample draws, independent of the rank split).
        """
        latents = raw.get("latents")
        if latents is not None:
            latents = latents.to(self.device, non_blocking=True).float()  # copy as stored, cast on the device
        shape = batch_latent_shape(raw)
        text = raw["text_embeds"].to(self.device, non_blocking=True).float()
        negative = raw.get("negative_text_embeds")
        if negative is not None:
            negative = negative.to(self.device, non_blocking=True).float()
        elif raw.get("empty_text_embeds") is not None:  # one [L, D] copy, broadcast over the batch on the device
            negative = raw["empty_text_embeds"].to(self.device, non_blocking=True).float().unsqueeze(0).expand_as(text)
        if timesteps is None:
            timesteps = self.sample_timesteps(shape[0], rng)
        timesteps = timesteps.to(self.device)
        noise = rng.randn(shape).to(self.device)
        batch = TrainingBatch(latents=latents, text_embeds=text, negative_text_embeds=negative, noise=noise)
        for key in ("first_frame", "image_embeds"):  # image-to-video conditioning, when the set holds it
            if raw.get(key) is not None:
                setattr(batch, key, raw[key].to(self.device, non_blocking=True).float())
        batch.timesteps = timesteps
        batch.sigmas = self.schedule.sigma(timesteps)
        batch.noisy_latents = self.add_noise(latents, noise, timesteps) if latents is not None else None
        return batch

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """``x_t = (1 − σ) x0 + σ ε`` with σ from ``timesteps`` ([B] or per-frame [B, T])."""
        return renoise(x0, noise, self.schedule.sigma(timesteps))

    @abstractmethod
    def predict_noise(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        conditional: bool = True,
    ) -> torch.Tensor:
        """Predicted flow velocity ``v = ε − x0`` ``[B, C, T, H, W]`` (float32)."""

    def predict_x0(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        conditional: bool = True,
    ) -> torch.Tensor:
        """Predicted clean latents ``x0 = x_t − σ v`` ``[B, C, T, H, W]`` (float32)."""
        v = self.predict_noise(noisy_latents, timesteps, batch, conditional)
        return x0_from_velocity(noisy_latents, v, self.schedule.sigma(timesteps))

    def backward(self, loss: torch.Tensor, ctx: Any = None, grad_accum_rounds: int = 1) -> None:
        """Backpropagate ``loss / grad_accum_rounds`` through this role's transformer."""
        del ctx
        (loss / max(1, grad_accum_rounds)).backward()


def given_frame_layout_problem(num_frames: int, chunk_size: int) -> str | None:
    """Why ``num_frames`` latent frames do not fit a causal image-to-video layout — the given frame, then chunks of
    ``chunk_size`` (``1 + k · chunk_size`` latent frames, ``4 · k · chunk_size + 1`` video frames at Wan's temporal
    factor 4) —, or None when they fit."""
    if num_frames >= 2 and (num_frames - 1) % chunk_size == 0:
        return None
    fits = [1 + k * chunk_size for k in (1, 2, 3)]
    return (f"{num_frames} latent frames do not fit a causal image-to-video student's layout: the given first frame, then "
            f"chunks of {chunk_size} (1 + k·{chunk_size} latent frames, e.g. {', '.join(map(str, fits))}: "
            f"{', '.join(str(4 * (f - 1) + 1) for f in fits)} video frames)")


def chunk_bounds(num_frames: int, chunk_size: int, given_first_frame: bool = False) -> list[tuple[int, int]]:
    """``[(start frame, frames)]`` of the chunks a causal generator denoises in a ``num_frames``-frame video: the
    split every chunk-by-chunk generator of a :class:`CausalModelBase` uses (the ``causal_streaming`` sampler, the
    Self-Forcing rollout, DFSFT's and KD's per-chunk draws).

    ``given_first_frame`` false (text-to-video): chunks of ``chunk_size`` from frame 0, the last one may be shorter.
    True (an image-to-video student, :attr:`CausalModelBase.given_first_frame`): latent frame 0 is the given frame —
    its own block, written to the cache clean, never denoised, not listed — and the chunks start at frame 1, all
    ``chunk_size`` long; a length that does not fit (:func:`given_frame_layout_problem`) is a one-line
    :class:`UserError`."""
    if not given_first_frame:
        return [(s, min(chunk_size, num_frames - s)) for s in range(0, num_frames, chunk_size)]
    problem = given_frame_layout_problem(int(num_frames), int(chunk_size))
    if problem:
        raise UserError(problem)
    return [(s, chunk_size) for s in range(1, num_frames, chunk_size)]


def given_first_latent(cond: Conditioning | TrainingBatch, latent_channels: int) -> torch.Tensor:
    """The clean latent of an image-to-video condition's given frame, float32 ``[B, C, 1, H, W]``: latent frame 0 of
    the condition's latent part (its last ``latent_channels`` channels, after the mask) — the VAE latent of
    [frame, zeros…], whose first latent frame is the frame's own (Wan's VAE is causal in time), normalised as the
    video latents are. A :class:`UserError` when ``cond`` has no first frame."""
    first = getattr(cond, "first_frame", None)
    if first is None:
        raise UserError("a causal image-to-video student starts from the given first frame; this batch has none "
                        "(latents made from an image-to-video base by the latents stage carry it)")
    return first[:, first.shape[1] - latent_channels:, :1].float()


class CausalModelBase(ModelBase):
    """A model that generates a video chunk by chunk, attending to earlier chunks through a KV cache.

    The video's latent frames are split into chunks of ``chunk_size`` frames; a frame attends to
    its own chunk and every earlier one (block-causal). Streaming calls take one chunk
    ``[B, C, chunk_frames, H, W]`` that starts at latent frame ``cur_start_frame`` of the video and
    attend to what the cache named ``cache_tag`` holds for frames ``[0, cur_start_frame)``:

    - ``store_kv=False`` — denoise the chunk against the cache, leave the cache as it is (the
      intermediate steps of a chunk's step list);
    - ``store_kv=True`` — also append this chunk's keys/values (computed from the latents given, at
      the timesteps given: clean context uses t = 0, or a small ``context_noise``) to the cache;
    - ``clear_caches(cache_tag)`` — forget the cache (every cache when ``cache_tag`` is None), e.g.
      before a new video. Separate tags keep separate caches (conditional / unconditional passes).

    Implementations raise ``ValueError`` when ``cur_start_frame`` does not equal the number of
    frames the cache holds (a chunk skipped or stored twice). The full-sequence ``predict_noise``
    (training with teacher forcing / DFSFT) applies the same block-causal mask without a cache.
    """

    chunk_size: int  # latent frames per causal chunk
    #: An image-to-video student: latent frame 0 is the given frame's clean latent (:func:`given_first_latent`), a block
    #: of its own that every later frame attends to; it is written to the cache at t = 0 and never denoised, the
    #: generated chunks start at frame 1 (:func:`chunk_bounds`) and training losses leave frame 0 out.
    given_first_frame: bool = False

    @abstractmethod
    def clear_caches(self, cache_tag: str | None = None) -> None:
        """Drop the KV cache named ``cache_tag`` (all caches when None)."""

    @abstractmethod
    def cached_frames(self, cache_tag: str) -> int:
        """Latent frames the cache ``cache_tag`` holds (0 when empty)."""

    @abstractmethod
    def predict_noise_streaming(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        *,
        cache_tag: str,
        store_kv: bool,
        cur_start_frame: int,
        conditional: bool = True,
    ) -> torch.Tensor:
        """Velocity ``[B, C, chunk_frames, H, W]`` (float32) of one chunk given the cached context.

        ``timesteps``: ``[B]`` or per-frame ``[B, chunk_frames]`` in [0, 1000].
        """

    def predict_noise_teacher_forcing(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        clean_latents: torch.Tensor,
        conditional: bool = True,
    ) -> torch.Tensor:
        """Velocity ``[B, C, T, H, W]`` (float32) of the noisy video ``noisy_latents`` under **teacher forcing**: each
        chunk attends to its own noisy frames and to the *clean* frames ``clean_latents`` (same shape, at t = 0) of
        every earlier chunk — the context a chunk-by-chunk sampler holds had it generated the clean video — in one
        forward, with gradients through the clean context too (Teacher-Forcing SFT, causal consistency distillation).
        For each chunk it equals :meth:`predict_noise_streaming` against a cache of the clean earlier chunks stored at
        t = 0 (a test checks it). ``timesteps``: ``[B]`` or per-frame ``[B, T]``. A model without it: one line."""
        del noisy_latents, timesteps, batch, clean_latents, conditional
        raise UserError(f"models.{self.role}: {type(self).__name__} has no teacher-forcing forward")

    def predict_x0_streaming(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        batch: Conditioning | TrainingBatch,
        *,
        cache_tag: str,
        store_kv: bool,
        cur_start_frame: int,
        conditional: bool = True,
    ) -> torch.Tensor:
        """Clean latents ``x0 = x_t − σ v`` of one chunk (float32), see :meth:`predict_noise_streaming`."""
        v = self.predict_noise_streaming(noisy_latents, timesteps, batch, cache_tag=cache_tag, store_kv=store_kv,
                                         cur_start_frame=cur_start_frame, conditional=conditional)
        return x0_from_velocity(noisy_latents, v, self.schedule.sigma(timesteps))


@dataclass
class HeadGroup:
    """Heads one forward of a :class:`PDDModelBase` projects: ``heads`` (grid-interval indices), fused
    into one by ``coeffs`` (``[len(heads)]``) when given; ``detached``: from the trunk states without
    gradient (a rollout's advance), else with it (the supervised head)."""

    heads: list[int]
    coeffs: torch.Tensor | None = None
    detached: bool = False

    @property
    def size(self) -> int:
        return 1 if self.coeffs is not None else len(self.heads)


class PDDModelBase(ModelBase):
    """A parallel-decoding student: one velocity head per interval of a fine σ grid of ``pdd_steps``
    intervals (the ``pdd_steps``-step Euler grid of its shifted schedule, ``σ_0 = 1 > … > σ_P = 0``),
    all projected from one trunk forward; linear heads, so a block's heads fuse into one projection.
    What the PDD method (:mod:`distillery.methods.pdd`), its sampler (``pdd_fused``) and the export's
    1-NFE stock transformer use (a family's implementation: ``models/wan/pdd.py``)."""

    pdd_steps: int  # fine-grid intervals = heads

    @abstractmethod
    def fine_sigmas(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The fine σ grid ``float32 [pdd_steps + 1]``, 1 → 0."""

    @abstractmethod
    def predict_head_groups(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                            batch: Conditioning | TrainingBatch, groups: list[HeadGroup],
                            conditional: bool = True) -> list[torch.Tensor]:
        """One trunk forward at ``noisy_latents`` (``[B, C, T, H, W]``), projected by each group →
        per group float32 ``[B, m, C, T, H, W]`` (m = its heads, or 1 fused)."""

    @abstractmethod
    def predict_pdd_fused(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, batch: Conditioning | TrainingBatch,
                          start: int, end: int, conditional: bool = True) -> torch.Tensor:
        """The block ``[start, end)``'s mean velocity (float32 ``[B, C, T, H, W]``) from one forward:
        ``x_end = x_start + (σ_end − σ_start) ·`` this."""

    @abstractmethod
    def fuse_into_projection(self, module: torch.nn.Module, start: int, end: int) -> None:
        """Write block ``[start, end)``'s fused projection into ``module`` (a plain transformer of this
        trunk, e.g. ``self.transformer``): its velocity becomes the block's mean velocity."""


# -- loading a family's diffusers transformer, as every model plugin does ------------------------------------
def load_transformer(model_class: Any, folder: str | Path, random_init: bool = False) -> torch.nn.Module:
    """``model_class`` (a diffusers ``ModelMixin``) from ``folder`` in float32 — or, ``random_init``, built from its
    ``config.json`` alone with random weights (benchmarks). A folder whose weights do not load is one line."""
    if random_init:
        return model_class.from_config(model_class.load_config(folder))
    try:
        return model_class.from_pretrained(folder, torch_dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{folder}: cannot load the transformer weights: {first}") from None


def cast_keeping_fp32_modules(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters and buffers to ``dtype`` except inside the modules the model class keeps in fp32
    (``_keep_in_fp32_modules``: as ``from_pretrained(torch_dtype=dtype)`` leaves them)."""
    if dtype == torch.float32:
        return
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point() and not keep.intersection(name.split(".")):
            tensor.data = tensor.data.to(dtype)


def locate_transformer_folder(init_from: str | Path, class_name: str, family: str) -> tuple[Path, Path | None]:
    """``(transformer folder, scheduler folder or None)`` of a model folder (with ``transformer/``) or a transformer
    folder (its scheduler in a sibling ``scheduler/``) holding a ``class_name``; :class:`UserError` otherwise (``family``
    names the family in it: ``Wan``)."""
    import json

    root = Path(init_from).expanduser()
    if not root.exists():
        raise UserError(f"model folder {root} does not exist")
    for candidate in (root / "transformer", root):
        cfg = candidate / "config.json"
        if cfg.is_file():
            try:
                found = json.loads(cfg.read_text()).get("_class_name")
            except json.JSONDecodeError as exc:
                raise UserError(f"{cfg}: not valid JSON ({exc.msg})") from None
            if found != class_name:
                raise UserError(f"{cfg}: holds a {found}, not a {class_name}; point init_from at a {family} model")
            for sched in (candidate.parent / "scheduler", root / "scheduler"):
                if (sched / "scheduler_config.json").is_file():
                    return candidate, sched
            return candidate, None
    raise UserError(f"{root}: no transformer/config.json or config.json found; expected a diffusers {family} folder")


def scheduler_shift(shift: float | None, scheduler_dir: Path | None, transformer_dir: Path, role: str) -> float:
    """The flow shift of a role: ``shift`` when given, else its scheduler config's (:class:`UserError` when it has none)."""
    from distillery.models.schedule import read_scheduler_shift

    if shift is not None:
        return shift
    if scheduler_dir is None:
        raise UserError(f"models.{role}: no scheduler/scheduler_config.json beside {transformer_dir}; set models.{role}.shift")
    return read_scheduler_shift(scheduler_dir)


def ready_for_inference(model: ModelBase, device: torch.device, dtype: torch.dtype, attention_backend: str) -> ModelBase:
    """A loaded plugin made an inference one: its transformer on ``device``, eval, frozen, cast to ``dtype`` (diffusers'
    fp32 modules kept), bound, with ``attention_backend`` resolved for there."""
    model.transformer.to(device=device).eval().requires_grad_(False)
    cast_keeping_fp32_modules(model.transformer, dtype)
    model.bind_device(device, compute_dtype=dtype)
    model.set_attention_backend(attention_backend, device, dtype)
    return model
