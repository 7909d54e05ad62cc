"""The declarative table of the training stages: one :class:`TrainingStageSpec` per stage.

A training stage is its run-config template in ``stages/`` filled in from ``params.yaml`` by this
table (:func:`distillery.pipeline.run_config.fill_run_config`, through the config loader's dotted
overrides) — no stage-specific code. Adding a training stage: a template in ``stages/``, a row here,
a dvc.yaml stage (``cmd: distillery stage <name>``, its ``params:`` covering every key of the row),
and the params.yaml section with its schema in :mod:`distillery.pipeline.params_schema`
(``stages/README.md`` has the list).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DATA_ARTIFACT = "latents"  # every training stage trains on artifacts/latents/data


@dataclass(frozen=True)
class TrainingStageSpec:
    """One training stage, declared.

    - ``template``: the run-config template, relative to the pipeline folder (a dvc.yaml dep of the stage);
    - ``inputs``: role → the stage whose artifact the role starts from (``models.<role>.init_from =
      artifacts/<stage>/model``); recorded in lineage and the resume key as ``<role>_init``;
    - ``params``: params.yaml key → the run-config key it sets (each key must be covered by the
      stage's dvc.yaml ``params:``; a test checks it);
    - ``export_role``: the role whose trained weights the artifact ships (``model/transformer``).
    """

    name: str
    template: str
    inputs: dict[str, str]
    params: dict[str, str] = field(default_factory=dict)
    export_role: str = "student"

    def input_artifacts(self) -> list[tuple[str, str]]:
        """``[(lineage role, artifact stage)]``: each role's init, then the training data."""
        return [(f"{role}_init", stage) for role, stage in self.inputs.items()] + [("data", DATA_ARTIFACT)]


def loop_params(stage: str) -> dict[str, str]:
    """The knobs every training stage takes from ``params.yaml: seed`` and its own section."""
    return {
        f"{stage}.batch_size": "training.data.batch_size",
        f"{stage}.learning_rate": "training.optimizer.learning_rate",
        f"{stage}.steps": "training.loop.max_train_steps",
        "seed": "training.loop.seed",
        f"{stage}.save_every": "training.checkpoint.save_every",
    }


TRAINING_STAGES: dict[str, TrainingStageSpec] = {
    spec.name: spec
    for spec in (
        TrainingStageSpec(
            name="teacher",
            template="stages/teacher_sft.yaml",
            inputs={"student": "base"},
            params=loop_params("teacher"),
        ),
        TrainingStageSpec(
            name="pretrain",
            template="stages/pretrain_dfsft.yaml",
            inputs={"student": "teacher"},
            params={**loop_params("pretrain"), "pretrain.chunk_size": "method.chunk_size"},
        ),
    )
}
