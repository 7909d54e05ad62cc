"""Per-GPU memory of one training step, estimated from the peaks measured on one GPU (docs/gpus.md, "Planning").

The model (every byte count per GPU; P a role's parameters, G its FSDP group: ``world / replicate_size`` ranks, the
data and SP ranks of one copy together, as :func:`distillery.components.distributed.build_mesh` shards):

- **static**, per role: a trainable role with full weights and AdamW holds its fp32 master (4P), fp32 gradients (4P)
  and two fp32 moments (8P): 16P / G under FSDP2; on one GPU without FSDP it also holds its bf16 compute copy (18P,
  :class:`~distillery.components.precision.ComputeCopy`). A frozen role: its fp32 master, 4P / G, under FSDP2; cast
  to bf16 in place (2P) on one GPU without it (``engine.builder.place_model``).
- **FSDP working set** (FSDP2 only): the blocks alive unsharded at once — two bf16 gathers (the running block and the
  prefetched one) and one block's fp32 gradient before its reduce-scatter: 8 P / blocks of the largest role.
  An estimate: no multi-GPU run has measured it.
- **activations**: ``k × batch × tokens / sp × blocks × dim`` bytes — each block's saved tensors are ``tokens × dim``
  wide, Ulysses SP leaves each rank ``tokens / sp`` of them (the all-to-all's head shards are as large). ``k`` is
  fitted per (method, activation checkpointing on or off) from one measured one-GPU peak (:data:`FITTED`: its peak
  less its static bytes, over its tokens × blocks × dim), linear in the share of blocks recomputed between the two.

:data:`HELD_OUT` are measured peaks the fit does not use, which the model predicts (``tests/test_memory_plan.py``):
the share of blocks recomputed (DMD2 at 0.2 and 0.34), a 14B teacher beside the 1.3B roles, and another width
(Wan 2.2 TI2V-5B at 27,280 tokens under FSDP2 on one rank).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """A transformer's size as the estimate reads it: ``params`` (count), ``blocks`` × ``dim`` (the activations'
    width), ``heads`` (an SP group must divide them), ``pixels_per_token`` (VAE × patch, spatial) and
    ``frames_per_latent`` (the VAE's temporal stride: 4k + 1 frames → k + 1 latent frames)."""

    name: str
    params: float
    blocks: int
    dim: int
    heads: int
    pixels_per_token: int = 16
    frames_per_latent: int = 4

    def tokens(self, frames: int, height: int, width: int) -> int:
        """Tokens of one ``frames × height × width`` video (pixels)."""
        latent_frames = (frames - 1) // self.frames_per_latent + 1
        return latent_frames * (height // self.pixels_per_token) * (width // self.pixels_per_token)


#: The shapes measured (BENCHMARKS.md) and planned for; ``params`` as the benches counted them.
SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("wan2.1-t2v-1.3b", 1.419e9, 30, 1536, 12),
    ModelShape("wan2.2-ti2v-5b", 5.00e9, 30, 3072, 24, pixels_per_token=32),
    ModelShape("wan2.1-t2v-14b", 14.29e9, 40, 5120, 40),
)}
WAN_1_3B, WAN22_5B, WAN_14B = (SHAPES[n] for n in ("wan2.1-t2v-1.3b", "wan2.2-ti2v-5b", "wan2.1-t2v-14b"))

#: The roles each method holds: ``(name, trainable)``. The PDD head bank (8 × dim × 64 weights) is left out.
METHOD_ROLES: dict[str, tuple[tuple[str, bool], ...]] = {
    "sft": (("student", True),),
    "dfsft": (("student", True),),
    "ode_init": (("student", True), ("teacher", False)),
    "ode_init_bidirectional": (("student", True), ("teacher", False)),
    "dmd2": (("student", True), ("critic", True), ("teacher", False)),
    "self_forcing": (("student", True), ("critic", True), ("teacher", False)),
    "pdd": (("student", True), ("teacher", False)),
    "dm_pdd": (("student", True), ("critic", True), ("teacher", False)),
}
#: A method without a measured peak of its own takes the activations of the one named (said so in the basis).
ACTIVATIONS_AS: dict[str, str] = {"ode_init": "sft", "ode_init_bidirectional": "sft", "dm_pdd": "dmd2"}


@dataclass(frozen=True)
class MeasuredPeak:
    """One GPU's measured peak (``torch.cuda.max_memory_allocated``) of a method's step, batch 1, with where it is
    recorded. ``fsdp``: FSDP2 on the one rank (no compute copy); ``teacher``: the frozen role's shape when it is not
    ``shape``."""

    method: str
    ac_fraction: float
    shape: ModelShape
    tokens: int
    peak_gib: float
    source: str
    fsdp: bool = False
    teacher: ModelShape | None = None


#: The peaks the activation constants are fitted from: Wan2.1-1.3B shape, 81×480×832 (32,760 tokens), one H200.
FITTED: tuple[MeasuredPeak, ...] = (
    MeasuredPeak("sft", 0.0, WAN_1_3B, 32_760, 105.8, "BENCHMARKS.md 'The one-GPU step' (2026-12-01)"),
    MeasuredPeak("sft", 1.0, WAN_1_3B, 32_760, 29.5, "BENCHMARKS.md 'LoRA against full weights' (2026-12-03, fifth session)"),
    MeasuredPeak("dfsft", 1.0, WAN_1_3B, 32_760, 32.5, "BENCHMARKS.md 'FlashAttention-4, block-sparse causal' (2026-12-01)"),
    MeasuredPeak("dmd2", 0.0, WAN_1_3B, 32_760, 134.9, "BENCHMARKS.md 'DMD2 and Self-Forcing iterations' (2026-11-30)"),
    MeasuredPeak("dmd2", 1.0, WAN_1_3B, 32_760, 58.6, "BENCHMARKS.md 'LoRA against full weights' (2026-12-03, fifth session)"),
    MeasuredPeak("self_forcing", 1.0, WAN_1_3B, 32_760, 73.3, "BENCHMARKS.md 'Self-Forcing with a Wan2.1-14B-shaped teacher', 1.3B row (2026-12-03)"),
    MeasuredPeak("pdd", 0.0, WAN_1_3B, 32_760, 108.8, "BENCHMARKS.md 'PDD step' (2026-12-01)"),
)
#: Measured peaks the fit does not use: what the model must predict.
HELD_OUT: tuple[MeasuredPeak, ...] = (
    MeasuredPeak("dmd2", 0.2, WAN_1_3B, 32_760, 119.3, "BENCHMARKS.md 'Real-shape DAG', AC fraction table (2026-12-01)"),
    MeasuredPeak("dmd2", 0.34, WAN_1_3B, 32_760, 108.9, "BENCHMARKS.md 'Real-shape DAG', AC fraction table (2026-12-01)"),
    MeasuredPeak("self_forcing", 1.0, WAN_1_3B, 32_760, 97.3, "BENCHMARKS.md 'Self-Forcing with a Wan2.1-14B-shaped teacher' (2026-12-03)",
                 teacher=WAN_14B),
    MeasuredPeak("sft", 1.0, WAN22_5B, 27_280, 81.9, "BENCHMARKS.md 'A Wan 2.2 TI2V-5B SFT step at its native 720p' (2026-12-03)",
                 fsdp=True),
)


@dataclass(frozen=True)
class Layout:
    """Where a step runs: ``world`` GPUs, ``replicate_size`` HSDP copies, ``sp_size`` GPUs a sample. ``fsdp``: FSDP2
    shards the roles (the default on several GPUs; on one only with ``shard_single_rank``)."""

    world: int = 1
    replicate_size: int = 1
    sp_size: int = 1
    fsdp: bool | None = None

    @property
    def sharded(self) -> bool:
        return self.world > 1 if self.fsdp is None else self.fsdp

    @property
    def shard_group(self) -> int:
        """The GPUs one copy of a role is sharded over (1 without FSDP)."""
        return self.world // self.replicate_size if self.sharded else 1


@dataclass(frozen=True)
class MemoryEstimate:
    """GiB per GPU: ``static`` per role, the FSDP ``working`` set, ``activations``; ``basis`` says where ``k`` came from."""

    static: dict[str, float]
    working: float
    activations: float
    basis: str

    @property
    def total(self) -> float:
        return sum(self.static.values()) + self.working + self.activations


def static_gib(params: float, trainable: bool, layout: Layout) -> float:
    """One role's persistent GiB per GPU (module doc)."""
    if layout.sharded:
        return (16 if trainable else 4) * params / layout.shard_group / GIB
    return (18 if trainable else 2) * params / GIB


def _roles(method: str, shape: ModelShape, teacher: ModelShape | None) -> list[tuple[str, ModelShape, bool]]:
    if method not in METHOD_ROLES:
        raise ValueError(f"no memory model for method {method!r}; known: {', '.join(sorted(METHOD_ROLES))}")
    return [(name, (teacher or shape) if name == "teacher" else shape, trainable) for name, trainable in METHOD_ROLES[method]]


def _static(method: str, shape: ModelShape, teacher: ModelShape | None, layout: Layout) -> dict[str, float]:
    return {name: static_gib(s.params, trainable, layout) for name, s, trainable in _roles(method, shape, teacher)}


def _fitted_k(method: str, ac: float) -> float | None:
    """Bytes per token per (block × dim) of ``method`` at AC on (``ac`` 1) or off (0), from :data:`FITTED`."""
    for p in FITTED:
        if p.method == method and p.ac_fraction == ac:
            layout = Layout(fsdp=p.fsdp)
            rest = sum(_static(p.method, p.shape, p.teacher, layout).values())
            if p.fsdp:
                rest += working_gib(p.shape)
            return (p.peak_gib - rest) * GIB / (p.tokens * p.shape.blocks * p.shape.dim)
    return None


def activation_constant(method: str, ac_fraction: float) -> tuple[float, str] | None:
    """``(k, basis)``: bytes per token per (block × dim) at ``ac_fraction`` of the blocks recomputed; None where no
    measured peak gives it (a method measured only with full AC, asked at less)."""
    own = ACTIVATIONS_AS.get(method, method)
    basis = f"{method}'s activations as {own}'s (not measured on its own); " if own != method else ""
    on, off = _fitted_k(own, 1.0), _fitted_k(own, 0.0)
    if ac_fraction <= 0.0 and off is not None:
        return off, basis + f"k: {own}'s at AC off (measured, 1.3B)"
    how = f"k: {own}'s at AC 1.0 (measured, 1.3B)"
    if on is None and off is not None:  # e.g. PDD, measured without AC: SFT's ratio of on to off (one student graph alive)
        on = off * _fitted_k("sft", 1.0) / _fitted_k("sft", 0.0)  # type: ignore[operator]
        how = f"k: {own}'s at AC off (measured, 1.3B) × SFT's AC on/off ratio (estimated)"
    if ac_fraction >= 1.0 and on is not None:
        return on, basis + how
    if on is None or off is None:
        return None
    return off + (on - off) * ac_fraction, basis + f"k: {own}'s, linear in the AC share between off and on (measured, 1.3B)"


def working_gib(shape: ModelShape) -> float:
    """FSDP2's unsharded blocks in flight (module doc): 8 bytes per parameter of one block."""
    return 8 * shape.params / shape.blocks / GIB


def estimate_step(method: str, shape: ModelShape, tokens: int, batch: int = 1, ac_fraction: float = 1.0,
                  layout: Layout = Layout(), teacher: ModelShape | None = None) -> MemoryEstimate | None:
    """The peak GiB per GPU of one ``method`` step on ``batch`` samples of ``tokens`` each per data rank (module doc);
    None where the activations of that (method, AC) were never measured. Every role is ``shape`` but a frozen
    ``teacher`` of its own shape. A rank holds ``ceil(tokens / sp)`` tokens (the last shard padded); an SP group that
    does not divide the heads is a ValueError (the stage refuses it)."""
    if shape.heads % layout.sp_size:
        raise ValueError(f"sp_size {layout.sp_size} does not divide {shape.name}'s {shape.heads} heads")
    found = activation_constant(method, ac_fraction)
    if found is None:
        return None
    k, basis = found
    activations = k * batch * -(-tokens // layout.sp_size) * shape.blocks * shape.dim / GIB
    working = max(working_gib(s) for _, s, _ in _roles(method, shape, teacher)) if layout.sharded else 0.0
    return MemoryEstimate(_static(method, shape, teacher, layout), working, activations, basis)


def predict(point: MeasuredPeak) -> MemoryEstimate | None:
    """The model's estimate of a measured one-GPU point (batch 1)."""
    return estimate_step(point.method, point.shape, point.tokens, 1, point.ac_fraction, Layout(fsdp=point.fsdp),
                         point.teacher)
