"""The code an artifact may carry: none, but an export's own modules.

A code file (:data:`CODE_SUFFIXES`: Python source, bytecode, native modules) anywhere in an artifact is
refused — but an export's own modules (:data:`EXPORT_OWN_CODE` at its top level, each with the sha256 the
export stage recorded in the manifest's ``config.shipped_code``; one missing from that record, or of another
digest, is refused) —, and so is a ``model_index.json`` entry naming a module outside diffusers/transformers
(diffusers would import it from the folder under ``trust_remote_code``) — but an export's top-level
``_class_name`` of :data:`EXPORT_PIPELINE_CLASSES`, its own pipeline (allowed only where that module is recorded).
:func:`code_problems` names each such file; :mod:`distillery.lineage.verify` reports them.

Stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distillery.lineage.contract import cut
from distillery.lineage.hashing import Listing

# files an artifact never carries: Python source, bytecode and native modules, which a loader could import
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".pyw", ".pyx", ".so", ".dylib", ".dll")
# the code files an export ships (its pipeline and the modules it imports: distillery.export.code.SHIPPED_MODULES),
# each allowed only with the digest recorded under config.shipped_code of the export's manifest
EXPORT_OWN_CODE = ("pipeline.py", "distilled_schedule.py", "distilled_samplers.py", "distilled_wan.py", "distilled_causal.py",
                   "distilled_fast.py", "distilled_sparse.py", "distilled_decode.py", "sparse_attention.py", "vae_decode.py",
                   "vae_kernels.py", "pipeline_cosmos.py", "distilled_cosmos.py", "pipeline_hunyuan15.py",
                   "distilled_hunyuan15.py")
EXPORT_CODE_RECORD = "shipped_code"
# the _class_name an export's top-level model_index.json may give as [module, class]: its own recorded pipeline.py
# (distillery.export.code.OWN_PIPELINE: diffusers then loads that class, never a plain WanPipeline)
EXPORT_PIPELINE_CLASS = ("pipeline", "DistilledWanPipeline")
# every family's own pipeline (distillery.export.code.OWN_PIPELINES): Wan's, Cosmos Predict 2.5's, HunyuanVideo 1.5's
EXPORT_PIPELINE_CLASSES = (EXPORT_PIPELINE_CLASS, ("pipeline_cosmos", "DistilledCosmosPipeline"),
                           ("pipeline_hunyuan15", "DistilledHunyuanVideo15Pipeline"))
MODEL_LIBRARIES = ("diffusers", "transformers")  # the libraries a model_index.json component may come from
_INDEX_FILE = "model_index.json"


def is_code_file(name: str) -> bool:
    """Whether a file named ``name`` (a path's last part) is code a loader could import
    (:data:`CODE_SUFFIXES`): an artifact carries none, an export only its own modules (:data:`EXPORT_OWN_CODE`)."""
    return name.lower().endswith(CODE_SUFFIXES)


def _index_problems(path: Path, own_pipelines: Sequence[Sequence[str]] = ()) -> list[str]:
    """Entries of a ``model_index.json`` that name code from outside :data:`MODEL_LIBRARIES` —
    which diffusers imports from the folder itself (``["evil_sched", "EvilScheduler"]`` →
    ``<component>/evil_sched.py``; a ``_class_name`` given as ``[module, class]`` → ``<module>.py``) —
    but a ``_class_name`` equal to one of ``own_pipelines`` (an export's own, recorded pipeline)."""
    try:
        index = json.loads(path.read_text(encoding="utf-8")) if path.stat().st_size <= 1 << 20 else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return ["not readable JSON"]
    if not isinstance(index, dict):
        return ["not a JSON object"]
    problems = []
    if isinstance(index.get("_class_name"), list) and index["_class_name"] not in [list(own) for own in own_pipelines]:
        shown = cut(json.dumps(index['_class_name']), limit=80)
        problems.append(f"_class_name: {shown}: a [module, class] pair, which diffusers would import from the folder")
    for key, value in index.items():
        if isinstance(key, str) and not key.startswith("_") and isinstance(value, list) and len(value) == 2 \
                and value[0] is not None and value[0] not in MODEL_LIBRARIES:
            shown = f"{cut(key, limit=40)}: {cut(json.dumps(value), limit=80)}"
            problems.append(f"{shown} names code from outside {'/'.join(MODEL_LIBRARIES)}, which diffusers would "
                            "import from the folder")
    return problems


def _shipped_code(manifest: Mapping[str, Any]) -> dict[str, str]:
    """An export's record of the code it wrote: ``config.shipped_code`` (file → sha256), ``{}`` when absent or malformed."""
    config = manifest.get("config")
    record = config.get(EXPORT_CODE_RECORD) if isinstance(config, Mapping) else None
    if not isinstance(record, Mapping):
        return {}
    return {k: v for k, v in record.items() if isinstance(k, str) and isinstance(v, str)}


def code_problems(listing: Listing, manifest: Mapping[str, Any], digests: Mapping[str, str]) -> list[str]:
    """Code an artifact carries: every code file (:func:`is_code_file`) but an export's own modules
    (:data:`EXPORT_OWN_CODE`, each recorded in its ``config.shipped_code`` with the sha256 it has now:
    ``digests``, relative path → sha256), and every ``model_index.json`` entry naming code from outside the libraries."""
    export = manifest.get("kind") == "export"
    record = _shipped_code(manifest) if export else {}
    own_pipelines = [own for own in EXPORT_PIPELINE_CLASSES if f"{own[0]}.py" in record]
    problems = []
    for rel in sorted(listing.files):
        if not is_code_file(rel.rsplit("/", 1)[-1]):
            continue
        if not export or rel not in EXPORT_OWN_CODE:
            problems.append(f"refused: {cut(rel)} (a code file: an artifact carries no code"
                            f"{', an export only its own ' + ', '.join(EXPORT_OWN_CODE) if export else ''})")
        elif rel not in record:
            problems.append(f"refused: {cut(rel)} (code the export's lineage.json does not record in "
                            f"config.{EXPORT_CODE_RECORD}: not written by the export stage)")
        elif digests.get(rel) is not None and digests[rel] != record[rel]:
            problems.append(f"refused: {cut(rel)} (code of another digest than the export stage recorded in "
                            f"config.{EXPORT_CODE_RECORD})")
    for rel in sorted(listing.files):
        if rel.rsplit("/", 1)[-1] == _INDEX_FILE:
            problems.extend(f"refused: {cut(rel)}: {q}" for q in
                            _index_problems(listing.files[rel], own_pipelines if rel == _INDEX_FILE else ()))
    return problems
