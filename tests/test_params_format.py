"""params.yaml is kept in the form `dvc exp run -S` writes back: an experiment changes only the lines it sets.

DVC applies ``--set-param`` overrides with :func:`dvc.utils.hydra.apply_overrides` (a ruamel round trip of
the file); the comments survive it, and a file already in its form comes back byte for byte.
"""

from __future__ import annotations

import difflib
import shutil
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _set(path: Path, *overrides: str) -> str:
    from dvc.utils.hydra import apply_overrides

    apply_overrides(path, list(overrides))
    return path.read_text()


def test_dvc_exp_run_set_param_rewrites_only_the_values_it_sets(tmp_path: Path) -> None:
    original = (ROOT / "params.yaml").read_text()
    copy = tmp_path / "params.yaml"
    shutil.copy2(ROOT / "params.yaml", copy)
    assert _set(copy, "seed=0") == original  # a value set to itself: the file as committed, comments and all
    changed = _set(copy, "pretrain.learning_rate=1e-4", "validate.pdd_nfe=[1,2]")
    diff = [line for line in difflib.unified_diff(original.splitlines(), changed.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert diff == ["-  learning_rate: 2.0e-4", "+  learning_rate: 0.0001", "-  - 4", "-  - 8"], diff
    assert yaml.safe_load(changed)["pretrain"]["learning_rate"] == 1e-4
    assert original.count("#") == changed.count("#")  # every comment kept
