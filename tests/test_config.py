"""Run-config loading: typed sections, the _target_ allowlist, overrides, one-line errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import run_config, write_config

from distillery.common.errors import UserError
from distillery.config import allowed_prefixes, load_run_config
from distillery.config.loader import parse_override_args

PREFIXES = allowed_prefixes()


def _raw(tmp_path: Path) -> dict:
    return run_config(tmp_path / "base", tmp_path / "data", tmp_path / "run")


def _error(raw: dict, overrides: list[str] = (), prefixes=PREFIXES) -> str:
    with pytest.raises(UserError) as info:
        load_run_config(raw=raw, overrides=parse_override_args(list(overrides)), prefixes=prefixes)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_learning_rate_of_zero_is_refused_as_params_yaml_refuses_it(tmp_path):
    """One rule for a learning rate, a run config's as params.yaml's: a finite number > 0 (0 trains nothing), for
    ``training.optimizer`` and a role's own ``models.<role>.optimizer`` alike; one line naming the key."""
    raw = _raw(tmp_path)
    raw["training"]["optimizer"]["learning_rate"] = 0
    assert _error(raw) == "config error: training.optimizer.learning_rate: 0: must be a finite number > 0"
    raw = _raw(tmp_path)
    raw["models"]["student"]["optimizer"] = {"learning_rate": 0.0}
    assert _error(raw) == "config error: models.student.optimizer.learning_rate: 0.0: must be a finite number > 0"
    assert _error(_raw(tmp_path), ["--training.optimizer.learning_rate", "-1e-4"]) == \
        "config error: training.optimizer.learning_rate: -0.0001: must be a finite number > 0"


def test_typed_config_and_explicit_zeros(tmp_path):
    raw = _raw(tmp_path)
    raw["training"]["optimizer"].update({"weight_decay": 0, "warmup_steps": 0, "min_lr_ratio": 0})
    raw["callbacks"] = {"ema": {"_target_": "distillery.callbacks.ema.EMACallback", "decay": 0, "start_step": 0}}
    cfg = load_run_config(raw=raw, prefixes=PREFIXES)
    assert cfg.training.optimizer.weight_decay == 0.0 and isinstance(cfg.training.optimizer.weight_decay, float)
    assert cfg.training.optimizer.min_lr_ratio == 0.0
    assert cfg.callbacks["ema"].config.decay == 0.0  # not replaced by the 0.999 default
    assert cfg.training.loop.max_train_steps == 10
    assert cfg.models["student"].config.init_from == str(tmp_path / "base")
    plain = cfg.to_plain()
    assert plain["method"]["_target_"] == "distillery.methods.sft.SFTMethod"
    assert plain["callbacks"]["ema"]["decay"] == 0.0


def test_overrides_apply_and_parse_yaml_values(tmp_path):
    cfg = load_run_config(
        raw=_raw(tmp_path),
        overrides=parse_override_args(["--training.loop.max_train_steps", "0", "--method.caption_dropout=0.25",
                                       "--models.student.shift", "5", "--training.optimizer.betas", "[0.0, 0.99]"]),
        prefixes=PREFIXES,
    )
    assert cfg.training.loop.max_train_steps == 0
    assert cfg.method.config.caption_dropout == 0.25
    assert cfg.models["student"].config.shift == 5.0
    assert cfg.training.optimizer.betas == (0.0, 0.99)


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda r: r["training"]["loop"].update(max_train_stepz=3), "training.loop.max_train_stepz: unknown key; valid keys: max_train_steps"),
        (lambda r: r["training"]["loop"].update(max_train_steps="ten"), "training.loop.max_train_steps: expected an integer, got 'ten'"),
        (lambda r: r["training"]["loop"].update(max_train_steps=1.5), "training.loop.max_train_steps: expected an integer"),
        (lambda r: r["training"]["optimizer"].update(lr_scheduler="exp"),
         "training.optimizer.lr_scheduler: got 'exp'; valid values: 'constant', 'cosine', 'linear'"),
        (lambda r: r["training"].update(optimiser={}), "training.optimiser: unknown key; valid keys: distributed, data, optimizer"),
        (lambda r: r.update(trainer={}), "trainer: unknown key; valid keys: models, method, training, callbacks"),
        (lambda r: r["models"]["student"].update(lora_rank=4), "models.student.lora_rank: unknown key; valid keys: init_from, trainable"),
        (lambda r: r["models"]["student"].pop("init_from"), "models.student.init_from: required key is missing"),
        (lambda r: r["method"].update(chunk_size=3), "method.chunk_size: unknown key; valid keys: precondition_outputs, caption_dropout"),
        (lambda r: r["method"].update(caption_dropout=2.0), "method: caption_dropout must be in [0, 1]"),
        (lambda r: r["method"].update(_target_="os.system"), "method._target_: os.system is outside the allowed prefixes (distillery.)"),
        (lambda r: r["method"].update(_target_="distillery.methods.base.torch.save"), "is defined in torch.serialization, outside the allowed prefixes"),
        (lambda r: r["method"].update(_target_="distillery.methods.sft.Nope"), "method._target_: distillery.methods.sft.Nope does not exist"),
        (lambda r: r["method"].update(_target_="distillery.models.wan.WanModel"), "method._target_: distillery.models.wan.WanModel is not a distillery method"),
        (lambda r: r["models"].update(teacher=dict(r["models"]["student"])), "models: SFTMethod needs roles student; unexpected teacher"),
        (lambda r: r["models"]["student"].update(trainable=False), "models.student.trainable: SFTMethod trains the student; set it to true"),
    ],
)
def test_config_errors_are_one_line_naming_the_key(tmp_path, mutate, expected):
    from distillery.engine.builder import check_roles_early

    raw = _raw(tmp_path)
    mutate(raw)
    with pytest.raises(UserError) as info:
        check_roles_early(load_run_config(raw=raw, prefixes=PREFIXES))
    message = str(info.value)
    assert "\n" not in message
    assert expected in message


@pytest.mark.parametrize(
    "override, expected",
    [
        (["--training.loop.max_train_stepz", "10"], "training.loop.max_train_stepz: unknown key; valid keys: max_train_steps"),
        (["--training.loops.max_train_steps", "10"], "training.loops: unknown key; valid keys: distributed, data"),
        (["--models.teacher.shift", "3"], "models.teacher: unknown model; valid: student"),
        (["--models.student.shfit", "3"], "models.student.shfit: unknown key; valid keys: init_from"),
        (["--method.chunk_size", "3"], "method.chunk_size: unknown key"),
        (["--training.loop.max_train_steps", "many"], "training.loop.max_train_steps: expected an integer, got 'many'"),
        (["--training.loop.max_train_steps"], "override --training.loop.max_train_steps has no value"),
        (["--training.loop.max_train_steps.x", "1"], "training.loop.max_train_steps: is not a section"),
    ],
)
def test_override_errors(tmp_path, override, expected):
    assert expected in _error(_raw(tmp_path), override)


def test_granted_prefix_is_needed_for_user_code(tmp_path, monkeypatch):
    raw = _raw(tmp_path)
    raw["callbacks"] = {"mine": {"_target_": "helpers_callbacks.CountingCallback"}}
    assert "outside the allowed prefixes" in _error(raw)
    (tmp_path / "helpers_callbacks.py").write_text(
        "from dataclasses import dataclass\n"
        "from distillery.callbacks.base import Callback\n"
        "@dataclass\nclass Cfg:\n    every: int = 1\n"
        "class CountingCallback(Callback):\n    config_class = Cfg\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_run_config(raw=raw, prefixes=allowed_prefixes(["helpers_callbacks"]))
    assert cfg.callbacks["mine"].config.every == 1
    monkeypatch.setenv("DISTILLERY_ALLOWED_TARGET_PREFIXES", "helpers_callbacks")
    assert load_run_config(raw=raw, prefixes=allowed_prefixes()).callbacks["mine"].target == "helpers_callbacks.CountingCallback"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distillery.cli.main", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.process
def test_cli_config_errors_exit_2_with_one_line(tmp_path, tiny_base, latent_set):
    cfg = run_config(tiny_base, latent_set, tmp_path / "run")
    path = write_config(tmp_path / "run.yaml", cfg)
    bad_key = _cli("train", "--config", str(path), "--training.loop.max_train_stepz", "10", cwd=tmp_path)
    assert bad_key.returncode == 2
    assert bad_key.stderr.strip().count("\n") == 0 and "Traceback" not in bad_key.stderr
    assert "training.loop.max_train_stepz: unknown key" in bad_key.stderr
    cfg["method"]["_target_"] = "distillery.cli.launch.os.system"
    outside = _cli("train", "--config", str(write_config(tmp_path / "bad.yaml", cfg)), cwd=tmp_path)
    assert outside.returncode == 2 and outside.stderr.strip().count("\n") == 0
    assert "defined in posix" in outside.stderr or "defined in os" in outside.stderr
    (tmp_path / "broken.yaml").write_text("models: [unclosed\n")
    broken = _cli("train", "--config", str(tmp_path / "broken.yaml"), cwd=tmp_path)
    assert broken.returncode == 2 and "invalid YAML (line" in broken.stderr and broken.stderr.strip().count("\n") == 0
    missing = _cli("train", "--config", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert missing.returncode == 2 and "file not found" in missing.stderr


@pytest.mark.process
def test_dry_run_prints_resolved_config_and_trains_nothing(tmp_path, tiny_base, latent_set):
    path = write_config(tmp_path / "run.yaml", run_config(tiny_base, latent_set, tmp_path / "run"))
    out = _cli("train", "--config", str(path), "--dry-run", "--training.optimizer.warmup_steps", "0", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["training"]["optimizer"]["warmup_steps"] == 0
    assert resolved["training"]["distributed"]["backend"] == "auto"  # defaults are filled in
    assert resolved["models"]["student"]["_target_"] == "distillery.models.wan.WanModel"
    assert not (tmp_path / "run").exists()
    assert not (tmp_path / "mlflow.db").exists()


# -- input bounds (distillery.config.limits): what a user can get wrong ends in one line ---------
def _yaml_error(text: str) -> str:
    from distillery.config.limits import parse_yaml_text

    with pytest.raises(UserError) as info:
        parse_yaml_text(text, "config error: run.yaml")
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    return message


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a: &a [1,1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
         "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\n",
         "run.yaml: e[0] (line 5): more than 20000 values in one file (aliases count in full)"),
        ("a: &x [1, *x]\nb: 1\n", "run.yaml: a[1] (line 1): alias *x refers to a value that contains it"),
        ("training:\n  loop:\n    seed: 1\n    seed: 2\n", "run.yaml: training.loop.seed (line 4): duplicate key (first at line 3)"),
        ("training:\n  " + "k" * 300 + ": 1\n", "run.yaml: training (line 2): a key of 300 characters; at most 256"),
        ("a: " + "9" * 70 + "\n", "run.yaml: a: an integer of 70 digits; at most 64"),
        ("a: 0x" + "f" * 70 + "\n", "run.yaml: a: an integer of 72 digits; at most 64"),
        ("a:\n  b: " + "s" * 5000 + "\n", "run.yaml: a.b (line 2): a string of 5000 characters; at most 4096"),
        ("a: 2024-13-45\n", "run.yaml: invalid value: month must be in 1..12"),
        ("a: \x07\n", "run.yaml: invalid YAML (line 1): unacceptable character #x0007"),
        ("a:\n" + "".join(" " * (i + 1) + f"k{i}:\n" for i in range(40)), "nested deeper than 32 levels"),
    ],
    ids=["alias-bomb", "recursive-alias", "duplicate-key", "long-key", "long-int", "long-hex", "long-string", "bad-date",
         "control-char", "deep-block"],
)
def test_yaml_bounds_are_one_line_errors(text, expected):
    assert expected in _yaml_error(text)


def test_yaml_within_bounds_loads_as_before():
    from distillery.config.limits import parse_yaml_text

    text = "base: &b {x: 1, y: [1, 2]}\nc:\n  <<: *b\n  y: 3\nn: 1.0e-4\nq: '1'\nk: 1\nbig: " + "9" * 64 + "\n"
    assert parse_yaml_text(text, "x") == yaml.safe_load(text)
    assert parse_yaml_text("{a: [1", "x", syntax_error_as_text=True) == "{a: [1"  # an override that is not YAML is text


def test_show_cuts_every_echoed_value():
    from distillery.config.limits import show

    assert show("a" * 300) == "'" + "a" * 45 + "'… (300 characters)"
    assert show("two\nlines") == "'two\\nlines'"
    assert show(list(range(1000))) == "[0, 1, 2, 3, 4, 5, ...]"
    assert show(10**5000) == "<an integer of about 5001 digits>"
    assert show(None) == "null" and show(True) == "true"
    assert len(show({"k" * 500: ["v" * 500] * 500})) < 100


def test_config_file_bounds(tmp_path):
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as fh:
        fh.write(b'models: "')
        fh.truncate(200 * 2**20)  # sparse: refused on its size, never read
    with pytest.raises(UserError, match=r"huge.yaml: 209715200 bytes; a config file is at most 1048576 bytes"):
        load_run_config(huge)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"models:\n  student: caf\xe9\n")
    with pytest.raises(UserError, match=r"latin1.yaml: not UTF-8 text: invalid byte 0xe9 at byte offset 22 \(line 2\)"):
        load_run_config(latin1)
    with pytest.raises(UserError, match=r"config error: '/[^']*'… \(\d+ characters\): cannot read: File name too long$"):
        load_run_config(tmp_path / ("x" * 300 + ".yaml"))


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda r: r["models"]["student"].update(init_from="b" * 300),
         "models.student.init_from: '" + "b" * 45 + "'… (300 characters): a path component of 300 bytes"),
        (lambda r: r["models"]["student"].update(init_from="/" + "/".join(["d" * 200] * 25)), "a path of 5025 bytes; the file system allows at most 4095"),
        (lambda r: r["models"]["student"].update(init_from="a\x00b"), "models.student.init_from: 'a\\x00b': contains a NUL"),
        (lambda r: r["training"]["checkpoint"].update(output_dir="o" * 256), "training.checkpoint.output_dir: "),
        (lambda r: r["training"]["loop"].update(max_train_steps="x" * 4000),
         "training.loop.max_train_steps: expected an integer, got '" + "x" * 45 + "'… (4000 characters)"),
        (lambda r: r["training"]["loop"].update({"bad\nkey": 1}), "training.loop.'bad\\nkey': unknown key"),
        (lambda r: r["method"].update(_target_="distillery." + "m" * 300), "method._target_: expected a dotted path"),
        (lambda r: r["method"].update(_target_=["distillery.methods.sft.SFTMethod"] * 100), "got ['distillery"),
        (lambda r: r["training"]["loop"].update(max_train_stpes=3), "unknown key; valid keys: max_train_steps"),
    ],
    ids=["long-component", "long-path", "nul-path", "long-output-dir", "long-value", "newline-key", "long-target",
         "list-target", "did-you-mean"],
)
def test_values_are_cut_and_paths_checked(tmp_path, mutate, expected):
    raw = _raw(tmp_path)
    mutate(raw)
    message = _error(raw)
    assert expected in message and len(message) < 400, message


def test_did_you_mean_and_override_bounds(tmp_path):
    assert _error(_raw(tmp_path), ["--training.loop.max_train_stpes", "3"]).endswith("did you mean max_train_steps?")
    assert "--training.loop.seed: an integer of 5000 digits; at most 64" in _error(
        _raw(tmp_path), ["--training.loop.seed", "9" * 5000])
    assert "a value of 20000 characters; at most 16384" in _error(_raw(tmp_path), ["--training.tracker.experiment", "e" * 20000])
    assert "malformed key" in _error(_raw(tmp_path), ["--training.loop.se\ned", "1"])
    assert "nested deeper than 32 levels" in _error(_raw(tmp_path), ["--training.tracker.tags", "{a: " + "[" * 2000 + "]" * 2000 + "}"])
    raw = _raw(tmp_path)
    raw["method"] = ["not", "a", "mapping"]  # an override into a broken section: the section's error, no traceback
    assert "method._target_: expected a dotted path" in _error(raw, ["--method.caption_dropout", "0.1"])


@pytest.mark.process
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_callback_role_that_is_not_a_role_of_the_run_is_one_line_before_anything_loads(tmp_path, tiny_base, latent_set, dry_run):
    """A callback's roles are checked where the method's are (check_roles_early), before any weights load:
    ``--dry-run`` refuses what the run would (an EMA of an SFT run's critic once passed it and then ended
    in a ValueError traceback after loading the student), and the run itself writes nothing."""
    cfg = run_config(tiny_base, latent_set, tmp_path / "run",
                     callbacks={"ema": {"_target_": "distillery.callbacks.ema.EMACallback", "roles": ["student", "critic"]}})
    path = write_config(tmp_path / "run.yaml", cfg)
    out = _cli("train", "--config", str(path), *(["--dry-run"] if dry_run else []), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
    assert "callbacks.ema.roles: 'critic' is not a role of this run; valid: student" in out.stderr
    run = tmp_path / "run"  # the real run checks its output folder first: it may exist, empty
    assert out.stdout == "" and (not run.exists() if dry_run else not any(run.iterdir()))


def test_callback_roles_are_checked_from_the_config_alone(tmp_path, latent_set):
    from distillery.engine.builder import check_roles_early

    raw = {"models": {"student": {"_target_": "distillery.models.wan.WanModel", "init_from": str(tmp_path / "absent")}},
           "method": {"_target_": "distillery.methods.sft.SFTMethod"},
           "callbacks": {"val": {"_target_": "distillery.callbacks.validation.ValidationCallback",
                                 "data_path": str(latent_set), "role": "teacher"}}}
    with pytest.raises(UserError, match=r"callbacks\.val\.role: 'teacher' is not a role of this run; valid: student"):
        check_roles_early(load_run_config(raw=raw, prefixes=PREFIXES))  # the folder does not exist: nothing was loaded
    raw["callbacks"]["val"]["role"] = "student"
    raw["callbacks"]["ema"] = {"_target_": "distillery.callbacks.ema.EMACallback", "roles": ["student"]}
    check_roles_early(load_run_config(raw=raw, prefixes=PREFIXES))


def test_a_section_built_in_python_meets_its_declared_rules():
    """A bound is declared once, on its field: a section made in Python (``dataclasses.replace``, a test) is held
    to it as a read one is, one line naming the key; a role's optimizer override follows the same declarations."""
    import dataclasses

    from distillery.config.schema import DataConfig, LoopConfig, OptimizerConfig, OptimizerOverride
    from distillery.config.typed import FieldError

    with pytest.raises(FieldError, match=r"^config error: training.optimizer.learning_rate: 0.0: must be a finite number > 0$"):
        dataclasses.replace(OptimizerConfig(), learning_rate=0.0)
    with pytest.raises(FieldError, match=r"^config error: training.data.batch_size: 0: must be ≥ 1$"):
        DataConfig(batch_size=0)
    with pytest.raises(FieldError, match=r"^config error: training.loop.stop_at_step: -1: must be ≥ 0$"):
        LoopConfig(stop_at_step=-1)
    config, override = ({f.name: f.metadata for f in dataclasses.fields(cls)} for cls in (OptimizerConfig, OptimizerOverride))
    assert {name: meta for name, meta in override.items() if meta} == {name: config[name] for name in override if config[name]}
