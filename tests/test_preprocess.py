"""Latent preprocessing: schema and contents, skipped items, kill + rerun identical, torchrun split."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import torchrun_command

from distillery.clips.synthetic import ClipSetConfig, make_clip_set
from distillery.data import LatentDataset, read_empty_prompt_embedding
from distillery.data.encoders import BaseEncoders
from distillery.data.preprocess import PreprocessConfig, preprocess

CFG = PreprocessConfig(num_frames=9, height=32, width=32, fps=8.0, rows_per_shard=4, batch_size=4)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    return make_clip_set(tmp_path_factory.mktemp("clips") / "clips", ClipSetConfig(num_train=12, num_validation=4, num_frames=9))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_base, clips) -> Path:
    """One uninterrupted preprocess of ``clips`` (:data:`CFG`, the settings of :func:`_pp_args`): the reference
    of the killed run and of the 2-rank split (read-only)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "lat"
    preprocess(tiny_base, clips, out, CFG)
    return out


def _cli(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "distillery.cli.main", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _pp_args(base: Path, data: Path, out: Path) -> list[str]:
    return ["preprocess", "--base", str(base), "--data", str(data), "--out", str(out), "--frames", "9",
            "--rows-per-shard", "4", "--batch-size", "4"]


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("shard-*"))}


def test_latents_match_the_base_models_encoders(tmp_path, tiny_base, clips):
    manifest = preprocess(tiny_base, clips, tmp_path / "lat", CFG)
    assert manifest["splits"]["train"]["rows"] == 12 and manifest["splits"]["validation"]["rows"] == 4
    assert manifest["settings"]["max_sequence_length"] == 32
    ds = LatentDataset(tmp_path / "lat", "train")
    assert len(ds) == 12 and len(LatentDataset(tmp_path / "lat", "validation")) == 4
    assert sorted(p.name for p in (tmp_path / "lat" / "train").glob("*.parquet")) == [f"shard-0000{i}.parquet" for i in range(3)]
    item = ds[0]
    assert item["latents"].shape == (8, 3, 8, 8) and item["latents"].dtype == torch.float32
    enc = BaseEncoders(tiny_base)
    from distillery.data.videos import IngestConfig, load_clips

    first = load_clips(clips / "train", IngestConfig(num_frames=9, height=32, width=32, fps=8.0)).items[0]
    assert item["caption"] == first.caption and item["id"] == first.id
    torch.testing.assert_close(item["latents"], enc.encode_videos(first.frames[None])[0])
    text = enc.encode_prompts([first.caption])[0]
    torch.testing.assert_close(item["text_embedding"], text)
    assert text.shape[0] == len(first.caption.split()) + 1  # words + </s>, unpadded
    empty = read_empty_prompt_embedding(tmp_path / "lat")
    assert empty is not None and empty.shape == (1, 32)
    # normalisation: z_norm·std + mean is what the VAE decodes (WanPipeline's un-normalisation)
    mean = torch.tensor(enc.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(enc.vae.config.latents_std).view(1, -1, 1, 1, 1)
    z = item["latents"][None] * std + mean
    with torch.no_grad():
        direct = enc.vae.decode(z, return_dict=False)[0]
    frames = torch.from_numpy(enc.decode_latents(item["latents"][None])).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    assert (frames - direct.clamp(-1, 1)).abs().max() < 1.5 / 127.5


def test_bad_items_are_skipped_with_reasons_and_nothing_else_is_lost(tmp_path, tiny_base, clips):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(clips / "train", data)
    lines = (data / "captions.jsonl").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    (data / entries[1]["path"]).write_bytes(b"not a video")
    entries[2]["caption"] = "   "
    entries[5]["path"] = "../outside.mp4"
    entries.append({"path": "videos/missing.mp4", "caption": "a red circle moving left on a black background"})
    (data / "captions.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries) + "{broken\n")
    manifest = preprocess(tiny_base, data, tmp_path / "lat", CFG)
    reasons = {json.loads(line)["reason"] for line in (tmp_path / "lat" / "skipped.jsonl").read_text().splitlines()}
    assert reasons == {"unreadable", "empty_caption", "path_escapes_data_folder", "missing_file", "bad_caption_entry"}
    assert manifest["splits"]["train"]["rows"] == 12 - 3
    ids = {LatentDataset(tmp_path / "lat")[i]["caption"] for i in range(9)}
    good = {e["caption"] for i, e in enumerate(entries[:12]) if i not in (1, 2, 5)}
    assert ids == good


@pytest.mark.process
def test_too_many_bad_items_exit_2_with_one_line(tmp_path, tiny_base, clips):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(clips / "validation", data)
    for p in (data / "videos").iterdir():
        p.write_bytes(b"")
    proc = _cli(*_pp_args(tiny_base, data, tmp_path / "lat"), cwd=tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    last = err.strip().splitlines()[-1]  # progress bars may precede it; the error is one line
    assert last.startswith("error: preprocess: train: 4 of 4 items unusable (unreadable 4)") and "skipped.jsonl" in last
    assert "Traceback" not in err


# `distillery preprocess` that stops itself (SIGSTOP) once shard 1's parquet is written and before its
# .json record is: the test then SIGKILLs it at that known point, whatever the host's speed.
STOP_AFTER_SECOND_PARQUET = (
    "import os, signal, sys\n"
    "import distillery.data.preprocess as pp\n"
    "real, written = pp.write_shard, []\n"
    "def write_shard(*args, **kwargs):\n"
    "    real(*args, **kwargs)\n"
    "    written.append(args)\n"
    "    if len(written) == 2:\n"
    "        os.kill(os.getpid(), signal.SIGSTOP)\n"
    "pp.write_shard = write_shard\n"
    "from distillery.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _wait_until_stopped(proc: subprocess.Popen, limit_s: float = 300) -> None:
    """Block until ``proc`` is stopped by a signal (not reaped); fail if it exits instead."""
    deadline = time.monotonic() + limit_s  # a hang guard, not a timing assertion
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
        if pid:
            assert os.WIFSTOPPED(status), f"preprocess exited (status {status}) before its stop point"
            return
        time.sleep(0.02)
    raise AssertionError("preprocess did not reach its stop point")


@pytest.mark.slow  # two preprocess processes, one killed
def test_killed_run_resumes_to_identical_shards(tmp_path, tiny_base, clips, uninterrupted):
    with (tmp_path / "killed.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-c", STOP_AFTER_SECOND_PARQUET, *_pp_args(tiny_base, clips, tmp_path / "out")],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=log)
        try:
            _wait_until_stopped(proc)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    train = tmp_path / "out" / "train"
    assert sorted(p.name for p in train.glob("shard-*")) == ["shard-00000.json", "shard-00000.parquet", "shard-00001.parquet"]
    assert not (tmp_path / "out" / "preprocess.json").exists()
    before = {p.name: _identity(p) for p in train.glob("shard-*")}
    again = _cli(*_pp_args(tiny_base, clips, tmp_path / "out"), cwd=tmp_path)
    assert again.wait(timeout=300) == 0, again.stderr.read()
    assert _shard_bytes(tmp_path / "out") == _shard_bytes(uninterrupted)
    after = {p.name: _identity(p) for p in train.glob("shard-*")}
    assert [n for n in sorted(before) if after[n] == before[n]] == ["shard-00000.json", "shard-00000.parquet"]  # kept
    assert after["shard-00001.parquet"] != before["shard-00001.parquet"]  # unrecorded: redone


def _identity(path: Path) -> tuple[int, int]:
    """(inode, mtime) of a file: a shard rewritten by temp file + rename gets a new one."""
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


@pytest.mark.slow
def test_torchrun_ranks_split_the_shards(tmp_path, tiny_base, clips, uninterrupted):
    cmd = torchrun_command(2, tmp_path, "-m", "distillery.cli.main", *_pp_args(tiny_base, clips, tmp_path / "two"))
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _shard_bytes(tmp_path / "two") == _shard_bytes(uninterrupted)


def test_latents_stage_takes_its_own_size_and_validate_follows_it(tmp_path, monkeypatch, clips):
    """latents.height/width/num_frames override the clips' square size (a user's 480×832 data); the
    manifest records them and validate reads its video size from there, not from clips.*."""

    import yaml
    from workspace import copy_pipeline, shipped_params_text

    from distillery.pipeline.launch.runner import run_stage
    from stages.validate import latent_settings

    copy_pipeline(tmp_path, ("dvc.yaml", "stages"))
    params = yaml.safe_load(shipped_params_text())
    params["latents"].update(data=str(clips), num_frames=5, height=32, width=48, device="cpu")
    for stage in ("teacher", "pretrain", "distill", "pdd"):  # 12 clips: the first stage refuses the default batch of 16
        params[stage]["batch_size"] = 4
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    from distillery.common import hashcache

    monkeypatch.delenv(hashcache.ENV_VAR, raising=False)  # restored after the test (run_stage sets it)
    assert run_stage("base") == 0 and run_stage("latents") == 0
    cache = tmp_path / "runs" / ".hash_cache.json"
    assert os.environ[hashcache.ENV_VAR] == str(cache) and cache.is_file()  # this workspace's hash cache
    row = LatentDataset(tmp_path / "artifacts" / "latents" / "data", "train")[0]
    assert tuple(row["latents"].shape[1:]) == (2, 8, 12)  # 5 frames → 2 latent frames; 32×48 px → 8×12 (tiny VAE: /4)
    settings = latent_settings()
    assert (settings["num_frames"], settings["height"], settings["width"], settings["device"]) == (5, 32, 48, "cpu")
