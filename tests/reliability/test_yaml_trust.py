"""Cases 9.3, 9.4, 9.7 and 9.14: ``params.yaml`` and run configs are read as DVC reads them, within bounds
the code can take, and checked before DVC or any stage touches them.

- 9.3: a key written as an alias (``*k : 100000000``, ``&k`` on an earlier key) made a duplicate key
  that PyYAML silently resolved "last wins"; DVC refuses the same file.
- 9.4: DVC reads ``params.yaml`` with ruamel.yaml (YAML 1.2), the stages read it with PyYAML (YAML
  1.1). What DVC's own parser (``dvc.utils.serialize.parse_yaml``) reads, checked here for each
  ambiguous form: ``010`` → 10 (1.1: 8), ``0o10`` → 8 (1.1: the text), ``08`` → 8 (1.1: the text),
  ``1:00`` → the text (1.1: 60, base 60), ``yes``/``no``/``on``/``off`` → text (1.1: booleans),
  ``1e-4``/``1E4``/``1.e4`` → floats (1.1: text; the stages read them as 1.2 does). We must either read the same value or refuse.
- 9.7: values the schema passed but the code could not take (``clips.fps: 1e300``, ``pdd.pdd_steps:
  4000000000``, ``--training.data.text_max_length 1000000000000``, ``batch_size: 1e24``).
- 9.14: a billion-laughs or merge-chain ``params.yaml`` hangs ``dvc repro`` in DVC's own parser before
  any of our code runs; the Prefect flow and ``distillery params check`` refuse it first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import resource
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Union

import pytest
import yaml
from workspace import copy_stages, shipped_params_text

from distillery.common.errors import UserError
from distillery.pipeline.params.reader import Params

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DISTILLERY = str(BIN / "distillery")
SHIPPED = shipped_params_text()  # the defaults as shipped, not the workspace's


def _mark(case: str, title: str, injected: str, expect: str) -> pytest.MarkDecorator:
    return pytest.mark.reliability(case=case, title=title, injected=injected, expect=expect)


def _dvc_reads(text: str) -> Any:
    """What DVC itself reads from a params.yaml text (its own parser, as ``dvc repro`` calls it)."""
    from dvc.utils.serialize import parse_yaml

    return parse_yaml(text, "params.yaml")


def _dvc_refuses(text: str) -> str | None:
    """Why DVC's own parser refuses ``text`` (its underlying ruamel error), or None when it reads it."""
    from dvc.utils.serialize import YAMLFileCorruptedError

    try:
        _dvc_reads(text)
    except YAMLFileCorruptedError as exc:
        return str(exc.__cause__ or exc)
    return None


def _with_scalar(key: str, text: str) -> str:
    """The shipped params.yaml with the scalar of dotted ``key`` written as ``text`` (as a user types it)."""
    *section, name = key.split(".")
    lines = SHIPPED.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"{section[0]}:( |$)", line)) + 1 if section else 0
    indent = "  " if section else ""
    for i in range(start, len(lines)):
        found = re.match(rf"{indent}{name}:( *)([^#\n]*?)( *#.*)?$", lines[i])
        if found:
            lines[i] = f"{indent}{name}: {text}" + (f"  {found.group(3).strip()}" if found.group(3) else "")
            return "\n".join(lines) + "\n"
    raise AssertionError(f"no {key} in the shipped params.yaml")


def _get(data: dict, key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def _workspace(tmp: Path) -> dict[Path, bytes]:
    """A previous teacher artifact and checkpoint; returns every file's bytes."""
    for rel in ("artifacts/teacher/model/transformer/diffusion_pytorch_model.safetensors", "artifacts/teacher/lineage.json",
                "runs/teacher/checkpoint-2/metadata.json", "runs/teacher/run.yaml", "runs/teacher/resume_key.json"):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(f"previous {rel}\n")
    return _snapshot(tmp)


def _snapshot(tmp: Path) -> dict[Path, bytes]:
    written = {tmp / name for name in ("params.yaml", "dvc.yaml", "run.yaml")}  # what the test itself wrote
    return {p: p.read_bytes() for p in sorted(tmp.rglob("*"))
            if p.is_file() and p not in written and "__pycache__" not in p.parts}  # the stage layer's bytecode


def _refused_before_work(tmp: Path, args: list[str], data_lost: Any, timeout: float = 120) -> str:
    """Run ``args`` in ``tmp`` (holding a previous teacher artifact and run): exit 2, one ``error:`` line,
    every file as it was, none added. Returns the line."""
    before = _workspace(tmp)
    proc = subprocess.run(args, cwd=tmp, capture_output=True, text=True, timeout=timeout)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    after = _snapshot(tmp)
    data_lost.record(sum(after.get(p) != b for p, b in before.items()), "files of the previous teacher artifact/run changed or lost")
    assert data_lost.total == 0
    assert set(after) == set(before), f"work was done before the refusal: {sorted(set(after) - set(before))}"
    return lines[0]


# -- 9.3 ------------------------------------------------------------------------------------------
RUN_CONFIG_ALIAS_KEY = """\
models:
  student: {_target_: distillery.models.wan.WanModel, init_from: base}
method: {_target_: distillery.methods.sft.SFTMethod}
training:
  data: {path: data}
  checkpoint: {output_dir: run}
  tracker: {backend: none}
  loop:
    &k max_train_steps: 60
    seed: 0
    *k : 100000000
"""


@pytest.mark.process
@_mark("9.3", "duplicate key through an anchor", "`&k max_train_steps: 60` … `*k : 100000000` in a run config and "
       "`&k steps: 120` … `*k : 5` in params.yaml", "exit 2, one line naming the key; DVC refuses the same file; no file touched")
def test_alias_keys_are_refused(tmp_path, data_lost):
    from distillery.config.loader import read_yaml

    # the run config: the real CLI, a previous run folder beside it
    (tmp_path / "run.yaml").write_text(RUN_CONFIG_ALIAS_KEY)
    line = _refused_before_work(tmp_path, [DISTILLERY, "train", "--config", "run.yaml"], data_lost)
    assert "run.yaml: training.loop" in line and "line 11" in line and "alias" in line, line

    # params.yaml: the real stage command; DVC's own parser refuses this file too
    params = SHIPPED.replace("  steps: 120\n", "  &k steps: 120\n", 1).replace("  batch_size: 16\n", "  batch_size: 16\n  *k : 5\n", 1)
    assert "duplicate key" in _dvc_refuses(params)
    (tmp_path / "params.yaml").write_text(params)
    line = _refused_before_work(tmp_path, [DISTILLERY, "stage", "teacher", "--params", "params.yaml"], data_lost)
    anchor = params.splitlines().index("  &k steps: 120") + 1
    assert line.startswith(f"error: params.yaml: teacher (line {anchor + 2}): a key may not be an alias (*k: steps of line {anchor})"), line

    # the variants, in-process: an alias key naming another mapping's key, keys equal as values, two merge keys
    variants = [  # (file, the message holds, DVC refuses it)
        ("a: &k x\ntraining:\n  *k : 1\n", "training (line 3): a key may not be an alias (*k", False),
        ("training:\n  tracker:\n    tags:\n      1: a\n      0x1: b\n", "training.tracker.tags.0x1 (line 5): duplicate key (first at line 4)", True),
        ("training:\n  tracker:\n    tags:\n      1: a\n      1.0: b\n", "training.tracker.tags.1.0 (line 5): duplicate key (first at line 4)", True),
        ("training:\n  <<: {loop: {}}\n  <<: {data: {}}\n", "training.<< (line 3): duplicate key (first at line 2)", True),
    ]
    for i, (text, expected, dvc_refuses) in enumerate(variants):
        path = tmp_path / f"v{i}.yaml"
        path.write_text(text)
        with pytest.raises(UserError) as info:
            read_yaml(path)
        assert expected in str(info.value) and "\n" not in str(info.value), (text, str(info.value))
        assert (_dvc_refuses(text) is not None) == dvc_refuses, text


# -- 9.4 ------------------------------------------------------------------------------------------
AMBIGUOUS = [  # (params.yaml key, the scalar as written): YAML 1.1 and 1.2 read it differently
    ("seed", "010"), ("seed", "+010"), ("seed", "0o10"), ("seed", "08"), ("seed", "0_10"),
    ("teacher.steps", "1:00"), ("teacher.steps", "-1:30"), ("teacher.steps", "2:30:00"), ("clips.fps", "1:00.5"),
    *[("teacher.activation_checkpointing", v) for v in ("yes", "no", "on", "off", "Yes", "NO", "On", "OFF")],
    ("latents.device", "on"), ("base.path", "yes"), ("base.path", "1:30"), ("base.path", "0o17"),
    ("teacher.learning_rate", "1_0e-5"),
]
AGREED = [  # read alike by both: accepted, and the value is DVC's
    ("seed", "0x10"), ("seed", "10"), ("seed", "1_000"), ("teacher.learning_rate", "1.0e-4"), ("teacher.learning_rate", "0.0001"),
    ("teacher.activation_checkpointing", "true"), ("teacher.activation_checkpointing", "False"), ("latents.fps", ""),
    ("latents.fps", "~"), ("clips.fps", "7.5"), ("teacher.learning_rate", "1.e-4"),
    # an exponent without a dot: YAML 1.1 alone reads text; the stages read it as DVC does (DVC writes small floats so)
    *[("teacher.learning_rate", v) for v in ("1e-4", "1E-4", "1e+4", "12e-05", "2e-06")], ("base.path", "'1:30'"), ("base.path", '"yes"'), ("base.path", "y"),
]


@pytest.mark.process
@_mark("9.4", "DVC and the stage read params.yaml alike", "each YAML 1.1/1.2-ambiguous scalar (octal-looking ints, "
       "sexagesimal, yes/no/on/off; 1e-4 without a dot, which DVC writes back, is read as DVC reads it) at a params.yaml key",
       "either the value DVC's own parser reads, or one line naming the key; the CLI refuses before any work")
def test_params_read_as_dvc_reads_them_or_refused(tmp_path, data_lost):
    path = tmp_path / "params.yaml"
    refused: list[str] = []
    for key, written in AMBIGUOUS + AGREED:
        text = _with_scalar(key, written)
        path.write_text(text)
        try:
            dvc = _get(_dvc_reads(text), key)
        except Exception:  # DVC cannot read it at all: we must refuse it too
            dvc = UserError
        try:
            ours = Params.load(path).get(key)
        except UserError as exc:
            message = str(exc)
            assert message.startswith(f"{path}: {key}") and "\n" not in message and len(message) < 400, (key, written, message)
            assert (key, written) not in AGREED, (key, written, message)
            refused.append(message)
            continue
        assert dvc is not UserError, (key, written, ours)
        same = type(ours) is type(dvc) and (ours == dvc or (isinstance(ours, float) and math.isnan(ours) and math.isnan(dvc)))
        assert same, f"params.yaml {key}: {written}: the stage reads {ours!r}, DVC (and dvc.lock) {dvc!r}"
    assert len(refused) == len(AMBIGUOUS)  # none is read differently; those the schema would take are refused
    assert any("YAML 1.2" in m for m in refused)

    # the stage command itself: one line, before any work
    (tmp_path / "params.yaml").write_text(_with_scalar("seed", "010"))
    line = _refused_before_work(tmp_path, [DISTILLERY, "stage", "clips", "--params", "params.yaml"], data_lost)
    assert line.startswith("error: params.yaml: seed: '010' (line 4): ") and "10" in line and "8" in line, line


# -- 9.7 ------------------------------------------------------------------------------------------
def _numeric(tp: Any) -> str | None:
    """'int', 'float', 'ints', 'floats' (a list/tuple/dict of them) for a numeric annotation, else None."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        kinds = {_numeric(a) for a in typing.get_args(tp) if a is not type(None)} - {None}
        return kinds.pop() if len(kinds) == 1 else None
    if origin in (list, tuple):
        inner = {_numeric(a) for a in typing.get_args(tp) if a is not Ellipsis}
        return f"{inner.pop()}s" if len(inner) == 1 and None not in inner and "s" not in "".join(inner) else None
    if origin is dict:
        inner = _numeric(typing.get_args(tp)[1])
        return f"{inner}s" if inner in ("int", "float") else None
    return {int: "int", float: "float"}.get(tp)


def _numeric_fields(cls: type, where: str = "") -> list[tuple[str, str, Any]]:
    """``(dotted key, kind, annotation)`` of every numeric knob of dataclass ``cls``, nested sections included."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        key, tp = f"{where}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            found += _numeric_fields(tp, key + ".")
        elif _numeric(tp):
            found.append((key, _numeric(tp), tp))
    return found


def _absurd(kind: str, tp: Any, tiny: bool = False) -> Any:
    one = (1e-300 if tiny else 1e300) if kind.startswith("float") else 10**12
    if kind.endswith("s"):
        origin = typing.get_origin(tp)
        if origin is dict:
            return {"student": one}
        if origin is tuple:
            return [one] * len(typing.get_args(tp))
        return [one]
    return one


def _set(data: dict, key: str, value: Any) -> dict:
    node = data
    *head, last = key.split(".")
    for part in head:
        node = node.setdefault(part, {})
    node[last] = value
    return data


def _components() -> list[type]:
    """Every component a run config can name (models, methods, callbacks)."""
    import importlib
    import pkgutil

    import distillery.callbacks
    import distillery.methods
    import distillery.models.wan

    found: dict[str, type] = {}
    for package in (distillery.models.wan, distillery.methods, distillery.callbacks):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for obj in vars(module).values():
                if isinstance(obj, type) and getattr(obj, "component_kind", None) and dataclasses.is_dataclass(getattr(obj, "config_class", None)):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


@_mark("9.7", "every params.yaml knob has a bound", "each numeric params.yaml key set to 10**12 / 1e300 (fps also "
       "1e-300), and pdd.pdd_steps 4000000000 with blocks that fit it", "each refused in one line naming the key")
def test_every_params_knob_is_bounded(tmp_path, data_lost):
    from distillery.pipeline.params.schema import ParamsSchema

    path = tmp_path / "params.yaml"
    cases = [(key, _absurd(kind, tp)) for key, kind, tp in _numeric_fields(ParamsSchema)]
    cases += [("clips.fps", 1e-300), ("latents.fps", 1e-300)]
    accepted = []
    for key, value in cases:
        path.write_text(yaml.safe_dump(_set(yaml.safe_load(SHIPPED), key, value), sort_keys=False))
        try:
            Params.load(path)
            accepted.append(f"{key}={value}")
        except UserError as exc:
            assert str(exc).startswith(f"{path}: {key}") and "\n" not in str(exc), (key, str(exc))
    big = 4_000_000_000
    pdd = {"pdd.pdd_steps": big, "pdd.block_size_max": big, "pdd.sampling_steps": 1, "validate.pdd_nfe": [1]}
    data = yaml.safe_load(SHIPPED)
    for key, value in pdd.items():
        _set(data, key, value)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        Params.load(path)
        accepted.append("pdd.pdd_steps=4000000000 with block_size_max 4000000000")
    except UserError as exc:
        assert "pdd.pdd_steps: 4000000000: must be ≤" in str(exc) or "pdd.block_size_max: 4000000000: must be ≤" in str(exc), str(exc)
    assert not accepted, f"accepted: {accepted}"
    data_lost.record(0, "files (in-process check, nothing written)")


@_mark("9.7", "every run-config knob has a bound", "each numeric key of training.* and of every model, method and "
       "callback config set to 10**12 / 1e300", "each refused in one line naming the key")
def test_every_run_config_knob_is_bounded(data_lost):
    from distillery.config.schema import OptimizerOverride, TrainingConfig
    from distillery.config.typed import from_mapping

    sections = [("training", TrainingConfig, {}), ("models.student.optimizer", OptimizerOverride, {})]
    for cls in _components():
        required = {f.name: "base" for f in dataclasses.fields(cls.config_class)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}  # type: ignore[misc]
        sections.append((f"{cls.__qualname__}", cls.config_class, required))
    accepted, checked = [], 0
    for where, cls, required in sections:
        for key, kind, tp in _numeric_fields(cls):
            checked += 1
            data = _set({**required}, key, _absurd(kind, tp))
            try:
                from_mapping(cls, data, where)
                accepted.append(f"{where}.{key}")
            except UserError as exc:
                assert f"{where}.{key}" in str(exc) and "\n" not in str(exc), (where, key, str(exc))
    assert checked > 50 and not accepted, f"accepted absurd values for: {accepted}"
    data_lost.record(0, "files (in-process check, nothing written)")


@pytest.mark.process
@_mark("9.7", "values the code cannot take", "--training.data.text_max_length 1000000000000; teacher.batch_size 1e24; "
       "clips.fps 1e-300; a teacher batch of 4096 latents of 1025×4096×4096", "exit 2, one line, before runs/teacher or any file is touched")
@pytest.mark.parametrize("args, params, expected", [
    pytest.param(["train", "--config", "run.yaml", "--training.data.text_max_length", "1000000000000"], None,
                 "config error: training.data.text_max_length: 1000000000000: must be ≤", id="text_max_length"),
    pytest.param(["stage", "teacher"], {"teacher.batch_size": 10**24}, "params.yaml: teacher.batch_size: ", id="batch_size"),
    pytest.param(["stage", "clips"], {"clips.fps": 1e-300}, "params.yaml: clips.fps: 1e-300: must be ≥", id="fps_tiny"),
    pytest.param(["stage", "teacher"], {"teacher.batch_size": 4096, "latents.num_frames": 1025, "latents.height": 4096,
                                        "latents.width": 4096},
                 "stage teacher: one batch (teacher.batch_size 4096 × gpus.nproc_per_node 1) of latents", id="batch_memory"),
    pytest.param(["stage", "teacher"], {"teacher.batch_size": 200}, "stage teacher: one global batch (× gpus.nproc_per_node 1 × "
                 "gpus.nnodes 1) of teacher.batch_size 200 is more than the 96 training samples (artifacts/latents)",
                 id="batch_data"),
])
def test_values_the_code_cannot_take_are_refused_before_work(tmp_path, data_lost, args, params, expected):
    if params is None:
        (tmp_path / "run.yaml").write_text(RUN_CONFIG_ALIAS_KEY.replace("    &k max_train_steps: 60\n", "").replace("    *k : 100000000\n", ""))
    else:
        data = yaml.safe_load(SHIPPED)
        for key, value in params.items():
            _set(data, key, value)
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
        copy_stages(tmp_path)  # the stage layer: a stage reads its recipes' registry beside params.yaml
        manifest = tmp_path / "artifacts" / "latents" / "data" / "preprocess.json"  # the latent set's counts
        manifest.parent.mkdir(parents=True)
        manifest.write_text(json.dumps({"settings": {}, "splits": {"train": {"rows": 96}, "validation": {"rows": 24}}}))
    line = _refused_before_work(tmp_path, [DISTILLERY, *args], data_lost)
    assert line.startswith(f"error: {expected}"), line



# -- 9.14 -----------------------------------------------------------------------------------------
LAUGHS = "lol0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))
MERGES = "m0: &m0 {k0: 0}\n" + "".join(f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}], k{i}: {i}}}\n" for i in range(1, 40))


def _limited() -> None:
    """The child's address space is capped: an unbounded parse fails fast here instead of eating the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


@pytest.mark.process
@_mark("9.14", "billion laughs / merge chain before DVC parses it", "params.yaml with 9^10 aliased strings (billion "
       "laughs) or a 40-level doubling merge chain; `python -m flows.dag` and `distillery params check`",
       "exit 2, one line naming params.yaml, before dvc runs (dvc repro alone hangs in its parser)")
def test_alias_bombs_are_refused_before_dvc_reads_them(tmp_path, data_lost):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "dvc.yaml").write_text("stages:\n  s:\n    cmd: echo ran > out.txt\n    params: [seed]\n    outs: [out.txt]\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=repo, check=True)
    seen = []
    for name, bomb, args in [("merges", MERGES, [sys.executable, "-m", "flows.dag", "--repo", str(repo)]),
                             ("laughs", LAUGHS, [DISTILLERY, "params", "check", "--params", str(repo / "params.yaml")])]:
        (repo / "params.yaml").write_text("seed: 0\n" + bomb)
        before = sorted(p.relative_to(repo) for p in repo.rglob("*") if ".git" not in p.parts)
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=90, preexec_fn=_limited)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (name, proc.returncode, proc.stderr[-3000:])
        assert len(lines) == 1 and lines[0].startswith(f"error: {repo / 'params.yaml'}: ") and "aliases count in full" in lines[0], lines
        after = sorted(p.relative_to(repo) for p in repo.rglob("*") if ".git" not in p.parts)
        data_lost.record(len(set(before) ^ set(after)), f"files added or removed in the repo ({name})")
        seen.append(name)
    (tmp_path / "shipped.yaml").write_text(SHIPPED)
    copy_stages(tmp_path)  # the recipes' registry beside the params file, as in a workspace
    proc = subprocess.run([DISTILLERY, "params", "check", "--params", str(tmp_path / "shipped.yaml")], capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 0 and ": ok:" in proc.stdout, proc.stderr[-3000:]
    assert seen == ["merges", "laughs"] and data_lost.total == 0
