"""A params profile: a YAML file of ``params.yaml`` overrides for one setting (``docs/profiles/``).

Format::

    overrides:
      latents.num_frames: 81        # dotted params.yaml key: value
      validate.teacher_steps: [40, 4]

:func:`load_profile` reads it as DVC reads params (bounded, every scalar read alike by YAML 1.1 and 1.2),
checks each key names a leaf of ``params.yaml`` and that the result passes the params schema, and returns
the overrides. :func:`dvc_set_args` turns them into ``-S key=value`` arguments for ``dvc exp run`` (which
writes the values back into ``params.yaml`` itself), each value spelled so that DVC's parser and the
stages' read it as the same value.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.pipeline.params.file import read_params_file
from distillery.pipeline.params.loading import validate_params
from distillery.pipeline.params.reader import Params
from distillery.pipeline.params.recipes import recipe_params
from distillery.pipeline.params.schema import ParamsSchema


def load_profile(profile: str | Path, params_path: str | Path = "params.yaml") -> dict[str, Any]:
    """The profile's ``{dotted key: value}``, checked against ``params_path`` (module doc)."""
    return profiled_params(profile, params_path)[0]


def profiled_params(profile: str | Path, params_path: str | Path = "params.yaml") -> tuple[dict[str, Any], ParamsSchema]:
    """The profile's overrides and the typed params of ``params_path`` with them applied, checked (module doc)."""
    data = read_params_file(profile, str(profile), "not found (a profile is a YAML file with an `overrides:` mapping)")
    if not isinstance(data, dict) or set(data) != {"overrides"} or not isinstance(data["overrides"], dict) or not data["overrides"]:
        raise UserError(f"{profile}: expected one key, `overrides:`, mapping dotted params.yaml keys to values")
    overrides: dict[str, Any] = data["overrides"]
    base = Params.load(params_path)
    merged = copy.deepcopy(base.data)
    for key, value in overrides.items():
        node = merged
        *parents, leaf = str(key).split(".")
        for i, part in enumerate(parents):
            if not isinstance(node, dict) or not isinstance(node.get(part), dict):
                raise UserError(f"{profile}: {key}: {'.'.join(parents[:i + 1])} is not a section of {params_path}")
            node = node[part]
        if leaf not in node or isinstance(node[leaf], dict):
            raise UserError(f"{profile}: {key}: not a value of {params_path} (a typo, or a section)")
        node[leaf] = value
    where = f"{params_path} with {profile}"
    typed = validate_params(merged, where, recipe_params(base.recipes))  # the profile's own scalars were checked above, as DVC and the stages read them
    return overrides, typed


def _spell(value: Any) -> str:
    """``value`` as a ``-S`` value: JSON flow syntax, floats with a dot before any exponent (YAML 1.1 reads
    ``1e-05`` as a string, 1.2 as a float; ``1.0e-05`` is a float to both); a string that is not a plain
    token in single quotes (Hydra's override grammar; a quote inside, and backslashes before one or before the end, escaped)."""
    if isinstance(value, float):
        text = repr(value)
        if "e" in text and "." not in text.split("e")[0]:
            mantissa, exponent = text.split("e")
            text = f"{mantissa}.0e{exponent}"
        return text
    if isinstance(value, list):
        return "[" + ",".join(_spell(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, str):  # a plain token as it is; anything else (a negative prompt's commas, CJK) quoted for Hydra
        if re.fullmatch(r"[A-Za-z0-9_./:+-]+", value):
            return value
        escaped = re.sub(r"(\\+)('|$)", lambda m: m.group(1) * 2 + m.group(2), value)  # backslashes before a quote or the end
        return "'" + escaped.replace("'", "\\'") + "'"
    return json.dumps(value)


def dvc_set_args(overrides: dict[str, Any]) -> list[str]:
    """``["-S", "key=value", ...]`` for ``dvc exp run``, in the profile's order."""
    args: list[str] = []
    for key, value in overrides.items():
        spelled = _spell(value)
        if any(c.isspace() for c in spelled):
            raise UserError(f"{key}: {spelled!r} has whitespace; set it with its own quoted -S")
        args += ["-S", f"{key}={spelled}"]
    return args
