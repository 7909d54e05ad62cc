"""Checkpoints never execute code (8.4) and carry checksums; a damaged newest checkpoint falls back
to the newest intact one (8.7).

Every run is ``distillery train`` on the tiny Wan (in this process through ``distillery.cli.main``,
or as a real subprocess where the exit code and stderr of a whole process matter). A module
fixture trains the uninterrupted reference (6 steps, checkpoints at 2, 4, 6) and a run stopped at
step 4 (checkpoints 2 and 4) that each test copies and damages.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import read_log, role_state, run_config, write_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")

STEPS = 6
CALLBACKS = {
    "grad_clip": {"_target_": "distillery.callbacks.grad_clip.GradClipCallback", "max_grad_norm": 1.0},
    "ema": {"_target_": "distillery.callbacks.ema.EMACallback", "decay": 0.9},
}


def _config(tiny_base: Path, latent_set: Path, out: Path, **loop) -> dict:
    cfg = run_config(tiny_base, latent_set, out, steps=STEPS, save_every=2, callbacks=CALLBACKS)
    cfg["training"]["optimizer"].update(lr_scheduler="cosine", warmup_steps=2)
    cfg["training"]["loop"].update(loop)
    return cfg


def train(cfg: dict, path: Path, *extra: str) -> int:
    """``distillery train --config path [extra]`` in this process; returns the exit code."""
    from distillery.cli.main import main

    write_config(path, cfg)
    return main(["train", "--config", str(path), *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_base, latent_set):
    root = tmp_path_factory.mktemp("trust")
    assert train(_config(tiny_base, latent_set, root / "reference"), root / "reference.yaml") == 0
    assert train(_config(tiny_base, latent_set, root / "prefix", stop_at_step=4), root / "prefix.yaml") == 0
    assert sorted(p.name for p in (root / "prefix").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    final = root / "reference" / f"checkpoint-{STEPS}"
    return {"root": root, "reference": {ema: role_state(final, ema=ema) for ema in (None, "ema")},
            "reference_log": read_log(root / "reference")}


@pytest.fixture(autouse=True)
def no_grants_left():
    """Grants given on a command line in this process do not outlive the test."""
    yield
    from distillery.components.checkpoint.trust import grant_checkpoints

    grant_checkpoints(())


def copy_prefix(runs: dict, dst: Path) -> Path:
    shutil.copytree(runs["root"] / "prefix", dst)
    return dst


def differing_tensors(runs: dict, checkpoint: Path) -> int:
    """Weight tensors (raw and EMA) of ``checkpoint`` not bitwise equal to the uninterrupted run's."""
    n = 0
    for ema, ref in runs["reference"].items():
        got = role_state(checkpoint, ema=ema)
        n += sum(1 for k in ref if k not in got or not torch.equal(ref[k], got[k]))
    return n


def differing_log_rows(runs: dict, run: Path) -> int:
    ref = [(r["step"], r["total_loss"]) for r in runs["reference_log"]]
    got = [(r["step"], r["total_loss"]) for r in read_log(run)]
    return sum(1 for a, b in zip(ref, got) if a != b) + abs(len(ref) - len(got))


class Exploit:
    """Pickles to a call of ``exec`` that writes ``marker``: what a crafted checkpoint file holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code from a checkpoint ran')",)


def crafted_pickle(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when loaded; checked to really do so on a twin marker."""
    twin = marker.with_name(marker.name + ".proof")
    pickle.loads(pickle.dumps(Exploit(twin)))
    assert twin.is_file(), "the crafted pickle does not execute: the test would prove nothing"
    twin.unlink()
    return pickle.dumps(Exploit(marker))


def reseal(checkpoint: Path) -> None:
    """Record the checkpoint's current files as its checksums (what the author of a crafted folder does)."""
    from distillery.components.checkpoint.checksums import write_checksums

    meta = json.loads((checkpoint / "metadata.json").read_text())
    meta["checksums"] = write_checksums(checkpoint)
    (checkpoint / "metadata.json").write_text(json.dumps(meta))


def largest_weight_item(checkpoint: Path) -> tuple[str, int, int]:
    """(file, offset, length) of the student's largest weight tensor inside the DCP shards."""
    from distillery.components.checkpoint.dcp_io import read_dcp_metadata

    md = read_dcp_metadata(checkpoint / "dcp")
    items = [(info.length, key.fqn, info) for key, info in md.storage_data.items() if key.fqn.startswith("roles.student.transformer.")]
    length, _, info = max(items, key=lambda t: t[0])
    return info.relative_path, info.offset, info.length


def flip_weight_byte(checkpoint: Path) -> str:
    """Flip one byte in the middle of the student's largest weight tensor; returns the shard's name."""
    name, offset, length = largest_weight_item(checkpoint)
    path = checkpoint / "dcp" / name
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return f"dcp/{name}"


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# -- 8.7: damaged newest checkpoint → fall back ------------------------------------------------

def _resume_after_damage(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost, damage) -> list[str]:
    """Copy the stopped run, damage its checkpoint-4 with ``damage``, rerun to the end; check the
    result equals the uninterrupted run; return the warning lines about damaged checkpoints."""
    run = copy_prefix(runs, tmp_path / "run")
    expected_file = damage(run / "checkpoint-4")
    assert train(_config(tiny_base, latent_set, run), tmp_path / "run.yaml") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in warnings_logged if "damaged" in line]
    assert len(lines) == 1, warnings_logged
    assert "checkpoint-4" in lines[0] and f"({expected_file}:" in lines[0] and "falling back to checkpoint-2" in lines[0], lines[0]
    from distillery.components.checkpoint.checksums import verify_checkpoint

    lost = data_lost.record(0 if verify_checkpoint(run / "checkpoint-2") is None else 1, "intact checkpoints lost")
    lost += data_lost.record(differing_tensors(runs, run / f"checkpoint-{STEPS}"),
                             "weight tensors (raw + EMA) differing from the uninterrupted run")
    lost += data_lost.record(differing_log_rows(runs, run), "train_log rows lost or differing")
    assert lost == 0
    assert verify_checkpoint(run / "checkpoint-4") is None  # redone and saved again, intact
    return lines


@pytest.mark.reliability(case="8.7", title="truncated DCP shard",
                         injected="newest checkpoint's dcp/__0_0.distcp cut to half its size, then the run is rerun",
                         expect="one warning line naming checkpoint-4 and the shard; resumes from checkpoint-2; "
                                "final weights bitwise equal to an uninterrupted run")
def test_truncated_shard_falls_back(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost):
    def damage(ckpt: Path) -> str:
        truncate(ckpt / "dcp" / "__0_0.distcp")
        return "dcp/__0_0.distcp"

    _resume_after_damage(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost, damage)


@pytest.mark.reliability(case="8.7", title="truncated DCP .metadata",
                         injected="newest checkpoint's dcp/.metadata cut to half its size, then the run is rerun",
                         expect="one warning line naming checkpoint-4 and dcp/.metadata; resumes from checkpoint-2; "
                                "final weights bitwise equal to an uninterrupted run")
def test_truncated_dcp_metadata_falls_back(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost):
    def damage(ckpt: Path) -> str:
        truncate(ckpt / "dcp" / ".metadata")
        return "dcp/.metadata"

    _resume_after_damage(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost, damage)


@pytest.mark.reliability(case="8.7", title="invalid metadata.json",
                         injected="newest checkpoint's metadata.json overwritten with text that is not JSON",
                         expect="one warning line naming checkpoint-4 and metadata.json; resumes from checkpoint-2; "
                                "final weights bitwise equal to an uninterrupted run")
def test_invalid_metadata_json_falls_back(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost):
    def damage(ckpt: Path) -> str:
        (ckpt / "metadata.json").write_text('{"step": 4, "world_size"')
        return "metadata.json"

    _resume_after_damage(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost, damage)


@pytest.mark.reliability(case="8.7", title="flipped byte in a weight shard",
                         injected="one bit flipped inside the student's largest weight tensor in the newest checkpoint "
                                  "(same file size)",
                         expect="sha256 mismatch: one warning line naming checkpoint-4 and the shard; resumes from "
                                "checkpoint-2; final weights bitwise equal to an uninterrupted run")
def test_flipped_weight_byte_falls_back(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost):
    def damage(ckpt: Path) -> str:
        before = role_state(ckpt)
        name = flip_weight_byte(ckpt)
        after = role_state(ckpt)  # read without verification: the flip really lands in a weight
        assert sum(not torch.equal(before[k], after[k]) for k in before) == 1
        return name

    _resume_after_damage(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost, damage)


@pytest.mark.reliability(case="8.7", title="no intact checkpoint left",
                         injected="both checkpoints of the stopped run damaged (metadata.json deleted from checkpoint-4, "
                                  "a byte flipped in checkpoint-2's shard)",
                         expect="one warning line per damaged checkpoint, saying it starts from step 0; the run "
                                "retrains and ends bitwise equal to an uninterrupted run")
def test_no_intact_checkpoint_starts_from_step_0(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost):
    run = copy_prefix(runs, tmp_path / "run")
    (run / "checkpoint-4" / "metadata.json").unlink()
    flip_weight_byte(run / "checkpoint-2")
    assert train(_config(tiny_base, latent_set, run), tmp_path / "run.yaml") == 0
    assert "Traceback" not in capsys.readouterr().err
    lines = [line for line in warnings_logged if "damaged" in line]
    assert len(lines) == 2, warnings_logged
    assert "checkpoint-4 is damaged (metadata.json: missing)" in lines[0] and "starting from step 0" in lines[0]
    assert "checkpoint-2 is damaged (dcp/__0_0.distcp: sha256" in lines[1] and "starting from step 0" in lines[1]
    lost = data_lost.record(differing_tensors(runs, run / f"checkpoint-{STEPS}"),
                            "weight tensors (raw + EMA) differing from the uninterrupted run")
    lost += data_lost.record(differing_log_rows(runs, run), "train_log rows lost or differing")
    assert lost == 0


@pytest.mark.reliability(case="8.7", title="export of a damaged checkpoint",
                         injected="distillery export-weights on a checkpoint with one flipped weight byte",
                         expect="exit 2, one line naming the checkpoint and the shard; no export folder written")
def test_export_verifies_checksums(runs, tmp_path, capsys, data_lost):
    from distillery.cli.main import main

    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(runs["root"] / "prefix" / "checkpoint-4", ckpt)
    assert main(["export-weights", str(ckpt), "--role", "student", "--out", str(tmp_path / "export")]) == 0
    shutil.rmtree(tmp_path / "export")
    name = flip_weight_byte(ckpt)
    code = main(["export-weights", str(ckpt), "--role", "student", "--out", str(tmp_path / "export")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and str(ckpt) in err[0] and f"{name}: sha256" in err[0], err[0]
    assert not (tmp_path / "export").exists()
    data_lost.record(0, "files written from the damaged checkpoint")


# -- 8.4: nothing read from a checkpoint executes code -----------------------------------------

def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def _granted_foreign_copy(runs, tmp_path: Path) -> Path:
    foreign = tmp_path / "foreign" / "checkpoint-4"
    shutil.copytree(runs["root"] / "prefix" / "checkpoint-4", foreign)
    return foreign


@pytest.mark.reliability(case="8.4", title="crafted pickle as DCP .metadata (own run)",
                         injected="newest checkpoint's dcp/.metadata replaced by a pickle whose __reduce__ runs exec "
                                  "(writes a marker file); checksums not updated",
                         expect="never unpickled: checksum mismatch, one warning line, resume from checkpoint-2, "
                                "final weights bitwise equal; marker never created")
def test_crafted_metadata_in_own_run_is_never_unpickled(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys,
                                                        data_lost):
    marker = tmp_path / "marker"

    def damage(ckpt: Path) -> str:
        (ckpt / "dcp" / ".metadata").write_bytes(crafted_pickle(marker))
        return "dcp/.metadata"

    try:
        _resume_after_damage(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost, damage)
    finally:
        assert not marker.exists(), "code from the checkpoint ran"


@pytest.mark.reliability(case="8.4", title="crafted pickle as DCP .metadata (granted folder)",
                         injected="a granted outside checkpoint whose dcp/.metadata is a pickle running exec, with "
                                  "checksums recomputed to match",
                         expect="exit 2, one line naming the checkpoint and the refused global builtins.exec; "
                                "marker never created")
def test_crafted_metadata_in_granted_checkpoint_is_refused(runs, tmp_path, tiny_base, latent_set, capsys, data_lost):
    marker = tmp_path / "marker"
    foreign = _granted_foreign_copy(runs, tmp_path)
    (foreign / "dcp" / ".metadata").write_bytes(crafted_pickle(marker))
    reseal(foreign)
    cfg = _config(tiny_base, latent_set, tmp_path / "run")
    cfg["training"]["checkpoint"]["resume"] = str(foreign)
    try:
        code = train(cfg, tmp_path / "run.yaml", "--allow-checkpoint", str(foreign))
    finally:
        assert not marker.exists(), "code from the checkpoint ran"
    assert code == 2
    line = _one_error_line(capsys)
    assert str(foreign) in line and "dcp/.metadata" in line and "builtins.exec" in line, line
    data_lost.record(0, "files of the run folder written")
    assert not list((tmp_path / "run").glob("checkpoint-*"))


@pytest.mark.reliability(case="8.4", title="crafted pickle inside a DCP shard",
                         injected="a granted outside checkpoint re-saved by DCP with the LR schedule's last_lr tensor replaced "
                                  "by an object whose __reduce__ runs exec; checksums recomputed",
                         expect="exit 2, one line naming the checkpoint and the refused item; marker never created "
                                "(stock torch DCP loading runs it)")
def test_crafted_shard_item_in_granted_checkpoint_is_refused(runs, tmp_path, tiny_base, latent_set, capsys, data_lost):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    def craft(folder: Path, marker: Path) -> None:
        shutil.copytree(runs["root"] / "prefix" / "checkpoint-4", folder)
        state = _load_state_dict_from_keys(checkpoint_id=str(folder / "dcp"))  # our own intact checkpoint
        state["schedulers.student"]["last_lr"] = Exploit(marker)
        shutil.rmtree(folder / "dcp")
        dcp.save(state, checkpoint_id=str(folder / "dcp"), no_dist=True)
        reseal(folder)

    proof = tmp_path / "proof"  # the same crafting, loaded by stock DCP: the exploit is real
    craft(tmp_path / "proof-ckpt" / "checkpoint-4", proof)
    _load_state_dict_from_keys(checkpoint_id=str(tmp_path / "proof-ckpt" / "checkpoint-4" / "dcp"))
    assert proof.is_file(), "stock DCP did not run the crafted item: the test would prove nothing"

    marker = tmp_path / "marker"
    foreign = tmp_path / "foreign" / "checkpoint-4"
    craft(foreign, marker)
    cfg = _config(tiny_base, latent_set, tmp_path / "run")
    cfg["training"]["checkpoint"]["resume"] = str(foreign)
    try:
        code = train(cfg, tmp_path / "run.yaml", "--allow-checkpoint", str(foreign))
    finally:
        assert not marker.exists(), "code from the checkpoint ran"
    assert code == 2
    line = _one_error_line(capsys)
    assert str(foreign) in line and "schedulers.student.last_lr" in line and "builtins.exec" in line, line
    data_lost.record(0, "files of the run folder written")


@pytest.mark.reliability(case="8.4", title="old pickled host/RNG state",
                         injected="newest checkpoint turned into the old format: a state.pt (then an rng/rank-0.pt) "
                                  "holding a pickle that runs exec",
                         expect="exit 2, one line: old pickled format, delete the run folder and retrain; nothing "
                                "unpickled, marker never created")
@pytest.mark.parametrize("pickled", ["state.pt", "rng/rank-0.pt"])
def test_old_pickled_state_is_refused(runs, tmp_path, tiny_base, latent_set, capsys, data_lost, pickled):
    marker = tmp_path / "marker"
    run = copy_prefix(runs, tmp_path / "run")
    (run / "checkpoint-4" / pickled).write_bytes(crafted_pickle(marker))
    try:
        code = train(_config(tiny_base, latent_set, run), tmp_path / "run.yaml")
    finally:
        assert not marker.exists(), "code from the checkpoint ran"
    assert code == 2
    line = _one_error_line(capsys)
    assert "checkpoint-4" in line and "old pickled format" in line and f"delete {run}" in line, line
    lost = data_lost.record(2 - sum(1 for _ in run.glob("checkpoint-*")), "checkpoints of the run lost")
    assert lost == 0


@pytest.mark.process
@pytest.mark.reliability(case="8.4", title="resume from an ungranted outside folder",
                         injected="training.checkpoint.resume names an intact checkpoint outside the run's output "
                                  "folder, no --allow-checkpoint (a real `distillery train` process)",
                         expect="exit 2, one line naming the path and --allow-checkpoint; granted by "
                                "--allow-checkpoint or DISTILLERY_ALLOWED_CHECKPOINTS it resumes, bitwise equal")
def test_outside_checkpoint_needs_a_grant(runs, tmp_path, tiny_base, latent_set, capsys, monkeypatch, data_lost):
    foreign = _granted_foreign_copy(runs, tmp_path)
    cfg = _config(tiny_base, latent_set, tmp_path / "run")
    cfg["training"]["checkpoint"]["resume"] = str(foreign)
    write_config(tmp_path / "run.yaml", cfg)
    env = {k: v for k, v in os.environ.items() if k != "DISTILLERY_ALLOWED_CHECKPOINTS"}
    proc = subprocess.run([sys.executable, "-m", "distillery.cli.main", "train", "--config", str(tmp_path / "run.yaml")],
                          capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert str(foreign) in errors[0] and "outside this run's output folder" in errors[0] and "--allow-checkpoint" in errors[0]
    assert not list((tmp_path / "run").glob("checkpoint-*"))

    assert train(cfg, tmp_path / "run.yaml", "--allow-checkpoint", str(foreign.parent)) == 0  # a folder grants what it holds
    lost = data_lost.record(differing_tensors(runs, tmp_path / "run" / f"checkpoint-{STEPS}"),
                            "weight tensors differing from the uninterrupted run (granted on the command line)")
    shutil.rmtree(tmp_path / "run")
    monkeypatch.setenv("DISTILLERY_ALLOWED_CHECKPOINTS", f"/nonexistent{os.pathsep}{foreign}")
    assert train(cfg, tmp_path / "run.yaml") == 0
    lost += data_lost.record(differing_tensors(runs, tmp_path / "run" / f"checkpoint-{STEPS}"),
                             "weight tensors differing (granted in the environment)")
    assert lost == 0


@pytest.mark.reliability(case="8.4", title="granted checkpoint that does not verify",
                         injected="a granted outside checkpoint without recorded checksums, then one with a flipped "
                                  "weight byte",
                         expect="exit 2, one line each (no checksums / sha256 mismatch), no fallback, nothing trained")
def test_granted_checkpoint_must_verify(runs, tmp_path, tiny_base, latent_set, capsys, data_lost):
    foreign = _granted_foreign_copy(runs, tmp_path)
    meta = json.loads((foreign / "metadata.json").read_text())
    (foreign / "metadata.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "checksums"}))
    cfg = _config(tiny_base, latent_set, tmp_path / "run")
    cfg["training"]["checkpoint"]["resume"] = str(foreign)
    assert train(cfg, tmp_path / "run.yaml", "--allow-checkpoint", str(foreign)) == 2
    line = _one_error_line(capsys)
    assert str(foreign) in line and "records no checksums" in line, line
    (foreign / "metadata.json").write_text(json.dumps(meta))
    name = flip_weight_byte(foreign)
    assert train(cfg, tmp_path / "run.yaml", "--allow-checkpoint", str(foreign)) == 2
    line = _one_error_line(capsys)
    assert str(foreign) in line and f"{name}: sha256" in line, line
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    data_lost.record(0, "files of the run folder written")
