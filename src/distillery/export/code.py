"""The code an export folder ships: the modules of :mod:`distillery.export.standalone`, copied to the
folder's top level, and the record of them its lineage keeps.

The export's only code is these files (``lineage --verify`` refuses any other code file, and these
unless their digests are the ones recorded, :func:`distillery.lineage.manifest.verify_lineage`):
:data:`SHIPPED_MODULES` is their names, and the same names are
:data:`distillery.lineage.manifest.EXPORT_OWN_CODE` (a test keeps the two equal). They import only the
standard library, torch, numpy, safetensors, diffusers and transformers, so the folder samples where
distillery is not installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

STANDALONE_PACKAGE = "distillery.export.standalone"
# the module files copied into every export (pipeline.py imports the others relatively: diffusers copies them with it)
SHIPPED_MODULES = ("pipeline.py", "distilled_schedule.py", "distilled_samplers.py", "distilled_wan.py", "distilled_causal.py")
CODE_RECORD_KEY = "shipped_code"  # in the export's lineage config: {file name: sha256}


def shipped_sources() -> dict[str, Path]:
    """``{file name: source file in the package}`` of every module an export ships."""
    sources = {}
    for name in SHIPPED_MODULES:
        spec = importlib.util.find_spec(f"{STANDALONE_PACKAGE}.{name[:-3]}")  # located (a dvc.yaml dep), never run
        assert spec is not None and spec.origin, name
        sources[name] = Path(spec.origin)
    return sources


def write_export_code(folder: Path) -> dict[str, str]:
    """Copy every shipped module into ``folder`` (top level); returns ``{file name: sha256}`` of what was written."""
    record = {}
    for name, source in shipped_sources().items():
        shutil.copyfile(source, folder / name)
        record[name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    return record
