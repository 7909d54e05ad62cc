"""The pdd stage's recipes (``pdd.method``): parallel decoding distillation — one forward of the student samples a
block of the teacher's fine grid (a trunk + a head bank: the base family's ``pdd`` plugin, e.g. ``PDDWanModel``).
``pdd`` regresses the heads alone; ``dm_pdd`` adds DMD2's distribution matching against a critic. Both start the student from ``pdd.student_init`` and
share :func:`pdd_roles` and :func:`pdd_knobs`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distillery.config.schema import Component
    from distillery.pipeline.launch.run_config import RunInputs
    from distillery.pipeline.params.schema import PDDParams


def pdd_inputs(p: PDDParams) -> dict[str, str]:
    """The student (from the teacher or the distill student: ``pdd.student_init``) and the teacher."""
    return {"student": p.student_init, "teacher": "teacher"}


def pdd_roles(p: PDDParams, run: RunInputs) -> dict[str, Component]:
    """The PDD student (its head bank of ``pdd_steps`` heads) and the frozen teacher whose grid it learns."""
    from stages.recipes.parts import frozen, student

    return {"student": student(p, "pdd", run.init["student"], pdd_steps=p.pdd_steps),
            "teacher": frozen(run.init["teacher"])}


def pdd_knobs(p: PDDParams) -> dict[str, float | int | str]:
    """The method knobs both PDD recipes take (their config classes' fields)."""
    return {"block_size_min": p.block_size_min, "block_size_max": p.block_size_max, "rollout": p.rollout,
            "integrator": p.integrator, "teacher_guidance_scale": p.guidance_scale, "sampling_steps": p.sampling_steps}
