"""Cases 9.2, 9.6 and 9.8: the latent set is what its manifest says, and bad data is refused early.

- 9.2: ``distillery preprocess`` into an ``--out`` that already holds shards made with other
  settings (or from other videos) redoes them, says why, and leaves no stale shard behind.
- 9.6: a shard whose shape column overflows 64-bit arithmetic, holds the same bytes in another
  layout, or has fewer rows than its record says is refused when the latent set is loaded: one
  line naming the shard (exit 2 from the trainer's entry point).
- 9.8: a caption over the documented limit is skipped with its reason; a data folder whose items
  are mostly unusable (bad captions, FIFOs, folders named as videos) fails before any shard is
  written; a FIFO is never opened.

Everything runs the real ``preprocess`` with the tiny Wan base on real tiny clips
(``distillery.clips.synthetic``), a few seconds per test.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from workspace import project_log

from distillery.clips.synthetic import ClipSetConfig, make_clip_set
from distillery.common.errors import UserError
from distillery.data import LatentDataset, video_folder
from distillery.data.latent_format import ColumnError, decode_tensor_column, tensor_from_bytes
from distillery.data.preprocess import PreprocessConfig, preprocess

SMALL = PreprocessConfig(num_frames=17, height=32, width=32, fps=8.0, rows_per_shard=2, batch_size=2)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A flat data folder of 4 real captioned 17×32×32 clips (read-only: copy it)."""
    root = make_clip_set(tmp_path_factory.mktemp("clips") / "clips",
                         ClipSetConfig(num_train=4, num_validation=1, num_frames=17))
    return root / "train"


@pytest.fixture(scope="module")
def real_latents(tmp_path_factory: pytest.TempPathFactory, tiny_base: Path, clips: Path) -> Path:
    """The real latent set of ``clips`` (17×32×32 → latents [8, 5, 8, 8]), 2 shards of 2 rows (read-only)."""
    out = tmp_path_factory.mktemp("latents") / "latents"
    preprocess(tiny_base, clips, out, SMALL)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _shard_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("shard-*"))


# ---------------------------------------------------------------------------------------------
# 9.2 stale shards


@pytest.mark.reliability(
    case="9.2", title="preprocess into an --out made with other settings",
    injected="preprocess (17×32×32, 2 rows per shard: 2 shards) then again into the same --out with 9 frames, "
             "64×64, 4 rows per shard",
    expect="every old shard redone and the log says why (settings differ, naming them); no stale shard left; "
           "preprocess.json's settings and latent_shape are what every row holds")
def test_rerun_with_other_settings_redoes_stale_shards(tmp_path: Path, tiny_base: Path, clips: Path, data_lost) -> None:
    out = tmp_path / "out"
    preprocess(tiny_base, clips, out, SMALL)
    assert _shard_files(out) == [f"train/shard-0000{k}.{ext}" for k in (0, 1) for ext in ("json", "parquet")]
    other = PreprocessConfig(num_frames=9, height=64, width=64, fps=8.0, rows_per_shard=4, batch_size=2)
    with project_log() as lines:
        preprocess(tiny_base, clips, out, other)
    assert any("(0 already done)" in line for line in lines), lines
    redone = [line for line in lines if "shard-00000" in line and "redone" in line]
    assert redone and "settings differ" in redone[0] and "height 32 → 64" in redone[0], lines
    assert _shard_files(out) == ["train/shard-00000.json", "train/shard-00000.parquet"], "a stale shard is left"
    manifest = json.loads((out / "preprocess.json").read_text())
    settings = manifest["settings"]
    assert (settings["num_frames"], settings["height"], settings["width"]) == (9, 64, 64)
    assert manifest["latent_shape"] == [8, 3, 16, 16]  # 9 frames → 3 latent frames; 64 px → 16 (tiny VAE: /4)
    ds = LatentDataset(out, "train")
    stale = sum(tuple(ds[i]["latents"].shape) != (8, 3, 16, 16) for i in range(len(ds)))
    lost = data_lost.record(stale + (4 - len(ds)), "rows of the old settings served, or rows missing")
    assert lost == 0


@pytest.mark.reliability(
    case="9.2", title="preprocess into an --out whose videos changed",
    injected="preprocess, then one video of shard 1 rewritten (another clip's bytes) and preprocess again with "
             "the same settings",
    expect="shard 1 redone (its input digest differs; the log says so) and holds the new video's latent; shard 0 "
           "kept as it was")
def test_rerun_with_a_changed_video_redoes_its_shard(tmp_path: Path, tiny_base: Path, clips: Path, data_lost) -> None:
    data = _copy(clips, tmp_path / "data")
    out = tmp_path / "out"
    preprocess(tiny_base, data, out, SMALL)
    entries = [json.loads(line) for line in (data / "captions.jsonl").read_text().splitlines()]
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "train").glob("shard-*")}
    old_row = LatentDataset(out, "train")[2]["latents"].clone()
    (data / entries[2]["path"]).write_bytes((data / entries[0]["path"]).read_bytes())  # shard 1's first video
    with project_log() as lines:
        preprocess(tiny_base, data, out, SMALL)
    assert any("shard-00001" in line and "redone" in line and "inputs differ" in line for line in lines), lines
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "train").glob("shard-*")}
    assert after["shard-00000.parquet"] == before["shard-00000.parquet"]  # untouched
    assert after["shard-00001.parquet"] != before["shard-00001.parquet"]
    ds = LatentDataset(out, "train")
    stale = int(bool((ds[2]["latents"] == old_row).all()))  # the old video's latent still served
    assert (ds[2]["latents"] - ds[0]["latents"]).abs().max() < 1e-5  # now the same clip as row 0
    lost = data_lost.record(stale, "rows encoded from a video that was replaced since")
    assert lost == 0


# ---------------------------------------------------------------------------------------------
# 9.6 shapes that lie


def _rewrite_column(shard: Path, name: str, values: list) -> None:
    table = pq.read_table(shard)
    i = table.schema.get_field_index(name)
    pq.write_table(table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type)), shard)


def _load_error(root: Path) -> str:
    with pytest.raises(UserError) as e:
        LatentDataset(root, "train")
    return str(e.value)


@pytest.mark.reliability(
    case="9.6", title="shape product that overflows 64 bits",
    injected="a shard row whose latent_shape is [65536, 65536, 65536, 65536] (2^64 elements: int64 arithmetic "
             "wraps to 0) with 0 latent bytes; the same shape given to tensor_from_bytes",
    expect="refused: the byte check uses exact integers (ColumnError / ValueError), the dataset's error is one "
           "line naming the shard")
def test_overflowing_shape_is_refused(tmp_path: Path, real_latents: Path, data_lost) -> None:
    huge = [[65536] * 4]
    with pytest.raises(ColumnError, match="do not match shape"):
        decode_tensor_column(pa.array([b""], pa.binary()), pa.array(huge, pa.list_(pa.int32())), pa.array(["float32"]), 4)
    with pytest.raises(ValueError, match="do not match shape"):
        tensor_from_bytes(b"", huge[0], "float32")
    root = _copy(real_latents, tmp_path / "latents")
    shard = root / "train" / "shard-00001.parquet"
    rows = pq.read_table(shard).num_rows
    _rewrite_column(shard, "latent_shape", huge * rows)
    _rewrite_column(shard, "latent_bytes", [b""] * rows)
    message = _load_error(root)
    assert str(shard) in message and "\n" not in message
    data_lost.record(0, "rows lost (the refusal keeps every file)")


@pytest.mark.process
@pytest.mark.reliability(
    case="9.6", title="same bytes, another layout",
    injected="a shard of a 17×32×32 latent set (rows [8, 5, 8, 8]) whose latent_shape column says [8, 5, 16, 4] "
             "(the same 2560 floats); python -m distillery.cli.train on it",
    expect="the latent set refuses it, naming the shard and the recorded [8, 5, 8, 8]; the trainer exits 2 with "
           "one error line, no traceback, nothing trained")
def test_other_layout_with_the_same_bytes_is_refused(tmp_path: Path, tiny_base: Path, real_latents: Path,
                                                     data_lost) -> None:
    from helpers import run_config, write_config

    root = _copy(real_latents, tmp_path / "latents")
    shard = root / "train" / "shard-00001.parquet"
    _rewrite_column(shard, "latent_shape", [[8, 5, 16, 4]] * pq.read_table(shard).num_rows)
    message = _load_error(root)
    assert str(shard) in message and "[8, 5, 16, 4]" in message and "[8, 5, 8, 8]" in message and "\n" not in message
    config = write_config(tmp_path / "run.yaml", run_config(tiny_base, root, tmp_path / "run", steps=2, batch_size=2))
    proc = subprocess.run([sys.executable, "-m", "distillery.cli.train", "--config", str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and str(shard) in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    trained = data_lost.record(len(list((tmp_path / "run").rglob("checkpoint-*"))), "checkpoints trained on the bad shard")
    assert trained == 0


@pytest.mark.reliability(
    case="9.6", title="fewer rows than the shard's record",
    injected="shard 1 rewritten without its last row while shard-00001.json still says 2 rows",
    expect="refused when loaded: one line naming the shard, the 1 row it holds and the 2 its record says")
def test_shard_with_fewer_rows_than_its_record_is_refused(tmp_path: Path, real_latents: Path, data_lost) -> None:
    root = _copy(real_latents, tmp_path / "latents")
    shard = root / "train" / "shard-00001.parquet"
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, table.num_rows - 1), shard)
    message = _load_error(root)
    assert str(shard) in message and "1 row" in message and "2" in message and "\n" not in message
    data_lost.record(0, "rows lost (the refusal keeps every file)")


# ---------------------------------------------------------------------------------------------
# 9.8 bad data found before any work


@pytest.mark.reliability(
    case="9.8", title="a 5 MB caption",
    injected="one captions.jsonl entry whose caption is 5,000,013 characters, beside 4 valid ones (limit "
             "distillery.data.video_folder.MAX_CAPTION_CHARS = 2048)",
    expect="that entry skipped as caption_too_long in skipped.jsonl (naming its length and the limit); the 4 "
           "valid clips kept; no caption in the latent set over the limit")
def test_huge_caption_is_skipped(tmp_path: Path, tiny_base: Path, clips: Path, data_lost) -> None:
    data = _copy(clips, tmp_path / "data")
    entries = [json.loads(line) for line in (data / "captions.jsonl").read_text().splitlines()]
    entries.insert(1, {"path": "videos/huge.mp4", "caption": "a red circle " + "x" * 5_000_000})
    shutil.copy(data / entries[0]["path"], data / "videos" / "huge.mp4")
    (data / "captions.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    out = tmp_path / "out"
    manifest = preprocess(tiny_base, data, out, SMALL)
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert [(s["path"], s["reason"]) for s in skipped] == [("videos/huge.mp4", "caption_too_long")]
    assert "5000013 characters" in skipped[0]["detail"] and str(video_folder.MAX_CAPTION_CHARS) in skipped[0]["detail"]
    ds = LatentDataset(out, "train", with_latents=False)
    assert max(len(ds[i]["caption"]) for i in range(len(ds))) <= video_folder.MAX_CAPTION_CHARS == 2048
    lost = data_lost.record(4 - manifest["splits"]["train"]["rows"], "of 4 valid clips missing")
    assert lost == 0


@pytest.mark.reliability(
    case="9.8", title="100,000 caption lines, one valid",
    injected="captions.jsonl with 99,999 lines that are not JSON and 1 valid entry (default 32 rows per shard: "
             "3,125 shards)",
    expect="error naming the split, 99999 of 100000 unusable and the reason, before the base model is loaded "
           "or any shard is written (nothing in OUT)")
def test_mostly_bad_captions_fail_before_any_shard(tmp_path: Path, tiny_base: Path, clips: Path, data_lost,
                                                   monkeypatch) -> None:
    import distillery.data.preprocess as preprocess_module

    data = _copy(clips, tmp_path / "data")
    first = (data / "captions.jsonl").read_text().splitlines()[0]
    (data / "captions.jsonl").write_text(first + "\n" + "{not json\n" * 99_999)
    out = tmp_path / "out"
    loaded: list[Path] = []
    real_encoders = preprocess_module.BaseEncoders

    def encoders(base, *args, **kwargs):  # the real class; the test records that it was (not) reached
        loaded.append(Path(base))
        return real_encoders(base, *args, **kwargs)

    monkeypatch.setattr(preprocess_module, "BaseEncoders", encoders)
    with pytest.raises(UserError) as e:
        preprocess(tiny_base, data, out, PreprocessConfig(num_frames=17, height=32, width=32))
    message = str(e.value)
    assert "train" in message and "99999 of 100000" in message and "bad_caption_entry" in message, message
    written = data_lost.record(len(list(out.rglob("*"))) if out.exists() else 0, "files written to OUT")
    assert written == 0, _shard_files(out)[:5]
    assert loaded == [], loaded  # refused from the scan of the captions file: the base model was never loaded


def _special_folder(tmp_path: Path, clips: Path) -> Path:
    """``clips`` plus a FIFO, a folder and a missing file named as videos (3 bad of 7 entries)."""
    data = _copy(clips, tmp_path / "data")
    entries = [json.loads(line) for line in (data / "captions.jsonl").read_text().splitlines()]
    os.mkfifo(data / "videos" / "pipe.mp4")
    (data / "videos" / "dir.mp4").mkdir()
    for name in ("pipe.mp4", "dir.mp4", "gone.mp4"):
        entries.insert(1, {"path": f"videos/{name}", "caption": "a red circle moving left on a black background"})
    (data / "captions.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    return data


@contextmanager
def _fifo_watch(fifo: Path) -> Iterator[list[float]]:
    """Count the times anything opens ``fifo`` for reading while the block runs: a thread tries a
    non-blocking open for writing every 5 ms, which succeeds only while a reader has it open (and
    closing it at once hands that reader an end of file, so nothing hangs)."""
    opened: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: no reader
                    raise
            else:
                opened.append(time.monotonic())
                os.close(fd)
            stop.wait(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield opened
    finally:
        stop.set()
        thread.join()


@pytest.mark.reliability(
    case="9.8", title="a FIFO, a folder and a missing file named as videos",
    injected="data/videos/pipe.mp4 a FIFO (a watcher counts every open of it for reading), videos/dir.mp4 a "
             "folder, videos/gone.mp4 absent, beside 4 valid clips; preprocess with max_bad_fraction 0.25, then 0.5",
    expect="0.25: one error line (3 of 7 unusable: unreadable, missing_file) before any shard is written; 0.5: "
           "the 4 clips kept, the 3 skipped with their reasons (the FIFO named as one); the FIFO never opened")
def test_special_files_are_found_before_encoding(tmp_path: Path, tiny_base: Path, clips: Path, data_lost) -> None:
    data = _special_folder(tmp_path, clips)
    strict, lenient = (PreprocessConfig(num_frames=17, height=32, width=32, rows_per_shard=2, max_bad_fraction=f)
                       for f in (0.25, 0.5))
    out = tmp_path / "strict"
    with _fifo_watch(data / "videos" / "pipe.mp4") as opened:
        with pytest.raises(UserError) as e:
            preprocess(tiny_base, data, out, strict)
        message = str(e.value)
        assert "\n" not in message and "3 of 7" in message and "unreadable" in message and "missing_file" in message
        assert _shard_files(out) == [] if out.exists() else True, _shard_files(out)
        manifest = preprocess(tiny_base, data, tmp_path / "out", lenient)
    assert opened == [], f"the FIFO was opened for reading {len(opened)} times"
    skipped = {s["path"]: s for s in map(json.loads, (tmp_path / "out" / "skipped.jsonl").read_text().splitlines())}
    assert {p: s["reason"] for p, s in skipped.items()} == {
        "videos/pipe.mp4": "unreadable", "videos/dir.mp4": "unreadable", "videos/gone.mp4": "missing_file"}
    assert "FIFO" in skipped["videos/pipe.mp4"]["detail"] and "folder" in skipped["videos/dir.mp4"]["detail"]
    lost = data_lost.record(4 - manifest["splits"]["train"]["rows"], "of 4 valid clips missing")
    assert lost == 0


@pytest.mark.process
@pytest.mark.reliability(
    case="9.8", title="the captions file is a FIFO",
    injected="data/captions.jsonl a FIFO (a watcher counts every open of it for reading); distillery preprocess CLI",
    expect="exit 2 with one error line saying captions.jsonl is a FIFO, not a regular file; never opened; nothing "
           "written")
def test_captions_fifo_is_refused_without_opening_it(tmp_path: Path, tiny_base: Path, clips: Path, data_lost) -> None:
    data = _copy(clips, tmp_path / "data")
    (data / "captions.jsonl").unlink()
    os.mkfifo(data / "captions.jsonl")
    out = tmp_path / "out"
    with _fifo_watch(data / "captions.jsonl") as opened:
        proc = subprocess.run(
            [sys.executable, "-m", "distillery.cli.main", "preprocess", "--base", str(tiny_base), "--data", str(data),
             "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "captions.jsonl" in errors[0] and "FIFO" in errors[0] and "not a regular file" in errors[0], errors
    assert opened == [], f"the captions FIFO was opened for reading {len(opened)} times"
    written = data_lost.record(len(list(out.rglob("*"))) if out.exists() else 0, "files written to OUT")
    assert written == 0
