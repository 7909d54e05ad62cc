"""Trust in the state a run keeps beside its artifacts (issue 22, second pass).

- 9.9: the workspace's hash cache (``runs/.hash_cache.json``) is only a cache: a FIFO, a folder,
  deep JSON or digests that are not strings there are ignored with one warning line and left exactly
  as they are (distillery overwrites only its own files); a wrong digest in it never makes a stage discard a good run folder.
- 9.10: a checkpoint's ``metadata.json`` is covered by its checksums and checked for types: a bad
  one falls back to the previous intact checkpoint with one warning line, as a corrupt shard does.
- 9.11: a run config whose ``training.checkpoint.output_dir`` cannot be a folder (a file,
  ``/dev/null``, ``/proc``) is one line and exit 2 before any model is loaded.

Every run is ``distillery train`` on the tiny Wan in this process (a few steps, seconds each); the
hash cache is exercised through the functions a stage calls (``lineage.hash_tree``, the training
stage's ``prepare_run_dir``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import read_log, role_state, run_config, write_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")

STEPS = 6


def train(cfg: dict, path: Path, *extra: str) -> int:
    """``distillery train --config path [extra]`` in this process; returns the exit code."""
    from distillery.cli.main import main

    write_config(path, cfg)
    return main(["train", "--config", str(path), *extra])


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


# -- 9.9: the hash cache is only a cache ---------------------------------------------------------

@pytest.fixture
def hash_cache(tmp_path, monkeypatch):
    """This process's hash cache at ``tmp_path/runs/.hash_cache.json`` (as the stage runner sets
    it), read afresh as a new stage process would; the process's cache is forgotten afterwards."""
    from distillery.common import hashcache

    path = tmp_path / "runs" / ".hash_cache.json"
    path.parent.mkdir(parents=True)
    monkeypatch.setenv(hashcache.ENV_VAR, str(path))
    monkeypatch.setattr(hashcache, "_ACTIVE", None)
    yield path
    hashcache._ACTIVE = None


def _folder(root: Path) -> Path:
    """A small artifact-like folder of three files."""
    root.mkdir(parents=True)
    for i in range(3):
        (root / f"part-{i}.bin").write_bytes(bytes([i]) * (1000 + i))
    return root


def _true_entries(folder: Path) -> list[dict]:
    from distillery.common.hashcache import read_sha256

    return [{"path": p.name, "sha256": read_sha256(p), "bytes": p.stat().st_size} for p in sorted(folder.iterdir())]


def _cache_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}"


def _bad_cache(kind: str, cache: Path, folder: Path) -> None:
    """Put a cache of ``kind`` at ``cache`` (covering ``folder``'s files where it has entries)."""
    if kind == "folder":
        cache.mkdir()
        (cache / "keep").write_text("someone's file")
    elif kind == "deep JSON":
        cache.write_text("[" * 200_000 + "]" * 200_000)
    elif kind == "deep JSON entry":
        cache.write_text('{"1:2": [1, 2, ' + "[" * 200_000 + "]" * 200_000 + "]}")
    elif kind == "non-string digests":
        entries = {}
        for p, digest in zip(sorted(folder.iterdir()), [{"sha": 1}, None, 12345]):
            st = p.stat()
            entries[_cache_key(p)] = [st.st_size, st.st_mtime_ns, digest]
        cache.write_text(json.dumps(entries))
    elif kind == "a list":
        cache.write_text(json.dumps([[1, 2, "x"]]))
    else:
        raise AssertionError(kind)


@pytest.mark.process
@pytest.mark.reliability(case="9.9", title="hash cache is a FIFO",
                         injected="runs/.hash_cache.json replaced by a named pipe nobody writes to; a process hashes "
                                  "a folder through the cache (what every stage does)",
                         expect="no hang: the digests are read from the bytes, one warning line names the cache; "
                                "the FIFO is left as it is")
def test_hash_cache_fifo_does_not_hang(tmp_path, data_lost):
    from distillery.common import hashcache

    folder = _folder(tmp_path / "artifact")
    cache = tmp_path / "runs" / ".hash_cache.json"
    cache.parent.mkdir()
    os.mkfifo(cache)
    code = ("import json, sys; from pathlib import Path; from distillery.lineage.hashing import hash_tree; "
            "print(json.dumps(hash_tree(Path(sys.argv[1]))))")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, hashcache.ENV_VAR: str(cache)})
    except subprocess.TimeoutExpired:
        pytest.fail("hashing through a FIFO hash cache hangs")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if ".hash_cache.json" in line]
    assert len(warned) == 1 and "not a regular file" in warned[0], proc.stderr[-3000:]
    lost = data_lost.record(sum(a != b for a, b in zip(json.loads(proc.stdout), _true_entries(folder))),
                            "digests differing from the files' bytes")
    assert lost == 0
    assert cache.is_fifo()


@pytest.mark.reliability(case="9.9", title="hash cache is a FIFO (stage runner)",
                         injected="the workspace's runs/.hash_cache.json a named pipe (then a folder) when a stage starts",
                         expect="one warning line; the cache is off for the stage and the trainers it launches "
                                "(DISTILLERY_HASH_CACHE unset); a regular file turns it on again")
def test_stage_runner_turns_a_fifo_cache_off(tmp_path, monkeypatch, warnings_logged, data_lost):
    from distillery.common import hashcache
    from distillery.pipeline.launch import runner

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(hashcache.ENV_VAR, "")  # so that the variable is restored after the test ...
    monkeypatch.delenv(hashcache.ENV_VAR)  # ... as the stage runner finds it: unset
    monkeypatch.setattr(runner, "_CACHE_SET_HERE", None)
    cache = tmp_path / "runs" / ".hash_cache.json"
    cache.parent.mkdir()
    for make in (os.mkfifo, os.mkdir):
        make(cache)
        runner._use_workspace_hash_cache()
        assert hashcache.ENV_VAR not in os.environ
        os.rmdir(cache) if cache.is_dir() else cache.unlink()
    assert len([line for line in warnings_logged if ".hash_cache.json" in line]) == 2, warnings_logged
    runner._use_workspace_hash_cache()  # nothing there: the cache is on (created on first write)
    assert os.environ[hashcache.ENV_VAR] == str(cache.resolve())
    data_lost.record(0, "files lost")


@pytest.mark.reliability(case="9.9", title="hash cache of the wrong shape",
                         injected="runs/.hash_cache.json a folder, 200,000-deep JSON (whole file, one entry), "
                                  "entries whose digest is a dict / null / a number, a JSON list",
                         expect="no traceback: one warning line naming the cache, the digests are read from the bytes; "
                                "the file or folder is left exactly as it is (never rewritten: it may be someone's file)")
@pytest.mark.parametrize("kind", ["folder", "deep JSON", "deep JSON entry", "non-string digests", "a list"])
def test_hash_cache_of_wrong_shape_is_ignored(hash_cache, tmp_path, warnings_logged, data_lost, kind):
    from distillery.common import hashcache
    from distillery.lineage.hashing import hash_tree

    folder = _folder(tmp_path / "artifact")
    _bad_cache(kind, hash_cache, folder)
    before_bytes = None if kind == "folder" else hash_cache.read_bytes()
    entries = hash_tree(folder)  # hashes through the cache and flushes it
    lost = data_lost.record(sum(a != b for a, b in zip(entries, _true_entries(folder))),
                            "digests differing from the files' bytes")
    warned = [line for line in warnings_logged if ".hash_cache.json" in line]
    assert len(warned) == 1, warnings_logged
    if kind == "folder":
        assert hash_cache.is_dir() and (hash_cache / "keep").read_text() == "someone's file"
        lost += data_lost.record(0 if (hash_cache / "keep").is_file() else 1, "files of the folder lost")
    else:  # left exactly as it is (it may be someone's file); the next process reads the bytes again
        lost += data_lost.record(0 if hash_cache.read_bytes() == before_bytes else 1, "files overwritten")
        hashcache._ACTIVE = None
        before = hashcache.STATS.files_cached
        assert hash_tree(folder) == entries
        assert hashcache.STATS.files_cached - before == 0
    assert not list(hash_cache.parent.glob(".*.tmp")), "a temp file of the cache was left behind"
    assert lost == 0


def _stage_workspace(root: Path, latent_set: Path, tiny_base: Path) -> tuple[dict, dict[str, Path]]:
    """A workspace folder (the cwd of a stage) with ``artifacts/latents`` and a run of 2 steps in
    ``runs/teacher`` (checkpoints 1 and 2), prepared by the training stage's own ``prepare_run_dir``.
    Returns the run config and the stage's inputs."""
    from distillery.pipeline.launch.run_folder import prepare_run_dir

    shutil.copytree(latent_set, root / "artifacts" / "latents")
    inputs = {"data": Path("artifacts/latents")}
    raw = run_config(tiny_base, Path("artifacts/latents"), Path("runs/teacher"), steps=2, save_every=1)
    config_path = prepare_run_dir("teacher", raw, inputs)
    assert train(raw, config_path) == 0
    return raw, inputs


def _intact_checkpoints(run: Path) -> int:
    from distillery.components.checkpoint.checksums import verify_checkpoint

    return sum(1 for p in run.glob("checkpoint-*") if verify_checkpoint(p) is None)


@pytest.mark.reliability(case="9.9", title="poisoned digest in the hash cache",
                         injected="a run folder of 2 checkpoints; the hash cache's digest of one input file replaced "
                                  "(size and mtime kept); the training stage prepares its run folder again",
                         expect="the input is re-hashed before anything is discarded: both checkpoints kept, one warning "
                                "line, the cache corrected; an input really changed still restarts from step 0")
def test_poisoned_hash_cache_does_not_discard_a_run(hash_cache, tmp_path, tiny_base, latent_set, monkeypatch,
                                                    warnings_logged, data_lost):
    from distillery.common import hashcache
    from distillery.lineage.hashing import hash_tree
    from distillery.pipeline.launch.resume_key import read_key, resume_key
    from distillery.pipeline.launch.run_folder import prepare_run_dir

    monkeypatch.chdir(tmp_path)
    raw, inputs = _stage_workspace(tmp_path, latent_set, tiny_base)
    run = Path("runs/teacher")
    assert _intact_checkpoints(run) == 2
    true_key = read_key(run)

    victim = sorted((tmp_path / "artifacts" / "latents").rglob("*.parquet"))[0]
    entries = json.loads(hash_cache.read_text())
    assert _cache_key(victim) in entries  # the stage's resume key was hashed through the cache
    entries[_cache_key(victim)][2] = "0" * 64
    hash_cache.write_text(json.dumps(entries))
    hashcache._ACTIVE = None  # the next stage process
    assert resume_key("teacher", raw, inputs) != true_key  # the poison reaches the key
    hashcache._ACTIVE = None

    prepare_run_dir("teacher", raw, inputs)
    lost = data_lost.record(2 - _intact_checkpoints(run), "intact checkpoints discarded")
    assert read_key(run) == true_key
    warned = [line for line in warnings_logged if "hash cache" in line]
    assert len(warned) == 1 and "re-hashed" in warned[0], warnings_logged
    hashcache._ACTIVE = None  # later readers (the trainer, the lineage of the artifact) get the true digest
    lost += data_lost.record(sum(a != b for a, b in zip(hash_tree(inputs["data"]), _true_entries_tree(inputs["data"]))),
                             "digests the corrected cache still gets wrong")
    assert lost == 0

    # a real change of the input still restarts the run
    victim.write_bytes(victim.read_bytes() + b"\0")
    prepare_run_dir("teacher", raw, inputs)
    assert _intact_checkpoints(run) == 0 and read_key(run) != true_key


def _true_entries_tree(folder: Path) -> list[dict]:
    from distillery.common.hashcache import read_sha256

    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return [{"path": p.relative_to(folder).as_posix(), "sha256": read_sha256(p), "bytes": p.stat().st_size} for p in files]


# -- 9.10: a checkpoint's metadata.json ----------------------------------------------------------

def _config(tiny_base: Path, latent_set: Path, out: Path, **loop) -> dict:
    cfg = run_config(tiny_base, latent_set, out, steps=STEPS, save_every=2)
    cfg["training"]["loop"].update(loop)
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_base, latent_set):
    """An uninterrupted 6-step run and one stopped at step 4 (checkpoints 2 and 4) that tests copy."""
    root = tmp_path_factory.mktemp("state-trust")
    assert train(_config(tiny_base, latent_set, root / "reference"), root / "reference.yaml") == 0
    assert train(_config(tiny_base, latent_set, root / "prefix", stop_at_step=4), root / "prefix.yaml") == 0
    final = root / "reference" / f"checkpoint-{STEPS}"
    return {"root": root, "reference": role_state(final), "reference_log": read_log(root / "reference")}


def _reseal(checkpoint: Path) -> None:
    """Record the checkpoint's current files as its checksums (what a crafted folder's author does)."""
    from distillery.components.checkpoint.checksums import write_checksums

    meta = json.loads((checkpoint / "metadata.json").read_text())
    meta["checksums"] = write_checksums(checkpoint)
    (checkpoint / "metadata.json").write_text(json.dumps(meta))


def _edit_metadata(checkpoint: Path, kind: str) -> None:
    path = checkpoint / "metadata.json"
    meta = json.loads(path.read_text())
    if kind == "deep JSON":
        path.write_text('{"step": 4, "world_size": 1, "method": ' + "[" * 200_000 + "]" * 200_000 + "}")
        return
    edits = {"world_size: 'eight'": ("world_size", "eight"), "format: 'x'": ("format", "x"), "roles: 5": ("roles", 5),
             "frozen_roles: a list": ("frozen_roles", ["teacher"])}
    key, value = edits[kind.removesuffix(" (resealed)")]
    meta[key] = value
    path.write_text(json.dumps(meta, indent=2))
    if kind.endswith("(resealed)"):
        _reseal(checkpoint)


METADATA_DAMAGE = ["world_size: 'eight'", "format: 'x'", "roles: 5", "frozen_roles: a list", "deep JSON",
                   "world_size: 'eight' (resealed)", "format: 'x' (resealed)"]


@pytest.mark.reliability(case="9.10", title="metadata.json of wrong types",
                         injected="the newest checkpoint's metadata.json edited: world_size 'eight', format 'x', roles 5, "
                                  "frozen_roles a list, 200,000-deep JSON; and world_size/format with the checksums "
                                  "recomputed to match",
                         expect="one warning line naming checkpoint-4 and metadata.json; resumes from checkpoint-2; "
                                "final weights bitwise equal to an uninterrupted run")
@pytest.mark.parametrize("kind", METADATA_DAMAGE)
def test_bad_metadata_falls_back(runs, tmp_path, tiny_base, latent_set, warnings_logged, capsys, data_lost, kind):
    from distillery.components.checkpoint.checksums import verify_checkpoint

    run = tmp_path / "run"
    shutil.copytree(runs["root"] / "prefix", run)
    _edit_metadata(run / "checkpoint-4", kind)
    assert train(_config(tiny_base, latent_set, run), tmp_path / "run.yaml") == 0
    assert "Traceback" not in capsys.readouterr().err
    lines = [line for line in warnings_logged if "damaged" in line]
    assert len(lines) == 1, warnings_logged
    assert "checkpoint-4" in lines[0] and "(metadata.json:" in lines[0] and "falling back to checkpoint-2" in lines[0], lines[0]
    got = role_state(run / f"checkpoint-{STEPS}")
    lost = data_lost.record(sum(1 for k, v in runs["reference"].items() if not torch.equal(v, got[k])),
                            "weight tensors differing from the uninterrupted run")
    rows = [(r["step"], r["total_loss"]) for r in read_log(run)]
    lost += data_lost.record(sum(a != b for a, b in zip(rows, [(r["step"], r["total_loss"]) for r in runs["reference_log"]]))
                             + abs(len(rows) - len(runs["reference_log"])), "train_log rows lost or differing")
    lost += data_lost.record(0 if verify_checkpoint(run / "checkpoint-2") is None else 1, "intact checkpoints lost")
    assert lost == 0


@pytest.mark.reliability(case="9.10", title="granted checkpoint with metadata.json of wrong types",
                         injected="a granted outside checkpoint whose metadata.json says world_size 'eight', checksums "
                                  "recomputed to match",
                         expect="exit 2, one line naming the checkpoint and metadata.json; nothing trained")
def test_granted_checkpoint_with_bad_metadata_is_refused(runs, tmp_path, tiny_base, latent_set, capsys, data_lost):
    foreign = tmp_path / "foreign" / "checkpoint-4"
    shutil.copytree(runs["root"] / "prefix" / "checkpoint-4", foreign)
    _edit_metadata(foreign, "world_size: 'eight' (resealed)")
    cfg = _config(tiny_base, latent_set, tmp_path / "run")
    cfg["training"]["checkpoint"]["resume"] = str(foreign)
    assert train(cfg, tmp_path / "run.yaml", "--allow-checkpoint", str(foreign)) == 2
    line = _one_error_line(capsys)
    assert str(foreign) in line and "metadata.json" in line and "world_size" in line, line
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    data_lost.record(0, "files of the run folder written")


def test_metadata_is_covered_by_the_checksums(runs, tmp_path):
    """Any edit of metadata.json outside its checksums record fails verification; a checkpoint
    saved now verifies."""
    from distillery.components.checkpoint.checksums import verify_checkpoint

    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(runs["root"] / "prefix" / "checkpoint-4", ckpt)
    assert verify_checkpoint(ckpt) is None
    meta = json.loads((ckpt / "metadata.json").read_text())
    (ckpt / "metadata.json").write_text(json.dumps({**meta, "mlflow_run_id": "someone-else"}))
    damage = verify_checkpoint(ckpt)
    assert damage is not None and damage.file == "metadata.json", damage


# -- 9.11: an output folder that cannot be one ---------------------------------------------------

@pytest.mark.reliability(case="9.11", title="output_dir that cannot be a folder",
                         injected="training.checkpoint.output_dir = an existing file, a path under that file, /dev/null, "
                                  "/proc",
                         expect="exit 2, one line naming training.checkpoint.output_dir and the path, before any model "
                                "is loaded; the file is left as it was")
@pytest.mark.parametrize("where", ["a file", "under a file", "/dev/null", "/proc"])
def test_unusable_output_dir_is_one_line(tmp_path, tiny_base, latent_set, capsys, monkeypatch, data_lost, where):
    from distillery.models import wan

    existing = tmp_path / "notes.txt"
    existing.write_text("my notes")
    out = {"a file": existing, "under a file": existing / "run", "/dev/null": Path("/dev/null"), "/proc": Path("/proc")}[where]
    loaded: list[str] = []
    real = wan.WanModel.__init__

    def recording_init(self, *args, **kwargs):  # counts models built: none may be, for a plain mistake
        loaded.append("model")
        real(self, *args, **kwargs)

    monkeypatch.setattr(wan.WanModel, "__init__", recording_init)
    code = train(run_config(tiny_base, latent_set, out, steps=2), tmp_path / "run.yaml")
    line = _one_error_line(capsys)
    assert code == 2
    assert "training.checkpoint.output_dir" in line and str(out) in line, line
    assert loaded == [], "a model was loaded before the output folder was checked"
    lost = data_lost.record(0 if existing.read_text() == "my notes" else 1, "files changed")
    assert lost == 0
