"""The pipeline machinery the stage adapters (the workspace's top-level ``stages/``) stand on, by job:

- :mod:`~distillery.pipeline.params` — reading ``params.yaml`` (bounded, as DVC reads it, typed — a training section
  by its chosen recipe —, a stage sees only the keys its ``dvc.yaml`` entry lists), profiles, the workspace's recipes;
- :mod:`~distillery.pipeline.launch` — running a stage: the runner behind ``distillery stage <name>``, the preflight
  checks, what a recipe builds a training stage's run config from, its run folder, resume key and torchrun launch,
  the device of a one-process stage;
- :mod:`~distillery.pipeline.publish` — writing the artifact contract (docs/architecture.md §2): atomic artifacts,
  the MLflow parent run, a training run's summary, what a model folder may carry in;
- :mod:`~distillery.pipeline.dvcfile` — the one ``dvc.yaml`` reader (the stages, the runner and ``flows/`` use it).

No DVC or Prefect imports here: DVC calls ``distillery stage``, and the Prefect flows call DVC. Nothing here imports
the ``stages`` package but by name, from the workspace (:mod:`distillery.pipeline.params.recipes`: the stage the
runner runs, the recipe registry).
"""
