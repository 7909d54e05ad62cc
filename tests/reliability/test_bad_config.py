"""Case 8.11: a run config (or a dotted override) a user got wrong ends in one line and exit code 2.

Every input is written for real and handed to the real CLI (``distillery train --config X`` in a
temp folder, a subprocess): a 10,000-deep nesting, bytes that are not UTF-8, a 5,000-digit integer,
a 300-character ``init_from``, a 200 MiB file, a 4,000-character value, and the same bounds broken
through dotted overrides. Each must print exactly one line on stderr that names the file or key,
exit with 2, and leave the previous run's checkpoint folder as it was.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

CASE = "8.11"
DISTILLERY = str(Path(sys.executable).parent / "distillery")
MAX_LINE = 400  # an error line a person can read
pytestmark = pytest.mark.process  # every case runs the CLI in a subprocess


def _good(tmp: Path) -> dict:
    """A valid run config (the model folder need not exist: every case fails before it is opened)."""
    return {
        "models": {"student": {"_target_": "distillery.models.wan.WanModel", "init_from": str(tmp / "base")}},
        "method": {"_target_": "distillery.methods.sft.SFTMethod"},
        "training": {"data": {"path": str(tmp / "data")}, "checkpoint": {"output_dir": str(tmp / "run")},
                     "tracker": {"backend": "none"}},
    }


def _previous_run(tmp: Path) -> list[Path]:
    """A previous run's checkpoint files in the config's output_dir (none may be lost)."""
    files = [tmp / "run" / "checkpoint-2" / name for name in ("metadata.json", "weights.bin")] + [tmp / "run" / "train_log.jsonl"]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"kept {f.name}\n")
    return files


def _write(tmp: Path, text: str | bytes) -> Path:
    path = tmp / "run.yaml"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


Written = tuple[Path, list[str], list[str]]  # config file, overrides, more text the error line must hold


def deep(tmp: Path) -> Written:
    return _write(tmp, "models: " + "[" * 10_000 + "]" * 10_000 + "\n"), [], []


def not_utf8(tmp: Path) -> Written:
    text = yaml.safe_dump(_good(tmp), sort_keys=False).encode()
    return _write(tmp, text + b"# caf\xe9 in Latin-1\n"), [], [f"0xe9 at byte offset {len(text) + 5}"]


def huge_int(tmp: Path) -> Written:
    text = yaml.safe_dump(_good(tmp), sort_keys=False) + "  loop:\n    seed: " + "9" * 5000 + "\n"
    return _write(tmp, text), [], [f"run.yaml: training.loop.seed (line {text.count(chr(10))}): "]


def long_init_from(tmp: Path) -> Written:
    cfg = _good(tmp)
    cfg["models"]["student"]["init_from"] = str(tmp / ("b" * 300))
    return _write(tmp, yaml.safe_dump(cfg, sort_keys=False)), [], []


def huge_file(tmp: Path) -> Written:
    path = _write(tmp, 'models: "' + "a" * 4096)
    with path.open("r+b") as fh:  # 200 MiB (sparse past the first 4 KiB): the size is refused before any read
        fh.truncate(200 * 2**20)
    return path, [], []


def long_value(tmp: Path) -> Written:
    cfg = _good(tmp)
    cfg["training"]["loop"] = {"max_train_steps": "x" * 4000}
    return _write(tmp, yaml.safe_dump(cfg, sort_keys=False, width=10**6)), [], []


def override_int(tmp: Path) -> Written:
    return _write(tmp, yaml.safe_dump(_good(tmp))), ["--training.loop.seed", "9" * 5000], []


def override_path(tmp: Path) -> Written:
    return _write(tmp, yaml.safe_dump(_good(tmp))), ["--models.student.init_from", str(tmp / ("c" * 300))], []


def override_deep(tmp: Path) -> Written:
    return _write(tmp, yaml.safe_dump(_good(tmp))), ["--training.tracker.tags", "{a: " + "[" * 5000 + "]" * 5000 + "}"], []


def _case(name: str, writer: Callable[[Path], Written], injected: str, names: list[str]) -> object:
    mark = pytest.mark.reliability(case=CASE, title=f"bad run config: {name.replace('_', ' ')}", injected=injected,
                                   expect="exit 2, one stderr line naming the file/key, previous run folder intact")
    return pytest.param(writer, names, marks=mark, id=name)


CASES = [
    _case("deep", deep, "a 10,000-deep nested list", ["run.yaml", "nested deeper than 32 levels"]),
    _case("not_utf8", not_utf8, "a Latin-1 byte 0xe9 in the file", ["run.yaml", "not UTF-8"]),
    _case("huge_int", huge_int, "training.loop.seed of 5,000 digits", ["training.loop.seed (line ", "an integer of 5000 digits; at most 64"]),
    _case("long_init_from", long_init_from, "a 300-character init_from folder name",
          ["models.student.init_from", "300 bytes", "255"]),
    _case("huge_file", huge_file, "a 200 MiB config file", ["run.yaml", "209715200 bytes", "at most 1048576"]),
    _case("long_value", long_value, "a 4,000-character value for an integer key",
          ["training.loop.max_train_steps", "expected an integer", "(4000 characters)"]),
    _case("override_int", override_int, "--training.loop.seed with 5,000 digits", ["--training.loop.seed: an integer of 5000 digits; at most 64"]),
    _case("override_path", override_path, "--models.student.init_from with a 300-character folder name",
          ["models.student.init_from", "300 bytes"]),
    _case("override_deep", override_deep, "--training.tracker.tags nested 5,000 deep",
          ["--training.tracker.tags", "nested deeper"]),
]


@pytest.mark.parametrize("writer, names", CASES)
def test_bad_run_config_is_one_line_exit_2(tmp_path, data_lost, writer, names):
    kept = _previous_run(tmp_path)
    config, overrides, more = writer(tmp_path)
    proc = subprocess.run([DISTILLERY, "train", "--config", str(config), *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    assert line.startswith("error: config error: ") and len(line) <= MAX_LINE, line[:3000]
    for part in names + more:
        assert part in line, line
    assert data_lost.record(sum(not f.is_file() for f in kept), "files of the previous run folder") == 0
