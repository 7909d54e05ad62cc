"""Run configs: YAML → typed dataclasses, ``_target_`` allowlist, dotted overrides."""

from distillery.config.loader import dump_run_config, load_run_config, parse_override_args
from distillery.config.schema import Component, RunConfig, TrainingConfig
from distillery.config.targets import allowed_prefixes, resolve_target

__all__ = [
    "Component",
    "RunConfig",
    "TrainingConfig",
    "allowed_prefixes",
    "dump_run_config",
    "load_run_config",
    "parse_override_args",
    "resolve_target",
]
