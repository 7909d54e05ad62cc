"""The export stage refuses, in one line with exit 2 and before any work, a validate stage that has not
finished (the model card's scores and snippets come from its report) — as a real-shape run showed, where
validate was killed at a time limit and export then died in a traceback. (A student whose stage never ran:
``tests/test_preflight_space.py``.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from workspace import copy_stages

from distillery.tinybase.shipped import shipped_tiny_base

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.process  # python and the CLI in subprocesses


def test_export_after_a_validate_that_did_not_finish_is_one_line_and_exit_2(tmp_path):
    shutil.copy2(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copy2(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    copy_stages(tmp_path)
    shutil.copytree(shipped_tiny_base(), tmp_path / "artifacts" / "base" / "model")
    student = subprocess.run([sys.executable, "-c", "from distillery.pipeline.params.reader import Params; "
                              "print(Params.load('params.yaml').get('export.student'))"],
                             cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "artifacts" / student / "model" / "transformer").mkdir(parents=True)
    (tmp_path / "artifacts" / "validate" / "report").mkdir(parents=True)  # a validate killed before it wrote its report
    (tmp_path / "artifacts" / "validate" / "report" / "report.json").write_text("{}")
    done = subprocess.run([sys.executable, "-m", "distillery.cli.main", "stage", "export"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "has no metrics.json: the validate stage has not finished" in lines[0]
    assert not list((tmp_path / "artifacts").glob("export*"))
