"""What a base model folder may carry into the pipeline (docs/reliability.md: nothing read from an
artifact executes code).

A base is a diffusers Wan, Cosmos Predict 2.5 or HunyuanVideo 1.5 folder: ``model_index.json`` and one folder per component. Diffusers
imports code *from the folder* when its index names a library it does not ship: a component
``["evil_sched", "EvilScheduler"]`` loads ``scheduler/evil_sched.py``, and a ``_class_name`` given as
``[module, class]`` loads ``<module>.py`` — under ``trust_remote_code=True``, which the export's own
load command passes. So a base is held to this:

- :func:`check_model_index`: ``_class_name`` is one of :data:`PIPELINE_CLASSES` (``WanPipeline``, ...); every other key
  is a parameter of that class's ``__init__`` (what the pipeline takes; a Cosmos base's ``safety_checker`` is
  ``[null, null]`` or NVIDIA's installed guardrail, :data:`SAFETY_CHECKER`); a component is ``[library, class]`` with
  ``library`` ``diffusers`` or ``transformers`` and ``class`` a class of that library that fits the
  parameter's annotation (a scheduler: any diffusers scheduler; a tokenizer: any concrete
  transformers tokenizer, not the ``AutoTokenizer`` factory), or ``[null, null]`` where the
  parameter is optional; a plain parameter (``boundary_ratio``) holds a JSON scalar. No component
  config (``*config.json``) may name remote code (``auto_map``). A violation is a one-line
  :class:`UserError`. Before the index is read, every file of the folder is checked
  (:func:`distillery.pipeline.publish.model_files.check_model_files`: no FIFO, device, link loop, oversized
  config or tokenizer file, or safetensors file whose header is not one).
- :func:`copy_model_folder`: copies a model folder leaving out every code file
  (:func:`distillery.lineage.artifact_code.is_code_file`): no ``.py`` (or bytecode, or native module) of a base
  is ever copied.

The base stage checks the user's folder before copying it; the export stage checks the base
artifact again before shipping its parts (an artifact made before this rule existed).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from distillery.common.errors import UserError
from distillery.common.hashcache import copy_hashed
from distillery.lineage.artifact_code import MODEL_LIBRARIES as LIBRARIES
from distillery.lineage.artifact_code import is_code_file

INDEX_FILE = "model_index.json"
PIPELINE_CLASS = "WanPipeline"
COSMOS_PIPELINE_CLASS = "Cosmos2_5_PredictBasePipeline"
#: The pipeline classes a base may be: Wan text-to-video, Wan 2.1 image-to-video (a first frame + CLIP image embeddings),
#: Cosmos Predict 2.5 (text-to-world), HunyuanVideo 1.5 text-to-video.
PIPELINE_CLASSES = (PIPELINE_CLASS, "WanImageToVideoPipeline", COSMOS_PIPELINE_CLASS, "HunyuanVideo15Pipeline")
#: NVIDIA's guardrail, the one component of a Cosmos base that is neither diffusers' nor transformers': an installed
#: package's class (never code of the folder), or none (the caller passes it when loading, as the model card says).
SAFETY_CHECKER = ("cosmos_guardrail", "CosmosSafetyChecker")
REQUIRED = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")  # what the pipeline's stages load
_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_CONFIG_BYTES = 1 << 20  # a component config larger than this is not read for auto_map (tokenizer.json is not a config)


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= 80 else text[:79] + "…"


def pipeline_parameters(pipeline_class: str = PIPELINE_CLASS) -> dict[str, inspect.Parameter]:
    """``<pipeline_class>.__init__``'s parameters (annotations evaluated), ``self`` left out (one of :data:`PIPELINE_CLASSES`)."""
    import diffusers

    if pipeline_class not in PIPELINE_CLASSES:
        raise ValueError(f"not a base pipeline class: {pipeline_class!r}")
    params = inspect.signature(getattr(diffusers, pipeline_class).__init__, eval_str=True).parameters
    return {name: p for name, p in params.items() if name != "self"}


def _annotation_classes(annotation: Any) -> list[type]:
    """The classes an annotation allows (``X | None`` → ``[X]``); empty for a non-class parameter."""
    args = typing.get_args(annotation) or (annotation,)
    return [a for a in args if isinstance(a, type) and a is not type(None)]


def _accepted_bases(expected: type) -> type:
    """What a component annotated ``expected`` may be: any diffusers scheduler for a scheduler (a
    Wan2.1 folder ships UniPC, the pipeline's default annotation is Euler), any concrete tokenizer
    for a tokenizer (``AutoTokenizer``, a factory that resolves classes from the folder's config, or a named one such
    as HunyuanVideo 1.5's ``Qwen2Tokenizer``: a tokenizer class runs no code of the folder), else a subclass."""
    from diffusers import SchedulerMixin
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    if issubclass(expected, SchedulerMixin):
        return SchedulerMixin
    if expected is AutoTokenizer or issubclass(expected, PreTrainedTokenizerBase):
        return PreTrainedTokenizerBase
    return expected


def _library_class(library: str, name: str) -> type | None:
    """The public class ``name`` of ``library`` (diffusers or transformers), None if it has none."""
    import importlib

    module = importlib.import_module(library)
    try:
        obj = getattr(module, name)
    except (AttributeError, ImportError, RuntimeError):  # transformers' lazy module raises on a missing backend
        return None
    return obj if isinstance(obj, type) else None


def _component_problem(key: str, value: Any, param: inspect.Parameter, pipeline_class: str) -> str | None:
    """Why ``model_index.json``'s entry ``key: value`` is not a library class ``pipeline_class`` takes there."""
    if key == "safety_checker" and pipeline_class == COSMOS_PIPELINE_CLASS:
        return None if value in ([None, None], list(SAFETY_CHECKER)) else (
            f"{key}: {_show(value)}: expected [null, null] or {_show(list(SAFETY_CHECKER))}")
    classes = _annotation_classes(param.annotation)
    if not classes or not any(hasattr(c, "from_pretrained") for c in classes):  # a plain value (boundary_ratio)
        if isinstance(value, (list, dict)):
            return f"{key}: {_show(value)}: {pipeline_class} takes a plain value there"
        return None
    if not (isinstance(value, list) and len(value) == 2):
        return f"{key}: {_show(value)}: expected [library, class]"
    library, name = value
    if library is None and name is None:
        return None if param.default is None and key not in REQUIRED else f"{key}: [null, null]: this component is required"
    if library not in LIBRARIES:
        return (f"{key}: {_show(value)} names code from {_show(library)}, not a library class "
                f"({' or '.join(LIBRARIES)}): diffusers would import it from the folder")
    if not (isinstance(name, str) and _IDENTIFIER.fullmatch(name)):
        return f"{key}: {_show(value)}: not a class name"
    cls = _library_class(library, name)
    if cls is None:
        return f"{key}: {_show(value)}: {library} has no class {name}"
    bases = [_accepted_bases(c) for c in classes]
    if not any(issubclass(cls, b) for b in bases):
        wanted = " or ".join(f"{b.__module__.split('.')[0]}.{b.__name__}" for b in bases)
        return f"{key}: {_show(value)}: {pipeline_class} takes a {wanted} there"
    return None


def model_index_problems(index: Any) -> list[str]:
    """Every reason the parsed ``model_index.json`` ``index`` is not a plain pipeline of :data:`PIPELINE_CLASSES` of
    library classes (module doc); empty when it is one."""
    if not isinstance(index, dict):
        return [f"expected a JSON object, got {_show(index)}"]
    problems: list[str] = []
    pipeline_class = index.get("_class_name")
    if pipeline_class not in PIPELINE_CLASSES:
        problems.append(f"_class_name: {_show(pipeline_class)}: expected one of {', '.join(PIPELINE_CLASSES)} "
                        "(a diffusers base folder; a [module, class] pair would load code from the folder)")
        pipeline_class = PIPELINE_CLASS
    params = pipeline_parameters(pipeline_class)
    for key, value in index.items():
        if not isinstance(key, str) or key.startswith("_"):
            continue
        if key not in params:
            problems.append(f"{key}: {_show(value)}: not a component {pipeline_class} takes "
                            f"({', '.join(params)})")
            continue
        problem = _component_problem(key, value, params[key], pipeline_class)
        if problem:
            problems.append(problem)
    problems.extend(f"{key}: missing (a base has one)" for key in REQUIRED if key not in index)
    return problems


def _remote_code_configs(folder: Path, components: Iterable[str]) -> list[str]:
    """``<component>/<file>`` of each component config that names remote code (``auto_map``)."""
    found = []
    for component in components:
        sub = folder / component
        if not sub.is_dir() or sub.is_symlink():
            continue
        for path in sorted(sub.glob("*config.json")):
            try:
                if not path.is_file() or path.stat().st_size > _CONFIG_BYTES:
                    continue
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError, RecursionError):
                continue  # not ours to judge here: the library that loads it reports an unreadable config
            if isinstance(data, dict) and "auto_map" in data:
                found.append(f"{component}/{path.name}")
    return found


def check_model_index(folder: Path, what: str) -> None:
    """Refuse (one-line :class:`UserError`) a model folder whose ``model_index.json`` names anything
    but library classes its pipeline (:data:`PIPELINE_CLASSES`) takes, or whose component configs name remote code. ``what``
    names the folder in the message (``params.yaml: base.path: /data/wan``)."""
    from distillery.pipeline.publish.model_files import check_model_files

    path = Path(folder) / INDEX_FILE
    if not os.path.lexists(path):
        raise UserError(f"{what}: no {INDEX_FILE}: not a diffusers model folder")
    check_model_files(Path(folder), what, REQUIRED)  # no FIFO, device, loop, oversized config, bad safetensors header
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what}: no {INDEX_FILE}: not a diffusers model folder") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UserError(f"{what}: {INDEX_FILE} is not readable JSON ({type(exc).__name__})") from None
    problems = model_index_problems(index)
    if not problems:
        components = [k for k, v in index.items() if isinstance(v, list) and v and v[0] in LIBRARIES]
        problems = [f"{rel} names remote code (auto_map)" for rel in _remote_code_configs(Path(folder), components)]
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{what}: {INDEX_FILE}: {problems[0]}{more}; a base may name only diffusers/transformers "
                        f"classes its pipeline takes, and no code of a base is ever copied or run")


def copy_model_folder(source: Path, target: Path, *, exclude: Iterable[str] = (), exclude_top: Iterable[str] = ()) -> list[str]:
    """Copy the model folder ``source`` into ``target`` (created, or merged into an existing one)
    without any code file (or ``__pycache__``), without the entries named in ``exclude`` (at any
    level) and without the top-level entries named in ``exclude_top``; returns the relative paths
    of the code files left out. Symlinked files are copied by content (a Hugging Face cache snapshot
    links its files)."""
    source, left_out, anywhere, top = Path(source), [], set(exclude), set(exclude_top)

    def ignore(folder: str, names: list[str]) -> set[str]:
        here = Path(folder)
        rel_dir = here.relative_to(source)
        dropped = {n for n in names if n in anywhere or (here == source and n in top)}
        for n in names:
            if n not in dropped and (is_code_file(n) or n == "__pycache__"):
                dropped.add(n)
                left_out.append((rel_dir / n).as_posix())
        return dropped

    shutil.copytree(source, target, ignore=ignore, dirs_exist_ok=True, copy_function=copy_hashed)  # each byte read once
    return sorted(left_out)
