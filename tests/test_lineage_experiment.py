"""Lineage under DVC's experiment workflow (docs/experiments.md): ``dvc exp run -S key=value`` edits
``params.yaml`` for the run, which is settings, not code (the manifest records the params each stage read), so
the code is clean; and the manifest names the experiment DVC ran (its name and the commit it started from), as
``distillery lineage`` shows it. The end-to-end case runs real git and DVC on a one-stage project whose stage
writes a lineage.json."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distillery.lineage.manifest import code_info, read_lineage, write_lineage
from distillery.lineage.render import lineage_tree

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="no git")


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=a", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def test_params_yaml_is_not_code_and_a_dvc_experiment_is_named(tmp_path, monkeypatch):
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "params.yaml").write_text("lr: 1\n")
    (tmp_path / ".gitignore").write_text("/out/\n")  # the artifact, as DVC ignores its outs
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "c")
    monkeypatch.chdir(tmp_path)
    for key in ("DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "params.yaml").write_text("lr: 2\n")  # what `dvc exp run -S lr=2` does before the stages run
    info = code_info()
    assert info["dirty"] is False and "experiment" not in info
    head = _git(tmp_path, "rev-parse", "HEAD").strip()
    monkeypatch.setenv("DVC_EXP_NAME", "fresh-doll")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", head)
    assert code_info()["experiment"] == {"name": "fresh-doll", "baseline": head}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "w.bin").write_bytes(b"w")
    write_lineage(tmp_path / "out", kind="model", stage="s")
    code_line = next(ln for ln in lineage_tree(read_lineage(tmp_path / "out")).splitlines() if "code: " in ln)
    assert code_line.strip().startswith(f"code: {head[:10]} (clean)")
    assert code_line.endswith(f"dvc experiment fresh-doll from {head[:10]}"), code_line
    (tmp_path / "code.py").write_text("x = 2\n")  # code is still code
    assert code_info()["dirty"] is True


STAGE = """\
import sys
from pathlib import Path
from distillery.lineage.manifest import write_lineage
out = Path("out")
out.mkdir(exist_ok=True)
(out / "lr.txt").write_text(Path("params.yaml").read_text())
write_lineage(out, kind="model", stage="s")
"""


@pytest.mark.process
def test_dvc_exp_run_records_a_clean_tree_and_the_experiment_s_name(tmp_path):
    """The documented workflow for real: commit a baseline, ``dvc exp run -S lr=2``; the stage's lineage is clean,
    at the baseline commit, and names the experiment DVC reports."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("DVC_EXP_")}
    (tmp_path / "stage.py").write_text(STAGE)
    (tmp_path / "params.yaml").write_text("lr: 1\n")
    (tmp_path / "dvc.yaml").write_text(f"stages:\n  s:\n    cmd: {sys.executable} stage.py\n    deps: [stage.py]\n"
                                       "    params: [lr]\n    outs: [out]\n")
    _git(tmp_path, "init", "-q")
    subprocess.run(["dvc", "init", "-q"], cwd=tmp_path, env=env, check=True)
    subprocess.run(["dvc", "config", "core.site_cache_dir", str(tmp_path / ".dvc-site")], cwd=tmp_path, env=env, check=True)
    (tmp_path / ".gitignore").write_text("/.dvc-site/\n")
    subprocess.run(["dvc", "repro", "-q"], cwd=tmp_path, env=env, check=True)
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "baseline")
    baseline = _git(tmp_path, "rev-parse", "HEAD").strip()
    ran = subprocess.run(["dvc", "exp", "run", "-S", "lr=2"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-2000:]
    name = re.search(r"Ran experiment\(s\): (\S+)", ran.stdout).group(1)
    assert (tmp_path / "out" / "lr.txt").read_text() == "lr: 2\n"
    code = read_lineage(tmp_path / "out")["code"]
    assert code["git_commit"] == baseline and code["dirty"] is False, json.dumps(code)
    assert code["experiment"] == {"name": name, "baseline": baseline}
