"""Reading a parsed ``params.yaml`` into its typed schema (:mod:`distillery.pipeline.params.schema`), checked whole.

:func:`validate_params` checks the WHOLE file (not only the keys one stage reads) so that
``distillery stage <name>`` refuses a bad value before any stage does work, and names the key as the
user wrote it: ``params.yaml: teacher.steps: -3: must be ≥ 1``. Unknown keys are refused with the
nearest valid key (``did you mean steps?``). A training stage's section is its chosen recipe's ``Params``
(``<stage>.method``); then the rules that tie keys of several sections together (the launch's layout, PDD's
blocks, EMA's start) and each section's own :meth:`~distillery.pipeline.params.schema.TrainingStageParams.problem`.
:func:`as_written` and :func:`to_plain` give the params' plain forms (what DVC records; every key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from distillery.common.errors import UserError
from distillery.config.limits import show_key, unknown_key_message
from distillery.config.schema import model_parallel_problem
from distillery.config.typed import NO_VALUE, FieldError, field_types, from_mapping
from distillery.pipeline.params.schema import TRAINING_STAGES, ParamsSchema, TrainingStageParams


def _check_together(params: ParamsSchema, source: str) -> None:
    """Rules that tie keys of a section together."""
    g = params.gpus
    world = g.world_size
    if world % g.replicate_size:
        raise UserError(f"{source}: gpus.replicate_size: {g.replicate_size}: must divide the {world} processes of gpus.nnodes "
                        f"({g.nnodes}) x gpus.nproc_per_node ({g.nproc_per_node})")


def _check_layouts(params: ParamsSchema, source: str) -> None:
    """Each training stage's SP and TP groups fit the launch ``gpus`` describes
    (:func:`distillery.config.schema.model_parallel_problem`, the trainer's own rule) and its trained model: tensor
    parallelism does not split a LoRA adapter. A stage that publishes a given model trains nothing and is not asked.
    """
    g = params.gpus
    for stage in TRAINING_STAGES:
        p = getattr(params, stage)
        if p.given():
            continue
        layout = p.layout(g)
        named = {k: f"{stage if getattr(p, k) is not None else 'gpus'}.{k}" for k in layout}  # the key that set it
        problem = model_parallel_problem(layout["sp_size"], layout["tp_size"], g.world_size, g.nproc_per_node,
                                         g.replicate_size)
        if problem:
            key, why = problem
            shown = {**named, "replicate_size": "gpus.replicate_size",
                     "sp_size × tp_size": f"{named['sp_size']} × {named['tp_size']}"}[key]
            raise UserError(f"{source}: {shown}: {why} (stage {stage})")
        if layout["tp_size"] > 1 and p.lora_rank > 0:
            raise UserError(f"{source}: {stage}.lora_rank: {p.lora_rank}: tensor parallelism ({named['tp_size']} "
                            f"{layout['tp_size']}) does not split a LoRA adapter; use {stage}.lora_rank 0 or "
                            f"{stage}.tp_size 1 (sp_size splits the sequence whatever trains)")


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
    """An EMA that starts averaging at or after a stage's last step would ship the raw weights under
    its name."""
    for stage in TRAINING_STAGES:
        p = getattr(params, stage)
        if p.ema_decay is not None and p.ema_start_step >= p.steps:
            raise UserError(f"{source}: {stage}.ema_start_step: {p.ema_start_step}: must be below {stage}.steps ({p.steps}): "
                            f"an EMA that starts averaging at or after the last step is the raw weights")


RecipeParams = Mapping[str, Mapping[str, type[TrainingStageParams]]]  # stage -> method -> its recipe's Params


def _training_section(stage: str, given: Any, choices: Mapping[str, type[TrainingStageParams]]) -> TrainingStageParams:
    """The typed section of training stage ``stage``: its ``method`` one of ``choices`` (the stage's
    recipes), the rest read by the chosen recipe's ``Params`` (the section's knobs and the recipe's
    own). A knob only another recipe of the stage declares is not read — it is the chosen recipe's
    section that the stage sees — but, written in the file, it is held to that recipe's declaration
    all the same: a bad value is refused whichever method runs."""
    section = field_types(ParamsSchema)[stage]
    if given is None:
        given = {}
    if not isinstance(given, dict):
        return from_mapping(section, given, stage)  # the converter's own line (expected a mapping)
    method = given.get("method", section.__dataclass_fields__["method"].default)
    if not isinstance(method, str) or method not in choices:
        raise FieldError(f"{stage}.method", method, f"valid values: {', '.join(choices)} (stages/recipes/{stage}/)")
    chosen = choices[method]
    if not issubclass(chosen, section):
        raise TypeError(f"stages/recipes/{stage}/{method}.py: its Params must subclass {section.__name__}")
    mine = {f.name for f in dataclasses.fields(chosen)}
    known = list(dict.fromkeys(f.name for cls in (chosen, *choices.values()) for f in dataclasses.fields(cls)))
    unknown = [k for k in given if k not in known]
    if unknown:  # a key no recipe of the stage declares: named with the nearest of all of theirs
        raise FieldError(f"{stage}.{show_key(unknown[0])}", NO_VALUE, unknown_key_message(unknown[0], known))
    typed = from_mapping(chosen, {k: v for k, v in given.items() if k in mine}, stage)
    for other in dict.fromkeys(choices.values()):  # the other recipes' own knobs written here: their rules hold too
        theirs = {f.name for f in dataclasses.fields(other)} - mine
        if other is not chosen and theirs & given.keys():
            from_mapping(other, {k: v for k, v in given.items() if k in theirs}, stage)
    return typed


def validate_params(data: Any, source: str = "params.yaml", recipes: RecipeParams | None = None) -> ParamsSchema:
    """The typed params of the parsed ``params.yaml`` mapping ``data``; a bad key or value is a
    one-line UserError.

    ``recipes``: each training stage's recipes' ``Params`` (None: the current workspace's,
    :func:`distillery.pipeline.params.recipes.recipe_params`): a training section is its chosen
    recipe's. Messages start with ``source`` (the file as the user named it) and name the key as
    written.
    """
    if recipes is None:
        from distillery.pipeline.params.recipes import recipe_params

        recipes = recipe_params()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{source}: the top level must be a mapping")
    try:
        params = from_mapping(ParamsSchema, {k: v for k, v in data.items() if k not in TRAINING_STAGES}, "")
        for stage in TRAINING_STAGES:
            setattr(params, stage, _training_section(stage, data.get(stage), recipes[stage]))
    except FieldError as exc:  # the converter's facts, worded for params.yaml
        raise UserError(exc.worded(source)) from None
    _check_together(params, source)
    _check_layouts(params, source)
    _check_pdd_blocks(params, source)
    _check_ema(params, source)
    for stage in TRAINING_STAGES:
        problem = getattr(params, stage).problem(stage)
        if problem:
            raise UserError(f"{source}: {problem}")
    return params


def as_written(data: Any, defaults: Any) -> Any:
    """The params as the file wrote them (what DVC records in ``dvc.lock``) with every absent key at
    its default: ``data`` (the validated mapping, or a section of it) over ``defaults`` (the plain
    defaults); a key the file holds that ``defaults`` lack (a knob of a recipe not chosen) as
    written."""
    if isinstance(defaults, dict):
        given = data if isinstance(data, dict) else {}
        return {**{k: as_written(given[k], v) if k in given else v for k, v in defaults.items()},
                **{k: v for k, v in given.items() if k not in defaults}}
    return data


def to_plain(params: ParamsSchema) -> dict[str, Any]:
    """The typed params as a nested mapping (every key present; numbers as the schema types them).
    """
    return dataclasses.asdict(params)
