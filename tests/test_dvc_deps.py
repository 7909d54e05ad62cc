"""dvc.yaml knows the code its stages run: editing a module a stage uses makes DVC rerun the stage.

- Every stage's ``params:`` list is the stage's ``STAGE_PARAMS`` entry, and its code deps exist.
- Every stage of dvc.yaml is run for real, in DAG order, on a tiny ``params.yaml`` in a temp copy of
  the pipeline, with an import recorder in each Python process it starts (the stage process and
  the torchrun workers it launches): every ``distillery`` module any of them imported must lie
  under one of the stage's ``deps:``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import distillery
from distillery.pipeline.stages import STAGE_PARAMS

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # flows/ is a top-level package of the checkout
    sys.path.insert(0, str(ROOT))

from flows.dag import load_dvc_stages, stage_order  # noqa: E402

PACKAGE = Path(distillery.__file__).resolve().parent  # where `import distillery` finds the code
PACKAGE_IN_REPO = "src/distillery"  # the same folder as dvc.yaml names it

# Installed first on sys.path of every traced process (and inherited by the processes it starts):
# records the name of every distillery module the process imports, one file per process.
RECORDER = '''\
import os, sys

_DIR = os.environ.get("DISTILLERY_TRACE_IMPORTS")


class _RecordDistilleryImports:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if _DIR and (name == "distillery" or name.startswith("distillery.")):
            with open(os.path.join(_DIR, "%d.txt" % os.getpid()), "a") as fh:
                fh.write(name + "\\n")
        return None  # the real finders import it


sys.meta_path.insert(0, _RecordDistilleryImports)
'''

# params.yaml keys shrunk so that each stage runs in seconds (keys the repo's params.yaml lacks are left out);
# a new stage runs with the repo's values unless its knobs are added here
SMALL = {
    "clips.num_train": 4, "clips.num_validation": 2, "clips.num_frames": 9,
    "latents.rows_per_shard": 4,
    "teacher.steps": 1, "teacher.batch_size": 2, "teacher.save_every": 0,
    "pretrain.steps": 1, "pretrain.batch_size": 2, "pretrain.save_every": 0,
    "validate.num_prompts": 1, "validate.teacher_steps": [2, 1], "validate.student_steps": 1,
}


def _stage_name(cmd: str) -> str | None:
    parts = cmd.split()
    return parts[2] if parts[:2] == ["distillery", "stage"] and len(parts) >= 3 else None


def _is_code(dep: str) -> bool:
    return not dep.startswith(("artifacts/", "metrics/", "plots/")) and dep not in ("artifacts", "params.yaml")


def _covered(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


def test_stage_params_are_stage_params_of_the_code():
    stages = load_dvc_stages(ROOT)
    by_code = {_stage_name(s.cmd): s for s in stages.values() if _stage_name(s.cmd)}
    assert sorted(by_code) == sorted(STAGE_PARAMS), "dvc.yaml stages vs distillery.pipeline.stages.STAGE_PARAMS"
    for name, spec in by_code.items():
        assert len(set(spec.params)) == len(spec.params), f"stage {name}: repeated params {spec.params}"
        assert sorted(spec.params) == sorted(STAGE_PARAMS[name]), (
            f"stage {name}: dvc.yaml params {sorted(spec.params)} != STAGE_PARAMS {sorted(STAGE_PARAMS[name])}")


def test_code_deps_exist():
    for name, spec in load_dvc_stages(ROOT).items():
        missing = [d for d in spec.deps if _is_code(d) and not (ROOT / d).exists()]
        assert not missing, f"stage {name}: deps that do not exist: {missing}"


def _small_params(repo: Path) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for dotted, value in SMALL.items():
        node = params
        *head, last = dotted.split(".")
        for part in head:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            node[last] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _module_file(name: str) -> str | None:
    """The repo path (``src/distillery/...``) of a distillery module, None if it is not a file of the package."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.has_location:
        return None
    origin = Path(spec.origin).resolve()
    if PACKAGE not in origin.parents:
        return None
    return f"{PACKAGE_IN_REPO}/{origin.relative_to(PACKAGE).as_posix()}"


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> dict[str, set[str]]:
    """Run every dvc.yaml stage for real in DAG order; return {stage: repo paths of the distillery modules it imported}."""
    repo = tmp_path_factory.mktemp("dag")
    shutil.copy2(ROOT / "dvc.yaml", repo / "dvc.yaml")
    shutil.copytree(ROOT / "stages", repo / "stages")
    (repo / "src").symlink_to(ROOT / "src")  # deps are hashed relative to the repo (resume keys)
    _small_params(repo)
    recorder = tmp_path_factory.mktemp("recorder")
    (recorder / "sitecustomize.py").write_text(RECORDER)
    stages = load_dvc_stages(repo)
    imported: dict[str, set[str]] = {}
    for level in stage_order(stages):
        for name in level:
            trace = tmp_path_factory.mktemp(f"trace-{name}")
            env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   "PYTHONPATH": os.pathsep.join([str(recorder), *filter(None, [os.environ.get("PYTHONPATH")])]),
                   "DISTILLERY_TRACE_IMPORTS": str(trace), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                   "DISTILLERY_PIPELINE_RUN": "dvc-deps-test"}
            env.pop("MLFLOW_TRACKING_URI", None)
            proc = subprocess.run(stages[name].cmd, shell=True, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, f"stage {name} ({stages[name].cmd}) failed:\n{proc.stderr[-3000:]}"
            names = {line for f in trace.glob("*.txt") for line in f.read_text().split()}
            assert "distillery" in names, f"stage {name}: the import recorder saw nothing (sitecustomize not loaded?)"
            imported[name] = {f for f in map(_module_file, names) if f}
    return imported


@pytest.mark.slow
def test_every_module_a_stage_imports_is_one_of_its_deps(traced):
    stages = load_dvc_stages(ROOT)
    assert set(traced) == set(stages)
    missing = {name: sorted(f for f in files if not _covered(f, stages[name].deps)) for name, files in traced.items()}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, "dvc.yaml: stages import code their deps do not list (add it to the stage's deps):\n" + "\n".join(
        f"  {name}: {', '.join(files)}" for name, files in missing.items())
    # the training stages' workers were traced too: their method and trainer are among the imports
    for name, module in (("teacher", "methods/sft.py"), ("pretrain", "methods/dfsft.py")):
        if name in traced:
            assert {f"{PACKAGE_IN_REPO}/{module}", f"{PACKAGE_IN_REPO}/trainer.py"} <= traced[name], name
