"""distillery deletes or overwrites only files it created, never through a symbolic link (issue 46, A–D and 2, 5).

- 10.A: a lock file (``runs/.locks/<stage>.lock``, ``runs/<stage>/.lock``) that is a symbolic link: the file it
  points at was truncated and given the stage's pid; now one line, exit 2, the target untouched. The same
  lock as a folder or a FIFO: one line instead of a traceback (10.5).
- 10.B: ``runs/<stage>`` a link to a folder of the user's: after a config change every file there was deleted;
  now one line, exit 2. A real run folder holding a file of the user's keeps it when the run restarts.
- 10.C: ``DISTILLERY_HASH_CACHE`` naming an existing file that is not a cache (``params.yaml``) overwrote it.
- 10.D: ``keep_last`` pruned the run's own checkpoints when ``output_dir`` held a higher-numbered
  ``checkpoint-N`` it did not write; ``preprocess`` deleted shard-named files it never wrote.
- 10.2: symbolic links where the pipeline keeps its folders (``artifacts/<stage>``, ``artifacts/<stage>.tmp``,
  ``runs/<stage>``, ``runs/.locks``): one line, exit 2, neither link nor target touched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import run_config, train_in_process
from workspace import error_lines, stage, tree_sha


def _user_folder(root: Path) -> Path:
    """A folder of the user's, outside the workspace, with two files."""
    folder = root / "users-folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "thesis.txt").write_text("years of work\n")
    (folder / "sub" / "data.bin").write_bytes(os.urandom(4096))
    return folder


def _one_line(out) -> str:
    errors = error_lines(out.stderr)
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return errors[0]


@pytest.mark.process
@pytest.mark.reliability(case="10.A", title="a lock file that is a symbolic link",
                         injected="runs/.locks/teacher.lock, then runs/teacher/.lock, a symlink to a file of the user's "
                                  "outside the workspace; `distillery stage teacher`",
                         expect="exit 2, one line naming the link and that nothing is written through it; the user's "
                                "file byte-identical")
@pytest.mark.parametrize("where", ["runs/.locks/teacher.lock", "runs/teacher/.lock"])
def test_symlinked_lock_file_is_never_written(ws, tmp_path, data_lost, where):
    victim = tmp_path / "precious.txt"
    victim.write_text("do not truncate me\n")
    link = ws / where
    link.parent.mkdir(parents=True, exist_ok=True)
    if where.startswith("runs/teacher/"):  # a run folder as a previous run left it
        (link.parent / "train_log.jsonl").write_text("")
    link.symlink_to(victim)
    line = _one_line(stage(ws, "teacher"))
    assert "symbolic link" in line and where.split("/")[-1] in line, line
    data_lost.record(0 if victim.read_text() == "do not truncate me\n" else 1, "files outside the workspace overwritten")
    assert link.is_symlink()


@pytest.mark.process
@pytest.mark.reliability(case="10.5", title="the stage lock as a folder or a FIFO",
                         injected="runs/.locks/clips.lock made a folder (with a file in it), then a FIFO; `distillery stage clips`",
                         expect="exit 2, one line saying what it is (no IsADirectoryError / EINVAL traceback, no hang); "
                                "the folder's file kept")
@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_lock_that_is_not_a_file_is_one_line(ws, data_lost, kind):
    lock = ws / "runs" / ".locks" / "clips.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.unlink(missing_ok=True)  # the lock file an earlier run left
    if kind == "folder":
        lock.mkdir()
        (lock / "keep").write_text("x")
    else:
        os.mkfifo(lock)
    line = _one_line(stage(ws, "clips"))
    assert ("a folder" if kind == "folder" else "a named pipe") in line, line
    data_lost.record(0 if kind == "fifo" or (lock / "keep").read_text() == "x" else 1, "files lost")


@pytest.mark.process
@pytest.mark.reliability(case="10.B", title="runs/<stage> a symbolic link to the user's folder",
                         injected="runs/teacher a symlink to a folder of the user's (files and a subfolder) outside the "
                                  "workspace, after a config change; `distillery stage teacher`",
                         expect="exit 2, one line naming runs/teacher as a link; every file of the folder kept")
def test_symlinked_run_folder_is_not_wiped(ws, tmp_path, data_lost):
    folder = _user_folder(tmp_path)
    before = tree_sha(folder)
    (ws / "runs").mkdir(exist_ok=True)
    (ws / "runs" / "teacher").symlink_to(folder, target_is_directory=True)
    line = _one_line(stage(ws, "teacher"))
    assert "runs/teacher" in line and "symbolic link" in line, line
    data_lost.record(0 if tree_sha(folder) == before else 1, "folders of the user's changed")


@pytest.mark.reliability(case="10.B", title="a run folder holding files of the user's, restarted",
                         injected="a 2-step teacher run in runs/teacher plus notes.txt, a subfolder and a symlink of the "
                                  "user's in it; the run config changes (the stage discards the old run)",
                         expect="the run's checkpoints, log and key are deleted; the user's three entries are kept, "
                                "named in one warning line")
def test_restarted_run_keeps_what_it_did_not_write(tmp_path, tiny_base, latent_set, monkeypatch, warnings_logged,
                                                   data_lost):
    from distillery.pipeline.launch.run_folder import prepare_run_dir

    monkeypatch.chdir(tmp_path)
    shutil.copytree(latent_set, tmp_path / "artifacts" / "latents")
    inputs = {"data": Path("artifacts/latents")}
    raw = run_config(tiny_base, Path("artifacts/latents"), Path("runs/teacher"), steps=2, save_every=1)
    prepare_run_dir("teacher", raw, inputs)
    train_in_process(raw)
    run = tmp_path / "runs" / "teacher"
    (run / "notes.txt").write_text("mine\n")
    (run / "mine").mkdir()
    (run / "mine" / "a.txt").write_text("a\n")
    (run / "link").symlink_to(tmp_path / "artifacts")
    assert (run / "checkpoint-2").is_dir()
    raw["training"]["loop"]["seed"] = 1234  # another config: the old run is discarded
    prepare_run_dir("teacher", raw, inputs)
    assert not (run / "checkpoint-1").exists() and not (run / "checkpoint-2").exists()
    assert not (run / "train_log.jsonl").exists()
    kept = [(run / "notes.txt").read_text() == "mine\n", (run / "mine" / "a.txt").is_file(), (run / "link").is_symlink(),
            (tmp_path / "artifacts" / "latents").is_dir()]
    data_lost.record(kept.count(False), "entries of the user's deleted")
    warned = [line for line in warnings_logged if "did not write" in line]
    assert len(warned) == 1 and "notes.txt" in warned[0], warnings_logged
    assert all(kept)


@pytest.mark.reliability(case="10.C", title="DISTILLERY_HASH_CACHE naming a file that is not a cache",
                         injected="DISTILLERY_HASH_CACHE=params.yaml (a YAML file), then a symlink to a file of the user's; "
                                  "a stage's hashing and flush",
                         expect="one warning line 'left as it is'; the file byte-identical; digests read from the bytes")
@pytest.mark.parametrize("kind", ["params.yaml", "symlink"])
def test_hash_cache_never_overwrites_a_file_it_did_not_write(tmp_path, monkeypatch, warnings_logged, data_lost, kind):
    from distillery.common import hashcache
    from distillery.lineage.hashing import hash_tree

    params = tmp_path / "params.yaml"
    params.write_text("teacher:\n  learning_rate: 1e-4\n")
    victim = tmp_path / "someone.json"
    victim.write_text("{}")  # even a file of the cache's shape is not written through a link
    named = params
    if kind == "symlink":
        named = tmp_path / "cache-link.json"
        named.symlink_to(victim)
    before = {p: p.read_bytes() for p in (params, victim)}
    monkeypatch.setenv(hashcache.ENV_VAR, str(named))
    monkeypatch.setattr(hashcache, "_ACTIVE", None)
    folder = tmp_path / "artifact"
    folder.mkdir()
    (folder / "w.bin").write_bytes(b"weights")
    hash_tree(folder)
    hashcache.flush_active()
    changed = sum(p.read_bytes() != b for p, b in before.items())
    data_lost.record(changed, "files of the user's overwritten")
    assert changed == 0 and (kind != "symlink" or named.is_symlink())
    assert len([line for line in warnings_logged if "left as it is" in line]) == 1, warnings_logged


@pytest.mark.reliability(case="10.D", title="keep_last beside checkpoints the run did not write",
                         injected="output_dir already holds checkpoint-100 (a complete checkpoint copied from another run); "
                                  "a run of 8 steps saving every 4 with keep_last 1",
                         expect="checkpoint-100 untouched, not resumed (one warning line); the run's checkpoint-8 kept and "
                                "named in its summary; checkpoint-4 pruned")
def test_keep_last_prunes_only_what_the_run_wrote(tmp_path, tiny_base, latent_set, warnings_logged, data_lost):
    other = run_config(tiny_base, latent_set, tmp_path / "other", steps=2, save_every=2)
    train_in_process(other)
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(tmp_path / "other" / "checkpoint-2", out / "checkpoint-100")
    foreign_before = tree_sha(out / "checkpoint-100")
    cfg = run_config(tiny_base, latent_set, out, steps=8, save_every=4)
    cfg["training"]["checkpoint"]["keep_last"] = 1
    result = train_in_process(cfg)
    assert result.final_step == 8
    lost = data_lost.record(0 if (out / "checkpoint-8" / "metadata.json").is_file() else 1, "of the run's own last checkpoint")
    lost += data_lost.record(0 if tree_sha(out / "checkpoint-100") == foreign_before else 1, "foreign checkpoints changed")
    assert not (out / "checkpoint-4").exists()
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["checkpoint"] == "checkpoint-8", summary
    assert json.loads((out / "checkpoints.json").read_text())["written"] == ["checkpoint-8"]
    assert any("checkpoint-100" in line and "left alone" in line for line in warnings_logged), warnings_logged
    assert lost == 0


@pytest.mark.reliability(case="10.D", title="preprocess beside shard-named files it did not write",
                         injected="--out holds mine/shard-00000.parquet, mine/shard-00007.json and train/shard-00009.parquet "
                                  "(the user's) before `preprocess`; then a rerun with fewer clips",
                         expect="the user's three files byte-identical (one warning line); the run's own unplanned shards "
                                "of the first run removed on the rerun")
def test_preprocess_removes_only_shards_it_wrote(tmp_path, tiny_base, warnings_logged, data_lost):
    from distillery.clips.synthetic import ClipSetConfig, make_clip_set
    from distillery.data.preprocess import PreprocessConfig, preprocess

    data = tmp_path / "clips"
    make_clip_set(data, ClipSetConfig(num_train=6, num_validation=2, num_frames=9))
    out = tmp_path / "latents"
    users = {out / "mine" / "shard-00000.parquet": b"PAR1 mine", out / "mine" / "shard-00007.json": b'{"mine": 1}',
             out / "train" / "shard-00009.parquet": b"PAR1 mine too"}
    for path, content in users.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    cfg = PreprocessConfig(num_frames=9, height=32, width=32, fps=8.0, rows_per_shard=2)
    preprocess(tiny_base, data, out, cfg)
    assert (out / "train" / "shard-00002.parquet").is_file()
    # fewer clips: the run's own shard 2 is no longer planned and goes; the user's files stay
    captions = data / "train" / "captions.jsonl"
    lines = captions.read_text().splitlines()
    captions.write_text("\n".join(lines[:4]) + "\n")
    preprocess(tiny_base, data, out, cfg)
    assert not (out / "train" / "shard-00002.parquet").exists() and not (out / "train" / "shard-00002.json").exists()
    changed = sum(not p.is_file() or p.read_bytes() != b for p, b in users.items())
    data_lost.record(changed, "files of the user's deleted or changed")
    assert any("no preprocess run wrote" in line for line in warnings_logged), warnings_logged
    assert changed == 0


@pytest.mark.process
@pytest.mark.reliability(case="10.2", title="a symbolic link where the pipeline keeps its folders",
                         injected="artifacts/clips, artifacts/clips.tmp, runs/.locks, runs/teacher each a symlink to a folder "
                                  "of the user's outside the workspace; the stage that writes there",
                         expect="exit 2, one line naming the link; the user's folder byte-identical, the link kept")
@pytest.mark.parametrize("where,name", [("artifacts/clips", "clips"), ("artifacts/clips.tmp", "clips"),
                                        ("runs/.locks", "clips"), ("artifacts/teacher.tmp", "teacher")])
def test_symlinked_pipeline_folder_is_refused(ws, tmp_path, data_lost, where, name):
    folder = _user_folder(tmp_path)
    before = tree_sha(folder)
    link = ws / where
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(folder, target_is_directory=True)
    line = _one_line(stage(ws, name))
    assert where in line and "symbolic link" in line, line
    data_lost.record(0 if tree_sha(folder) == before else 1, "folders of the user's changed")
    assert link.is_symlink()


@pytest.mark.reliability(case="10.D", title="preprocess beside prompt-embedding files it did not write",
                         injected="--out holds a negative_prompt.safetensors of the user's; `preprocess` without a negative "
                                  "prompt, then with one; then its own run with one, rerun without",
                         expect="the user's file untouched and a one-line refusal where it would be replaced; the run's own "
                                "negative embedding removed when no longer asked for")
def test_preprocess_replaces_only_prompt_embeddings_it_wrote(tmp_path, tiny_base, data_lost):
    from distillery.clips.synthetic import ClipSetConfig, make_clip_set
    from distillery.common.errors import UserError
    from distillery.data.preprocess import PreprocessConfig, preprocess

    data = make_clip_set(tmp_path / "clips", ClipSetConfig(num_train=2, num_validation=1, num_frames=9))
    out = tmp_path / "latents"
    out.mkdir()
    mine = out / "negative_prompt.safetensors"
    mine.write_bytes(b"the user's own file")
    cfg = PreprocessConfig(num_frames=9, height=32, width=32)
    preprocess(tiny_base, data, out, cfg)  # no negative prompt: the user's file is not needed, left alone
    kept = mine.read_bytes() == b"the user's own file"
    with pytest.raises(UserError, match="exists and was not written by preprocess"):
        preprocess(tiny_base, data, out, PreprocessConfig(num_frames=9, height=32, width=32, negative_prompt="blurry"))
    kept = kept and mine.read_bytes() == b"the user's own file"
    data_lost.record(0 if kept else 1, "files of the user's overwritten or deleted")
    own = tmp_path / "own"
    preprocess(tiny_base, data, own, PreprocessConfig(num_frames=9, height=32, width=32, negative_prompt="blurry"))
    assert (own / "negative_prompt.safetensors").is_file()
    preprocess(tiny_base, data, own, cfg)
    assert not (own / "negative_prompt.safetensors").exists() and (own / "empty_prompt.safetensors").is_file()
    assert kept


@pytest.mark.reliability(case="11.5", title="a foreign checkpoint where the run will save is refused before training",
                         injected="output_dir holds checkpoint-8 copied from another run (not in its record); a run of 8 "
                                  "steps (it saves step 8 there)",
                         expect="one line naming checkpoint-8 before step 1 (no step trained, no checkpoint written); the "
                                "copied checkpoint untouched")
def test_a_foreign_checkpoint_where_the_run_saves_is_refused_before_training(tmp_path, tiny_base, latent_set, data_lost):
    from distillery.common.errors import UserError

    other = run_config(tiny_base, latent_set, tmp_path / "other", steps=2, save_every=2)
    train_in_process(other)
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(tmp_path / "other" / "checkpoint-2", out / "checkpoint-8")
    before = tree_sha(out / "checkpoint-8")
    with pytest.raises(UserError) as info:
        train_in_process(run_config(tiny_base, latent_set, out, steps=8, save_every=4))
    assert f"{out / 'checkpoint-8'} was not written by a run of this folder" in str(info.value)
    assert "nothing was trained" in str(info.value) and "\n" not in str(info.value)
    assert not (out / "train_log.jsonl").exists() and not (out / "checkpoint-4").exists()
    data_lost.record(0 if tree_sha(out / "checkpoint-8") == before else 1, "foreign checkpoints changed")
    assert data_lost.total == 0
