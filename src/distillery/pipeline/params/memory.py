"""Each training stage's memory per GPU as ``params.yaml`` (or a profile over it) sets the stage up: its method, batch,
activation checkpointing and layout (``gpus.*``, ``<stage>.sp_size``) at the latent size the latent set will have,
through :func:`distillery.components.memory_plan.estimate_step` — what ``distillery params memory`` prints and the
profiles in ``docs/profiles/`` quote (``tests/test_memory_plan.py`` holds them equal)."""

from __future__ import annotations

from dataclasses import dataclass

from distillery.components.memory_plan import METHOD_ROLES, Layout, MemoryEstimate, ModelShape, estimate_step
from distillery.pipeline.params.schema import ParamsSchema

TRAINING_STAGES = ("teacher", "pretrain", "distill", "pdd", "posttrain")


@dataclass(frozen=True)
class StageMemory:
    """One training stage's estimate (None with ``note`` saying why none is made)."""

    stage: str
    method: str
    layout: Layout
    tokens: int
    batch: int
    estimate: MemoryEstimate | None
    note: str = ""


def video_tokens(typed: ParamsSchema, shape: ModelShape) -> int:
    """Tokens of one latent-set video: ``latents.num_frames/height/width``, else the synthetic clips' (as the stages)."""
    lat, clips = typed.latents, typed.clips
    frames = lat.num_frames or clips.num_frames
    return shape.tokens(frames, lat.height or clips.size, lat.width or clips.size)


def stage_memory(typed: ParamsSchema, shape: ModelShape, teacher: ModelShape | None = None) -> list[StageMemory]:
    """Every training stage in ``typed``, its roles all of ``shape`` but a frozen teacher of shape ``teacher`` (a given
    one beside a smaller student: ``teacher.source: base``, ``teacher.path``)."""
    gpus, tokens, rows = typed.gpus, video_tokens(typed, shape), []
    for stage in TRAINING_STAGES:
        section = getattr(typed, stage)
        layout_sizes = section.layout(gpus)
        layout = Layout(gpus.world_size, gpus.replicate_size, layout_sizes["sp_size"])
        skip = ("off: no model" if section.off()
                else "given: published untrained" if section.given()
                else f"{section.method}: no memory model of its roles" if section.method not in METHOD_ROLES
                else f"{stage}.lora_rank {section.lora_rank}: a LoRA's memory is not modelled" if section.lora_rank
                else f"{stage}.tp_size {layout_sizes['tp_size']}: TP's memory is not modelled" if layout_sizes["tp_size"] > 1
                else "")
        ac = section.activation_checkpointing_fraction if section.activation_checkpointing else 0.0
        estimate = None if skip else estimate_step(section.method, shape, tokens, section.batch_size, ac, layout, teacher)
        if estimate is None and not skip:
            skip = f"{section.method}'s activations at activation checkpointing {ac:g} were never measured"
        rows.append(StageMemory(stage, section.method, layout, tokens, section.batch_size, estimate, skip))
    return rows


def format_rows(rows: list[StageMemory], shape: ModelShape, teacher: ModelShape | None = None) -> list[str]:
    """The table ``distillery params memory`` prints: one line per stage, GiB per GPU."""
    beside = f", a frozen {teacher.name} teacher" if teacher else ""
    out = [f"{shape.name} ({shape.params / 1e9:.2f} B parameters, {shape.blocks} blocks × {shape.dim}, {shape.heads} heads){beside}: "
           f"{rows[0].tokens:,} tokens a video; GiB per GPU, estimated (docs/gpus.md)"]
    for r in rows:
        where = (f"{r.stage} ({r.method}): world {r.layout.world}, replicate {r.layout.replicate_size}, "
                 f"shard {r.layout.shard_group}, sp {r.layout.sp_size}, batch {r.batch}")
        if r.estimate is None:
            out.append(f"{where}: no estimate ({r.note})")
            continue
        e = r.estimate
        roles = " + ".join(f"{name} {gib:.1f}" for name, gib in e.static.items())
        out.append(f"{where}: {e.total:.1f} = static {roles} + FSDP working set {e.working:.1f} "
                   f"+ activations {e.activations:.1f} ({e.basis})")
    return out
