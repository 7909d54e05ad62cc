"""docs/profiles: real-Wan2.1 params overrides, printed as ``dvc exp run -S`` arguments and written back by DVC."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distillery.common.errors import UserError
from distillery.pipeline.params.profile import dvc_set_args, load_profile
from distillery.pipeline.params.reader import Params

REPO = Path(__file__).resolve().parents[1]
PROFILES = sorted((REPO / "docs" / "profiles").glob("*.yaml"))


def test_there_are_profiles_for_one_and_eight_gpus_and_a_14b_student_on_8_and_64():
    assert {p.name for p in PROFILES} >= {"wan-1.3b-1gpu.yaml", "wan-1.3b-8gpu.yaml", "wan-14b-720p-8gpu.yaml",
                                          "wan-14b-720p-64gpu.yaml"}


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_dvc_writes_a_profile_back_as_the_stages_read_it(tmp_path, profile):
    """The arguments go through DVC's own ``-S`` machinery (``dvc.utils.hydra.apply_overrides``, what
    ``dvc exp run -S`` runs): the params.yaml DVC writes passes every stage's check, with the profile's
    values — small learning rates included, which DVC writes back as ``2e-06``."""
    from dvc.utils.hydra import apply_overrides

    params = tmp_path / "params.yaml"
    shutil.copy2(REPO / "params.yaml", params)
    overrides = load_profile(profile, params)
    args = dvc_set_args(overrides)
    assert args[::2] == ["-S"] * len(overrides)
    apply_overrides(str(params), args[1::2])
    loaded = Params.load(params)
    for key, value in overrides.items():
        assert loaded.get(key) == value, key


@pytest.mark.process
def test_a_profile_key_that_params_yaml_lacks_or_a_bad_value_is_one_line(tmp_path):
    shutil.copy2(REPO / "params.yaml", tmp_path / "params.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"overrides": {"teacher.stepz": 3}}))
    with pytest.raises(UserError, match="teacher.stepz: not a value of"):
        load_profile(bad, tmp_path / "params.yaml")
    bad.write_text(yaml.safe_dump({"overrides": {"teacher.steps": 0}}))
    with pytest.raises(UserError, match="teacher.steps: 0: must be ≥ 1"):
        load_profile(bad, tmp_path / "params.yaml")
    bad.write_text("overrides: [1, 2]\n")
    with pytest.raises(UserError, match="expected one key, `overrides:`"):
        load_profile(bad, tmp_path / "params.yaml")
    out = subprocess.run([sys.executable, "-m", "distillery.cli.main", "params", "profile", str(bad), "--params",
                          str(tmp_path / "params.yaml")], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def test_a_prompt_with_commas_quotes_and_cjk_reaches_params_yaml_as_written(tmp_path):
    """A negative prompt is no plain Hydra token: it is quoted in its -S argument and DVC writes it back whole."""
    from dvc.utils.hydra import apply_overrides

    params = tmp_path / "params.yaml"
    shutil.copy2(REPO / "params.yaml", params)
    for text in ("色调艳丽，过曝，JPEG压缩残留,it's\\blurry", "a\\'b\\"):
        args = dvc_set_args({"latents.negative_prompt": text, "distill.method": "dmd2"})
        assert args[1].startswith("latents.negative_prompt='") and args[2:] == ["-S", "distill.method=dmd2"]
        apply_overrides(str(params), args[1::2])
        assert Params.load(params).get("latents.negative_prompt") == text
