"""The fitted tiny Wan that ships inside the package (made by ``distillery base make-tiny --fit``).

The default pipeline starts from it exactly as it would from a real Wan2.1-T2V-1.3B-Diffusers
folder: it is an ordinary diffusers folder (``model_index.json``, ``transformer/``, ``vae/``,
``text_encoder/``, ``tokenizer/``, ``scheduler/``), plus its model card (``README.md``), the fit
report (``fit_report.json``) and the analyzer thresholds calibrated on its VAE (``analyzer.json``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from distillery.common.errors import UserError

SHIPPED_TINY_BASE = Path(__file__).resolve().parent.parent / "assets" / "tiny-wan"
#: The tiny Cosmos Predict 2.5 (:mod:`distillery.tinybase.cosmos`, seed 0): random transformer, the fitted tiny Wan VAE.
SHIPPED_TINY_COSMOS = SHIPPED_TINY_BASE.parent / "tiny-cosmos"


def shipped_tiny_base() -> Path:
    """Path of the shipped fitted tiny base (read-only: copy it before changing anything)."""
    if not (SHIPPED_TINY_BASE / "model_index.json").is_file():
        raise UserError(f"the shipped tiny base is missing from {SHIPPED_TINY_BASE}; reinstall distillery or run "
                        "`distillery base make-tiny --fit --out DIR`")
    return SHIPPED_TINY_BASE


def shipped_tiny_cosmos() -> Path:
    """Path of the shipped tiny Cosmos Predict 2.5 (read-only: copy it before changing anything)."""
    if not (SHIPPED_TINY_COSMOS / "model_index.json").is_file():
        raise UserError(f"the shipped tiny Cosmos is missing from {SHIPPED_TINY_COSMOS}; reinstall distillery or run "
                        "`distillery base make-tiny --family cosmos --out DIR`")
    return SHIPPED_TINY_COSMOS


def copy_shipped_tiny_base(out: Path, overwrite: bool = False) -> Path:
    """Copy the shipped fitted tiny base to ``out`` (atomically: temp sibling, then rename)."""
    from distillery.tinybase.tiny import _check_destination, write_folder_atomically

    src = shipped_tiny_base()
    out = Path(out)
    _check_destination(out, overwrite)
    return write_folder_atomically(out, lambda staging: shutil.copytree(src, staging, dirs_exist_ok=True))
