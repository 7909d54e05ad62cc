"""Pipeline stage adapters: ``distillery stage <name>`` turns params.yaml into a run, launches it,
and writes the artifact contract (docs/architecture.md §2). No DVC or Prefect imports here: DVC calls these
commands, and the Prefect flows call DVC."""
