"""The declarative table of the training stages: one :class:`TrainingStageSpec` per stage.

A training stage is its run-config template in ``stages/`` filled in from the typed ``params.yaml``
by this table (:func:`distillery.pipeline.launch.run_config.fill_run_config`: each value set as the Python value
it is; the template holds null there) — no stage-specific code. Which run-config key a knob sets is declared
by the knob itself, on its field of :mod:`distillery.pipeline.params.schema` (``sets``, and ``when`` for a
recipe's own knob): a row takes ``seed`` and every such knob of its stage's section, and names only a knob of
another section it borrows. Adding a training stage: a template in ``stages/``, a row here, a dvc.yaml stage
(``cmd: distillery stage <name>``, its ``params:`` covering every key the row reads), and the params.yaml section
with its schema (``stages/README.md`` has the list). A row's ``validation`` makes the stage's model a candidate of
the validate stage (its name, steps and guidance: :class:`ValidationSpec`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, replace
from typing import Any

from distillery.pipeline.params.schema import ParamsSchema, Setting, run_config_settings

DATA_ARTIFACT = "latents"  # a training stage trains on artifacts/latents/data (one with a data_key: the stage it names)
DATA_ARTIFACTS = ("latents", "prompts")  # what a data_key may name: the latent set, or the prompt-only set
EMA_CALLBACK = "ema"  # the run config's callbacks.<name> of a stage's EMA (params.yaml <stage>.ema_decay set)
EMA_TARGET = "distillery.callbacks.ema.EMACallback"


@dataclass(frozen=True)
class StageVariant:
    """One choice of a stage whose recipe a ``params.yaml`` key picks (``distill.method``,
    ``pdd.student_init``): its template, the knob of another stage it ``borrows`` (that knob's key → the
    run-config keys it sets here; the stage's own knobs say themselves which recipe takes them) and, when the
    choice is where a role starts from, its ``inputs`` (replacing the stage's)."""

    template: str
    borrows: dict[str, tuple[str, ...]] = field(default_factory=dict)
    inputs: dict[str, str] | None = None
    trajectories: bool = False  # the recipe trains on the teacher's ODE trajectories the stage makes first


@dataclass(frozen=True)
class ValidationSpec:
    """How a training stage's model is a candidate of the validate stage (:func:`stages.validate.table_candidates`).

    - ``lineage``: the name of the stage's artifact among validate's lineage inputs;
    - ``steps``: the params.yaml key of its sampling steps — an int, or a list of ints (one candidate
      each) — or None: its sampling contract's own (``sampling.json``);
    - ``guidance``: the params.yaml key of its CFG scale, or None: the contract's (a distilled
      student's guidance is distilled in: none);
    - ``sampler``: None: sampled as the artifact's ``sampling.json`` says; a registered sampler
      name: that sampler at its defaults over the artifact's weights (the teacher's Euler baselines).

    A candidate is named ``<stage>_<steps>``; validate takes the rows in table order, and the first
    candidate is the reference every distance is measured against (put the teacher first).
    """

    lineage: str
    steps: str | None = None
    guidance: str | None = None
    sampler: str | None = None

    def __post_init__(self) -> None:
        if self.sampler is not None and self.steps is None:
            raise ValueError(f"validation {self.lineage}: a sampler of its own ({self.sampler}) needs a steps key")

    def params_read(self) -> list[str]:
        """The params.yaml keys the validate stage reads for this row."""
        return [k for k in (self.steps, self.guidance) if k is not None]


@dataclass(frozen=True)
class TrainingStageSpec:
    """One training stage, declared.

    - ``template``: the run-config template, relative to the pipeline folder (a dvc.yaml dep of the stage);
    - ``inputs``: role → the stage whose artifact the role starts from (``models.<role>.init_from =
      artifacts/<stage>/model``); recorded in lineage and the resume key as ``<role>_init``;
    - the knobs it takes (:meth:`settings`): ``seed`` and every knob of the stage's own ``params.yaml`` section
      that declares the run-config keys it sets (:func:`distillery.pipeline.params.schema.rule`);
      ``borrows``: a knob of another section, the resolved recipe's (a :class:`StageVariant`'s);
    - ``export_role``: the role whose trained weights the artifact ships (``model/transformer``);
    - ``data_key``: the params.yaml key whose value names the stage whose ``data/`` the run trains on
      (``distill.data: latents | prompts``; without one :data:`DATA_ARTIFACT`), applied by :meth:`resolve` into
      ``data``; dvc.yaml names that dep ``artifacts/${<key>}``;
    - ``variant_key`` / ``variants``: a stage with several recipes — the params.yaml key whose value
      names a :class:`StageVariant` (its template replaces ``template``, its borrowed knobs join ``borrows``);
      :meth:`resolve` gives the plain spec of the chosen one;
    - ``method_key`` / ``methods``: a second choice, of the method, for a stage whose ``variant_key``
      already picks where a role starts from (``pdd.method`` beside ``pdd.student_init``): the
      :class:`StageVariant` its value names replaces the template, joins its borrowed knobs, and *adds* its
      ``inputs`` to the roles' (a critic's init), applied after the variant;
    - ``given_source_key`` / ``given_path_key`` / ``given_value``: a stage whose model may be given rather than
      trained (``teacher.source: base``, ``pretrain.source: given``): the stage then publishes the model folder
      ``given_path_key`` names (its default ``artifacts/base/model``: the base artifact's) as its artifact, untrained
      (:func:`stages.training.publish_given_model`);
    - ``input_keys``: role → the params.yaml key whose value names the stage that role starts from
      (``distill.critic_init: teacher | base``), applied last; dvc.yaml names that dep
      ``artifacts/${<key>}``;
    - ``validation``: how validate scores the stage's model (:class:`ValidationSpec`), None: it does not;
    - ``trajectories``: the stage trains on the teacher's ODE trajectories, which it makes first from the
      teacher artifact and the latent set's prompts (:mod:`stages.trajectories`; set by the chosen
      method, ``pretrain.method: ode_init``), instead of on the latents.
    """

    name: str
    template: str
    inputs: dict[str, str]
    borrows: dict[str, tuple[str, ...]] = field(default_factory=dict)
    export_role: str = "student"
    data_key: str | None = None
    data: str = DATA_ARTIFACT  # the stage whose data/ the run trains on (a resolved spec: data_key's choice)
    variant_key: str | None = None
    variants: dict[str, StageVariant] = field(default_factory=dict)
    method_key: str | None = None
    methods: dict[str, StageVariant] = field(default_factory=dict)
    input_keys: dict[str, str] = field(default_factory=dict)
    given_source_key: str | None = None
    given_path_key: str | None = None
    given_value: str = "base"  # the value of given_source_key that asks for the given model
    validation: ValidationSpec | None = None
    trajectories: bool = False

    def input_artifacts(self) -> list[tuple[str, str]]:
        """``[(lineage role, artifact stage)]``: each role's init, then the training data."""
        return [(f"{role}_init", stage) for role, stage in self.inputs.items()] + [("data", self.data)]

    def resolve(self, params: Any) -> "TrainingStageSpec":
        """The plain spec of the variant ``params.get(variant_key)`` names, then of the method
        ``params.get(method_key)`` names, with each ``input_keys`` role starting from the stage its key
        names (``self`` without variants, methods or input keys)."""
        spec = self
        if spec.variant_key is not None:
            choice = params.get(spec.variant_key)
            if choice not in spec.variants:  # params.yaml was validated; a table/schema mismatch is a bug
                raise KeyError(f"stage {spec.name}: {spec.variant_key} = {choice!r} has no variant ({', '.join(spec.variants)})")
            variant = spec.variants[choice]
            spec = replace(spec, template=variant.template, borrows={**spec.borrows, **variant.borrows}, variant_key=None,
                           variants={}, inputs=dict(variant.inputs) if variant.inputs is not None else spec.inputs)
        if spec.method_key is not None:
            choice = params.get(spec.method_key)
            if choice not in spec.methods:
                raise KeyError(f"stage {spec.name}: {spec.method_key} = {choice!r} has no method ({', '.join(spec.methods)})")
            method = spec.methods[choice]
            spec = replace(spec, template=method.template, borrows={**spec.borrows, **method.borrows}, method_key=None,
                           methods={}, inputs={**spec.inputs, **(method.inputs or {})}, trajectories=method.trajectories)
        if spec.input_keys:
            spec = replace(spec, inputs={**spec.inputs, **{role: str(params.get(key)) for role, key in spec.input_keys.items()}},
                           input_keys={})
        if spec.data_key is not None:
            data = params.get(spec.data_key)
            if data not in DATA_ARTIFACTS:
                raise KeyError(f"stage {spec.name}: {spec.data_key} = {data!r} names no data artifact ({', '.join(DATA_ARTIFACTS)})")
            spec = replace(spec, data=data, data_key=None)
        return spec

    def templates(self) -> list[str]:
        """Every template the stage may fill (its dvc.yaml deps)."""
        chosen = [v.template for v in (*self.variants.values(), *self.methods.values())]
        return list(dict.fromkeys(chosen)) if chosen else [self.template]

    def settings(self) -> list[Setting]:
        """The knobs the stage may take, whichever recipe: ``seed``, every knob of its section that declares the
        run-config keys it sets (:func:`~distillery.pipeline.params.schema.run_config_settings`), then those it borrows."""
        sections = typing.get_type_hints(ParamsSchema)
        if self.name not in sections:
            raise KeyError(f"stage {self.name}: params.yaml has no section {self.name} (pipeline/params/schema.py)")
        borrowed = {**self.borrows, **{k: v for c in (*self.variants.values(), *self.methods.values()) for k, v in c.borrows.items()}}
        return (run_config_settings(ParamsSchema, "") + run_config_settings(sections[self.name], self.name)
                + [Setting(key, tuple(keys), {}) for key, keys in borrowed.items()])

    def params_read(self) -> list[str]:
        """Every params.yaml key the stage reads, whichever variant: its knobs (:meth:`settings`) and what picks
        them, its EMA's (:meth:`ema_callback`) and its LoRA's (:meth:`lora_overrides`), its choices."""
        keys = [s.key for s in self.settings()]
        keys += [k for s in self.settings() for k in s.when if k not in keys]
        return keys + [k for k in (*self.ema_keys(), *self.lora_keys(), self.variant_key, self.method_key,
                                   *self.input_keys.values(), self.given_source_key, self.given_path_key, self.data_key)
                       if k and k not in keys]

    def given(self, params: Any) -> bool:
        """Whether ``params`` ask for the stage's model to be given (``teacher.source: base``), not trained."""
        return self.given_source_key is not None and params.get(self.given_source_key) == self.given_value

    def lora_keys(self) -> tuple[str, str]:
        """The params.yaml keys of the stage's LoRA: ``<stage>.lora_rank`` (0: off), ``<stage>.lora_alpha`` (null: the rank)."""
        return f"{self.name}.lora_rank", f"{self.name}.lora_alpha"

    def lora_overrides(self, params: Any) -> list[tuple[str, Any]]:
        """``models.<export_role>.lora`` (rank, alpha; the run config's default target modules) when ``<stage>.lora_rank``
        is above 0, so the role trains an adapter and the artifact ships it beside the merged weights; none at 0."""
        rank_key, alpha_key = self.lora_keys()
        rank = int(params.get(rank_key))
        if rank <= 0:
            return []
        alpha = params.get(alpha_key)
        return [(f"models.{self.export_role}.lora", {"rank": rank, "alpha": float(rank if alpha is None else alpha)})]

    def ema_keys(self) -> tuple[str, str]:
        """The params.yaml keys of the stage's EMA: ``<stage>.ema_decay`` (null: off), ``<stage>.ema_start_step``."""
        return f"{self.name}.ema_decay", f"{self.name}.ema_start_step"

    def ema_callback(self, params: Any) -> dict[str, Any] | None:
        """The run config's ``callbacks.ema`` entry when ``<stage>.ema_decay`` is set (None: no EMA, the
        template's callbacks as they are): an EMA of ``export_role``'s trainable modules, whose shadow the
        stage then publishes (``stages.training.shipped_weights``)."""
        decay_key, start_key = self.ema_keys()
        decay = params.get(decay_key)
        if decay is None:
            return None
        return {"_target_": EMA_TARGET, "decay": float(decay), "start_step": int(params.get(start_key)),
                "roles": [self.export_role]}

    def config_overrides(self, params: Any) -> list[tuple[str, Any]]:
        """``(run-config key, typed value)`` of each knob the recipe ``params`` pick takes (a resolved spec)."""
        if self.variant_key is not None or self.method_key is not None:
            raise ValueError(f"stage {self.name}: the knobs of a resolved spec only (TrainingStageSpec.resolve)")
        return [(config_key, params.get(s.key)) for s in self.settings() if s.taken(params.get) for config_key in s.sets]

TRAINING_STAGES: dict[str, TrainingStageSpec] = {
    spec.name: spec
    for spec in (
        TrainingStageSpec(
            name="teacher",
            template="stages/teacher_sft.yaml",
            inputs={"student": "base"},
            # teacher.source: base publishes a given model (teacher.path: e.g. the 14B; its default artifacts/base/model: the base) untrained
            given_source_key="teacher.source", given_path_key="teacher.path",
            # the reference: many- and few-step Euler with CFG (validate.teacher_steps, the first is the reference)
            validation=ValidationSpec("teacher", steps="validate.teacher_steps", guidance="validate.guidance_scale",
                                      sampler="euler"),
        ),
        TrainingStageSpec(
            name="pretrain",
            template="stages/pretrain_dfsft.yaml",
            inputs={"student": "teacher"},
            # from the teacher (its SFT), or from the base when the teacher is a given, larger model
            input_keys={"student": "pretrain.student_init"},
            # pretrain.source: given publishes pretrain.path (e.g. an imported ode_init.pt) as the student, untrained
            given_source_key="pretrain.source", given_value="given", given_path_key="pretrain.path",
            # dfsft: Diffusion-Forcing SFT on the latents; ode_init: KD onto the teacher's ODE trajectories (made first)
            method_key="pretrain.method",
            data_key="pretrain.data",  # ode_init: the trajectories' prompts from the latent set or the prompt-only set
            # (ode_init_bidirectional: a bidirectional student, the init of distill.method: dmd2)
            # (pretrain.chunk_size and pretrain.t_list say which of them take them)
            methods={"dfsft": StageVariant("stages/pretrain_dfsft.yaml"),
                     "ode_init": StageVariant("stages/pretrain_ode_init.yaml", trajectories=True),
                     "ode_init_bidirectional": StageVariant("stages/pretrain_ode_init_bidirectional.yaml", trajectories=True)},
            validation=ValidationSpec("pretrain", steps="validate.pretrain_steps", guidance="validate.guidance_scale"),
        ),
        TrainingStageSpec(
            name="distill",
            template="stages/distill_self_forcing.yaml",
            inputs={"student": "pretrain", "teacher": "teacher", "critic": "teacher"},
            variant_key="distill.method",
            # the critic (fake score) starts from the teacher, or from the student's base as the published recipes do
            input_keys={"critic": "distill.critic_init"},
            data_key="distill.data",  # the latent set, or the prompt-only set (both methods roll out from noise)
            # self_forcing: the causal student attends block-causally over the chunks it was pretrained on
            variants={"self_forcing": StageVariant("stages/distill_self_forcing.yaml",
                                                   borrows={"pretrain.chunk_size": ("models.student.chunk_size",)}),
                      "dmd2": StageVariant("stages/distill_dmd2.yaml")},
            validation=ValidationSpec("student"),  # its ladder as its contract says, no CFG (the guidance is distilled in)
        ),
        TrainingStageSpec(
            name="pdd",
            template="stages/pdd.yaml",
            inputs={"student": "teacher", "teacher": "teacher"},
            # the teacher is always the teacher artifact; the student starts from it or from the distill student
            variant_key="pdd.student_init",
            variants={"teacher": StageVariant("stages/pdd.yaml", inputs={"student": "teacher", "teacher": "teacher"}),
                      "distill": StageVariant("stages/pdd.yaml", inputs={"student": "distill", "teacher": "teacher"})},
            # pdd: the head regression alone; dm_pdd: + DMD2's distribution matching against a critic (from the teacher)
            method_key="pdd.method",
            methods={"pdd": StageVariant("stages/pdd.yaml"),
                     "dm_pdd": StageVariant("stages/pdd_dm.yaml", inputs={"critic": "teacher"})},
            data_key="pdd.data",  # the latent set, or the prompt-only set (rollout: simulate; params check refuses data_latent)
            validation=ValidationSpec("pdd", steps="validate.pdd_nfe"),  # its NFE curve: the fused-block sampler at each NFE
        ),
    )
}
