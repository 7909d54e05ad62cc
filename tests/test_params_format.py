"""params.yaml is kept in the form `dvc exp run -S` writes back: an experiment changes only the lines it sets.

DVC applies ``--set-param`` overrides with :func:`dvc.utils.hydra.apply_overrides` (a ruamel round trip of
the file); the comments survive it, and a file already in its form comes back byte for byte.

The file under test is the committed ``params.yaml`` (``git show HEAD:params.yaml``; the checkout's own file
only outside git), and what the test sets is chosen from its values: a workspace an experiment left changed
(``dvc exp run`` keeps its values in ``params.yaml``), or a commit of other values, tests the same thing.
"""

from __future__ import annotations

import difflib
import subprocess
from pathlib import Path

import yaml
from workspace import committed_params

ROOT = Path(__file__).resolve().parents[1]




def _set(path: Path, *overrides: str) -> str:
    from dvc.utils.hydra import apply_overrides

    apply_overrides(path, list(overrides))
    return path.read_text()


def test_dvc_exp_run_set_param_rewrites_only_the_values_it_sets(tmp_path: Path) -> None:
    _check_format(committed_params(), tmp_path)


def _check_format(original: str, tmp_path: Path) -> None:
    values = yaml.safe_load(original)
    copy = tmp_path / "params.yaml"
    copy.write_text(original)
    assert _set(copy, f"seed={values['seed']}") == original  # a value set to itself: the file as committed, comments and all
    rate, written = (1e-4, "0.0001") if values["pretrain"]["learning_rate"] != 1e-4 else (3e-4, "0.0003")
    nfe = values["validate"]["pdd_nfe"]
    kept = nfe[:2] if len(nfe) > 2 else nfe[:1]
    changed = _set(copy, f"pretrain.learning_rate={rate}", f"validate.pdd_nfe=[{','.join(map(str, kept))}]")
    diff = [line for line in difflib.unified_diff(original.splitlines(), changed.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    lines = original.splitlines()
    section = next(i for i, line in enumerate(lines) if line.startswith("pretrain:"))
    old_rate = next(line for line in lines[section:] if line.startswith("  learning_rate:"))
    assert diff == [f"-{old_rate}", f"+  learning_rate: {written}", *[f"-  - {n}" for n in nfe[len(kept):]]], diff
    assert yaml.safe_load(changed)["pretrain"]["learning_rate"] == rate
    assert yaml.safe_load(changed)["validate"]["pdd_nfe"] == kept
    assert original.count("#") == changed.count("#")  # every comment kept


def test_a_workspace_an_experiment_changed_is_not_what_is_tested(tmp_path: Path) -> None:
    """After a `dvc exp run -S` the workspace's params.yaml holds the experiment's values; the committed file is
    read, and the check also holds for a commit of other values."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "params.yaml").write_text(committed_params())
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "params.yaml"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "baseline"], cwd=repo, check=True)
    committed = (repo / "params.yaml").read_text()
    _set(repo / "params.yaml", "pretrain.learning_rate=1e-4", "validate.pdd_nfe=[1]")  # what the experiment left
    assert committed_params(repo) == committed != (repo / "params.yaml").read_text()
    subprocess.run([*git, "commit", "-qam", "the experiment, committed"], cwd=repo, check=True)
    _check_format(committed_params(repo), tmp_path)  # a commit of other values: the same property holds
