"""Case 8.12: a ``params.yaml`` a user got wrong is refused whole, before any stage works, in one line
that names the key as the user wrote it, with exit code 2.

The real CLI runs (``distillery stage teacher --params params.yaml`` in a temp folder holding a
previous ``artifacts/teacher`` and ``runs/teacher`` checkpoint): the folder must be byte-for-byte as
it was afterwards. The full rule table (every range of the schema) runs in-process through
``Params.load``, the same function the CLI calls; the shipped params.yaml must validate unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from workspace import copy_stages, shipped_params_text

from distillery.common.errors import UserError
from distillery.pipeline.params.loading import to_plain
from distillery.pipeline.params.reader import Params
from distillery.pipeline.params.schema import TRAINING_STAGES, ParamsSchema

CASE = "8.12"
ROOT = Path(__file__).resolve().parents[2]
DISTILLERY = str(Path(sys.executable).parent / "distillery")
SHIPPED = shipped_params_text()  # the defaults as shipped, not the workspace's (an experiment edits it)
LAST_LINE = SHIPPED.count("\n") + 1  # a line appended to the shipped file
TEACHER_STEPS_LINE = SHIPPED.splitlines().index("  steps: 120") + 1  # the first "steps:" is the teacher's


def _edited(**updates: Any) -> str:
    """The shipped params.yaml with ``section__key=value`` set (or added)."""
    params = yaml.safe_load(SHIPPED)
    for dotted, value in updates.items():
        node = params
        *head, last = dotted.split("__")
        for part in head:
            node = node[part]
        node[last] = value
    return yaml.safe_dump(params, sort_keys=False)


def _workspace(tmp: Path) -> dict[Path, bytes]:
    """The stage layer (a stage reads its recipes' registry to check params.yaml), a previous teacher artifact and
    checkpoint; returns every file's bytes."""
    copy_stages(tmp)
    for rel in ("artifacts/teacher/model/transformer/diffusion_pytorch_model.safetensors", "artifacts/teacher/lineage.json",
                "runs/teacher/checkpoint-2/metadata.json", "runs/teacher/run.yaml"):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(f"previous {rel}\n")
    return _snapshot(tmp)


def _snapshot(tmp: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(tmp.rglob("*"))
            if p.is_file() and p.name != "params.yaml" and "__pycache__" not in p.parts}  # the stage layer's bytecode


def _case(name: str, text: str | bytes, injected: str, names: list[str]) -> object:
    mark = pytest.mark.reliability(case=CASE, title=f"bad params.yaml: {name.replace('_', ' ')}", injected=injected,
                                   expect="exit 2, one stderr line naming the params.yaml key; no file touched")
    return pytest.param(text, names, marks=mark, id=name)


CLI_CASES = [
    _case("misspelled key", SHIPPED.replace("  steps: 120\n", "  stpes: 120\n", 1),
          "teacher.stpes instead of teacher.steps", ["params.yaml: teacher.stpes: unknown key", "did you mean steps?"]),
    _case("zero gpus", _edited(gpus__nproc_per_node=0), "gpus.nproc_per_node: 0",
          ["params.yaml: gpus.nproc_per_node: 0: must be ≥ 1"]),
    _case("negative steps", _edited(teacher__steps=-3), "teacher.steps: -3", ["params.yaml: teacher.steps: -3: must be ≥ 1"]),
    _case("learning rate as text", SHIPPED.replace("learning_rate: 2.0e-4", "learning_rate: 1e-4x", 1),
          "teacher.learning_rate: 1e-4x (text)", ["params.yaml: teacher.learning_rate: '1e-4x'"]),
    _case("no teacher steps", _edited(validate__teacher_steps=[]), "validate.teacher_steps: []",
          ["params.yaml: validate.teacher_steps: []: must list at least one step count"]),
    _case("unknown export", _edited(export__student="base"), "export.student: base",
          ["params.yaml: export.student: 'base'", "teacher, pretrain, distill"]),
    _case("HSDP copies not dividing the processes", _edited(gpus__nnodes=2, gpus__replicate_size=3),
          "gpus.nnodes: 2, replicate_size: 3",
          ["params.yaml: gpus.replicate_size: 3: must divide the 2 processes of gpus.nnodes (2) x gpus.nproc_per_node (1)"]),
    _case("SP group not dividing the GPUs", _edited(gpus__nproc_per_node=2, gpus__sp_size=3), "gpus.nproc_per_node: 2, sp_size: 3",
          ["params.yaml: gpus.sp_size: 3 does not divide the world size 2"]),
    _case("not UTF-8", SHIPPED.encode() + b"# caf\xe9\n", "a Latin-1 byte 0xe9 in a comment",
          [f"params.yaml: not UTF-8 text: invalid byte 0xe9 at byte offset {len(SHIPPED.encode()) + 5} (line {LAST_LINE})"]),
    _case("deep nesting", SHIPPED + "extra: " + "[" * 10_000 + "]" * 10_000 + "\n", "a 10,000-deep nested list",
          ["params.yaml: invalid YAML", "nested deeper than 32 levels"]),
    _case("duplicate key", SHIPPED.replace("  steps: 120\n", "  steps: 120\n  steps: 5\n", 1),
          "teacher.steps written twice", [f"params.yaml: teacher.steps (line {TEACHER_STEPS_LINE + 1}): duplicate key (first at line {TEACHER_STEPS_LINE})"]),
]


@pytest.mark.process
@pytest.mark.parametrize("text, names", CLI_CASES)
def test_bad_params_is_one_line_exit_2_before_any_work(tmp_path, data_lost, text, names):
    before = _workspace(tmp_path)
    (tmp_path / "params.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
    proc = subprocess.run([DISTILLERY, "stage", "teacher", "--params", "params.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: params.yaml: "), proc.stderr[-3000:]
    for part in names:
        assert part in lines[0], lines[0]
    assert "training." not in lines[0]  # the params.yaml key, never the run-config key it feeds
    after = _snapshot(tmp_path)
    data_lost.record(sum(after.get(p) != b for p, b in before.items()), "files of the previous teacher artifact/run changed or lost")
    assert data_lost.total == 0
    assert set(after) == set(before), "a stage did work before params.yaml was validated"


def _mark(title: str, injected: str, expect: str) -> pytest.MarkDecorator:
    return pytest.mark.reliability(case=CASE, title=title, injected=injected, expect=expect)


RULES = [  # (edits, the message must contain)
    ({"seed": -1}, "seed: -1: must be in [0, 4294967295]"),
    ({"seed": 1.5}, "seed: 1.5: expected an integer"),
    ({"gpus__nnodes": 0}, "gpus.nnodes: 0: must be ≥ 1"),
    ({"gpus__nproc_per_node": True}, "gpus.nproc_per_node: true: expected an integer"),
    ({"gpus__nnodes": 2, "gpus__rdzv_endpoint": "node0"}, "gpus.rdzv_endpoint: 'node0': must be host:port"),
    ({"gpus__rdzv_endpoint": "node0:99999"}, "gpus.rdzv_endpoint: 'node0:99999': must be host:port"),
    ({"gpus": 4}, "gpus: 4: expected a mapping with keys nproc_per_node, nnodes, launcher, rdzv_endpoint, replicate_size"),
    ({"gpus__launcher": "pbs"}, "gpus.launcher: 'pbs'"),
    ({"clips__num_train": 0}, "clips.num_train: 0: must be ≥ 1"),
    ({"clips__num_validation": -1}, "clips.num_validation: -1: must be ≥ 0"),
    ({"clips__num_frames": 16}, "clips.num_frames: 16: must be 4k+1"),
    ({"clips__size": 0}, "clips.size: 0: must be a positive multiple of 16"),
    ({"clips__fps": 0}, "clips.fps: 0: must be a finite number > 0"),
    ({"clips__fps": float("inf")}, "clips.fps: inf: must be a finite number > 0"),
    ({"base__path": 3}, "base.path: 3: expected a string"),
    ({"base__path": ""}, "base.path: '': must not be empty"),
    ({"base__path": "/x/" + "y" * 300}, "base.path: '/x/yyy"),
    ({"latents__data": ["a"]}, "latents.data: ['a']: expected a string or null"),
    ({"latents__data": "a\x00b"}, "latents.data: 'a\\x00b': contains a NUL character"),
    ({"latents__rows_per_shard": 0}, "latents.rows_per_shard: 0: must be ≥ 1"),
    ({"latents__max_bad_fraction": 1.5}, "latents.max_bad_fraction: 1.5: must be in [0, 1]"),
    ({"teacher__batch_size": 0}, "teacher.batch_size: 0: must be ≥ 1"),
    ({"teacher__learning_rate": 0}, "teacher.learning_rate: 0: must be a finite number > 0"),
    ({"teacher__learning_rate": float("nan")}, "teacher.learning_rate: nan: must be a finite number > 0"),
    ({"teacher__save_every": -1}, "teacher.save_every: -1: must be ≥ 0"),
    ({"pretrain__steps": 0}, "pretrain.steps: 0: must be ≥ 1"),
    ({"pretrain__chunk_size": 0}, "pretrain.chunk_size: 0: must be ≥ 1"),
    ({"pretrain__chunk": 2}, "pretrain.chunk: unknown key; valid keys: method, steps, batch_size, learning_rate, lr_scheduler, "
                             "warmup_steps, weight_decay, ema_decay, … (33 in all); did you mean chunk_size?"),
    ({"validate__num_prompts": 0}, "validate.num_prompts: 0: must be ≥ 1"),
    ({"validate__teacher_steps": [40, 0]}, "validate.teacher_steps: [40, 0]: step counts must be ≥ 1"),
    ({"validate__teacher_steps": [40, "4"]}, "validate.teacher_steps: [40, '4']: item 1 ('4'): expected an integer"),
    ({"validate__teacher_steps": 40}, "validate.teacher_steps: 40: expected a list"),
    ({"validate__pretrain_steps": 0}, "validate.pretrain_steps: 0: must be ≥ 1"),
    ({"validate__num_seeds": 0}, "validate.num_seeds: 0: must be ≥ 1"),
    ({"distill__method": "sid"}, "distill.method: 'sid': valid values: dmd2, phased_dmd, self_forcing (stages/recipes/distill/)"),
    ({"distill__student_steps": 0}, "distill.student_steps: 0: must be ≥ 1"),
    ({"distill__context_noise": 1000.0}, "distill.context_noise: 1000.0: must be in [0, 1000): a timestep"),
    ({"distill__critic_learning_rate": 0}, "distill.critic_learning_rate: 0: must be a finite number > 0"),
    ({"validate__guidance_scale": -1.0}, "validate.guidance_scale: -1.0: must be a finite number ≥ 1 (1: no guidance)"),
    ({"export__student": "base"}, "export.student: 'base': valid values: teacher, pretrain, distill"),
    ({"teacher__sp_size": 0}, "teacher.sp_size: 0: must be ≥ 1"),
    ({"gpus": {"nproc_per_node": 2, "nnodes": 2, "tp_size": 2}, "distill__sp_size": 2},
     "distill.sp_size × gpus.tp_size: a group of 4 ranks is larger than a node's 2 processes"),
    ({"gpus": {"nproc_per_node": 4, "replicate_size": 4, "sp_size": 2}},
     "gpus.replicate_size: 4 copies leave 1 ranks each, which sp_size 2 × tp_size 1 does not divide (stage teacher)"),
    ({"gpus": {"nproc_per_node": 2}, "pdd__tp_size": 2, "pdd__lora_rank": 4},
     "pdd.lora_rank: 4: tensor parallelism (pdd.tp_size 2) does not split a LoRA adapter"),
    ({"teachr": {}}, "teachr: unknown key; valid keys: seed, gpus, clips, base, latents, prompts, teacher, pretrain, distill, "
                     "pdd, posttrain, validate, … (13 in all); did you mean teacher?"),
]


@_mark("params.yaml schema: every range", "each schema rule broken once (40 edits)",
       "each refused in one line naming the key and the bad value")
def test_every_rule_names_the_key(tmp_path, data_lost):
    path = tmp_path / "params.yaml"
    for updates, expected in RULES:
        path.write_text(_edited(**updates))
        with pytest.raises(UserError) as info:
            Params.load(path)
        message = str(info.value)
        assert message.startswith(f"{path}: ") and "\n" not in message and len(message) < 300, message
        assert expected in message, (updates, message)
    data_lost.record(0, "files (in-process check, nothing written)")


@_mark("shipped params.yaml validates", "none: the params.yaml in the repository",
       "validates unchanged; schema defaults equal it; every key a stage reads is in the schema")
def test_shipped_params_validate_unchanged(tmp_path, data_lost):
    from stages.recipes import registry

    (tmp_path / "params.yaml").write_text(SHIPPED)
    params = Params.load(tmp_path / "params.yaml")
    shipped = yaml.safe_load(SHIPPED)
    assert params.data == shipped  # nothing added, dropped or converted
    defaults = to_plain(ParamsSchema())  # the sections' defaults (a training section's: its common knobs) ...
    for stage, methods in registry().items():  # ... and the recipes': each shipped key some recipe's, at its default
        chosen = methods[shipped[stage]["method"]]
        assert chosen.Params is type(params.get(stage))
        knobs = {k: v for recipe in methods.values() for k, v in dataclasses.asdict(recipe.Params()).items()}
        knobs["method"] = getattr(ParamsSchema(), stage).method
        assert set(shipped[stage]) <= set(knobs), set(shipped[stage]) - set(knobs)  # no key that no recipe declares
        # the section's common knobs and its shipped recipe's all shipped; another recipe's own knob needs no line
        # (a new method's knobs take their defaults until a user sets one: tests/test_params_keys.py)
        assert set(defaults[stage]) | set(dataclasses.asdict(chosen.Params())) <= set(shipped[stage])
        defaults[stage] = {k: knobs[k] for k in shipped[stage]}
    assert defaults == shipped  # the defaults are the shipped values
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    for key in {k for s in dvc["stages"].values() for k in s.get("params", [])}:
        params.get(key)  # raises on a key the schema lacks
    assert params.subset(["seed", "teacher"]) == {"seed": shipped["seed"], "teacher": shipped["teacher"]}
    assert {k: v for k, v in dataclasses.asdict(params.typed).items()} == {
        k: {f: v[f] for f in dataclasses.asdict(getattr(params.typed, k))} if k in TRAINING_STAGES else v
        for k, v in shipped.items()}
    data_lost.record(0, "files (read-only check)")


@_mark("a path params.yaml names is checked before any stage works",
       "base.path = an existing folder that is not a model folder (no model_index.json), then a Wan folder without "
       "transformer/config.json; latents.data = a folder without a captions file; `distillery stage clips` (the first "
       "stage, which reads neither) and `distillery params check`",
       "exit 2, one line naming base.path (latents.data) before clips works; `params check` the same; a stage after "
       "the one reading the path does not ask again")
def test_a_bad_path_stops_the_first_stage_before_any_work(tmp_path, monkeypatch, capsys, data_lost):
    """In-process through the real parser and its error guard (what ``distillery ...`` runs: exit code, stderr)."""
    import shutil

    from distillery.cli.guard import run_guarded
    from distillery.cli.main import build_parser
    from distillery.pipeline.launch.preflight import check_paths
    from distillery.pipeline.launch.runner import STAGES
    from distillery.tinybase.shipped import shipped_tiny_base

    not_a_model = tmp_path / "downloads" / "wan"
    not_a_model.mkdir(parents=True)
    (not_a_model / "notes.txt").write_text("the weights are still downloading\n")
    no_transformer = tmp_path / "wan-without-transformer"
    shutil.copytree(shipped_tiny_base(), no_transformer, ignore=shutil.ignore_patterns("transformer", "*.safetensors"))
    no_captions = tmp_path / "my-videos"
    (no_captions / "videos").mkdir(parents=True)
    cases = [({"base__path": str(not_a_model)}, "clips", f"params.yaml: base.path: {not_a_model} is not a diffusers model folder"),
             ({"base__path": str(no_transformer)}, "clips", f"params.yaml: base.path: {no_transformer} has no transformer/config.json"),
             ({"latents__data": str(no_captions)}, "base", f"params.yaml: latents.data: no captions file in {no_captions}")]
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.chdir(ws)
    for updates, stage, expected in cases:
        (ws / "params.yaml").write_text(_edited(**updates))
        for command in (["stage", stage, "--params", "params.yaml"], ["params", "check"]):
            ns = build_parser().parse_args(command)
            capsys.readouterr()
            rc = run_guarded(lambda: ns.func(ns))
            lines = capsys.readouterr().err.strip().splitlines()
            assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), (command, lines)
        data_lost.record(len([p for p in ws.rglob("*") if p.name != "params.yaml"]), "files a stage wrote before its params were checked")
    (ws / "params.yaml").write_text(_edited(base__path=str(not_a_model)))
    check_paths(Params.load(ws / "params.yaml"), "latents", tuple(STAGES))  # base ran already: latents does not read base.path
    from distillery.data.video_folder import CAPTION_FILES
    from distillery.pipeline.launch import preflight

    assert preflight.CAPTION_FILES == CAPTION_FILES  # the layout check knows the captions files the latents stage reads
    assert data_lost.total == 0


@pytest.mark.reliability(case="10.6", title="params.yaml that is not a file",
                         injected="params.yaml a FIFO, then a symlink to /dev/zero, then a folder; `distillery params check`",
                         expect="exit 2, one line saying what it is (not 'not found'); no hang, nothing read from the device")
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_params_file_that_is_not_a_file_is_named(tmp_path, monkeypatch, capsys, data_lost, kind):
    import os

    from distillery.cli.guard import run_guarded
    from distillery.cli.main import build_parser

    monkeypatch.chdir(tmp_path)
    params = tmp_path / "params.yaml"
    {"fifo": lambda: os.mkfifo(params), "dev-zero": lambda: params.symlink_to("/dev/zero"), "folder": params.mkdir}[kind]()
    ns = build_parser().parse_args(["params", "check"])
    capsys.readouterr()
    rc = run_guarded(lambda: ns.func(ns))
    lines = capsys.readouterr().err.strip().splitlines()
    words = {"fifo": "is a named pipe", "dev-zero": "is a character device through a symbolic link", "folder": "is a folder"}[kind]
    assert rc == 2 and len(lines) == 1 and words in lines[0] and "not found" not in lines[0], lines
    data_lost.record(0, "files lost")


@pytest.mark.reliability(case="10.7", title="a few videos of one's own meet the default batch sizes",
                         injected="latents.data a folder of 5 captioned videos, params.yaml's default batch sizes (16); "
                                  "`distillery params check`, `distillery stage clips`; then docs/profiles/few-videos.yaml's values",
                         expect="exit 2, one line naming all four batch keys and the 5 captions, before any video is encoded; "
                                "with the profile's values: ok")
def test_a_batch_larger_than_ones_own_videos_is_refused_before_encoding(tmp_path, monkeypatch, capsys, data_lost):
    from distillery.cli.guard import run_guarded
    from distillery.cli.main import build_parser
    from distillery.pipeline.params.profile import load_profile

    videos = tmp_path / "my-videos"
    (videos / "videos").mkdir(parents=True)
    lines = []
    for i in range(5):
        (videos / "videos" / f"clip{i}.mp4").write_bytes(b"\0" * 64)  # counted, never decoded by the check
        lines.append(json.dumps({"path": f"videos/clip{i}.mp4", "caption": f"a red ball moves left, take {i}"}))
    (videos / "captions.jsonl").write_text("\n".join(lines) + "\n")
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.chdir(ws)
    (ws / "params.yaml").write_text(_edited(latents__data=str(videos)))
    for command in (["params", "check"], ["stage", "clips", "--params", "params.yaml"]):
        ns = build_parser().parse_args(command)
        capsys.readouterr()
        rc = run_guarded(lambda: ns.func(ns))
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert all(f"{s}.batch_size 16" in err[0] for s in ("teacher", "pretrain", "distill", "pdd")), err
        assert "the 5 captions of" in err[0] and "few-videos.yaml" in err[0], err
    data_lost.record(len([p for p in ws.rglob("*") if p.name != "params.yaml"]), "files written before the refusal")
    profile = load_profile(ROOT / "docs" / "profiles" / "few-videos.yaml", ws / "params.yaml")
    (ws / "params.yaml").write_text(_edited(latents__data=str(videos), **{k.replace(".", "__"): v for k, v in profile.items()}))
    ns = build_parser().parse_args(["params", "check"])
    assert run_guarded(lambda: ns.func(ns)) == 0
    assert data_lost.total == 0


GUIDANCE_KNOBS = ("pretrain.guidance_scale", "distill.guidance_scale", "pdd.guidance_scale", "validate.guidance_scale")


@pytest.mark.reliability(case="11.4", title="one rule for guidance: every guidance knob below 1 is refused",
                         injected="each of pretrain/distill/pdd/validate.guidance_scale set to 0.5, then 0; "
                                  "`distillery params check` (the real parser and error guard, in-process)",
                         expect="exit 2, one line naming the knob with pdd's words (must be a finite number ≥ 1 (1: no "
                                "guidance)); 1 and 4 pass")
def test_every_guidance_knob_below_one_is_refused(tmp_path, monkeypatch, capsys, data_lost):
    """The samplers' CFG (:func:`distillery.sampling.base.guide`) runs the conditional model alone for every w ≤ 1, so a
    scale in [0, 1) would be recorded in logs and lineage while w = 1 ran; pdd refused it, the others did not."""
    from distillery.cli.guard import run_guarded
    from distillery.cli.main import build_parser

    monkeypatch.chdir(tmp_path)
    for knob in GUIDANCE_KNOBS:
        for value, refused in ((0.5, True), (0.0, True), (1.0, False), (4.0, False)):
            (tmp_path / "params.yaml").write_text(_edited(**{knob.replace(".", "__"): value}))
            ns = build_parser().parse_args(["params", "check"])
            capsys.readouterr()
            rc = run_guarded(lambda: ns.func(ns))
            err = capsys.readouterr().err.strip().splitlines()
            if refused:
                assert rc == 2 and len(err) == 1, (knob, value, err)
                assert err[0] == f"error: params.yaml: {knob}: {value}: must be a finite number ≥ 1 (1: no guidance)", err
            else:
                assert rc == 0, (knob, value, err)
    data_lost.record(len([p for p in tmp_path.rglob("*") if p.name != "params.yaml"]), "files written by the check")
    assert data_lost.total == 0


@pytest.mark.process
@pytest.mark.reliability(case="11.8", title="the tests read the shipped defaults, not the workspace's params.yaml",
                         injected="a copy of the checkout (git, its params.yaml committed) whose params.yaml an experiment "
                                  "changed as `dvc exp run -S distill.method=dmd2 -S teacher.steps=7` leaves it; then this "
                                  "file's schema tests run there (pytest)",
                         expect="they pass: the defaults they compare are the committed file's, never the experiment's")
def test_the_tests_read_the_shipped_params_not_an_experiments(tmp_path, data_lost):
    import os
    import shutil

    from dvc.utils.hydra import apply_overrides

    checkout = tmp_path / "checkout"
    for name in ("tests", "stages", "docs", "dvc.yaml", "params.yaml", "pyproject.toml"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, checkout / name)
    (checkout / "params.yaml").write_text(SHIPPED)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    subprocess.run([*git, "add", "-A"], cwd=checkout, check=True)
    subprocess.run([*git, "commit", "-qm", "the checkout"], cwd=checkout, check=True)
    apply_overrides(checkout / "params.yaml", ["distill.method=dmd2", "teacher.steps=7"])  # what `dvc exp run -S` leaves
    assert (checkout / "params.yaml").read_text() != SHIPPED
    import tempfile

    # its own, short temp root: the inner pytest must not clean this session's folders, and its messages name paths
    inner_tmp = tempfile.mkdtemp(prefix="inner-")
    inner = {k: v for k, v in os.environ.items() if k != "DISTILLERY_RELIABILITY_REPORT"}
    inner["PYTEST_DEBUG_TEMPROOT"] = inner_tmp
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                           "tests/reliability/test_bad_params.py", "-k", "shipped_params_validate or every_rule or guidance"],
                          cwd=checkout, capture_output=True, text=True, timeout=600, env=inner)
    shutil.rmtree(inner_tmp, ignore_errors=True)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    data_lost.record(0, "files of the checkout changed")


@pytest.mark.reliability(case="11.10", title="a chain no recipe describes is said in one line",
                         injected="distill.method: dmd2 on the defaults (pretrain.method: dfsft, a causal student); then with "
                                  "pretrain.method: ode_init_bidirectional; then self_forcing from ode_init_bidirectional",
                         expect="`distillery params check` exits 0 with one 'note:' line naming the init DMD2's recipe "
                                "starts from (and the -S that sets it); the recipe's chain: no note")
def test_a_mismatched_chain_is_said_in_one_line(tmp_path, monkeypatch, capsys, data_lost):
    from distillery.cli.guard import run_guarded
    from distillery.cli.main import build_parser

    monkeypatch.chdir(tmp_path)
    cases = [({"distill__method": "dmd2"}, "distill.method: dmd2 starts from pretrain.method: dfsft (a causal student), "
                                           "not its recipe's init: add -S pretrain.method=ode_init_bidirectional"),
             ({"distill__method": "dmd2", "pretrain__method": "ode_init_bidirectional"}, None),
             ({"pretrain__method": "ode_init_bidirectional"}, "distill.method: self_forcing starts from pretrain.method: "
                                                              "ode_init_bidirectional (a bidirectional student)"),
             ({}, None)]
    for updates, note in cases:
        (tmp_path / "params.yaml").write_text(_edited(**updates))
        ns = build_parser().parse_args(["params", "check"])
        capsys.readouterr()
        assert run_guarded(lambda ns=ns: ns.func(ns)) == 0
        notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
        assert (notes == []) if note is None else (len(notes) == 1 and notes[0].startswith(f"note: {note}")), (updates, notes)
    data_lost.record(0, "files written by the check")
