"""Synthetic captioned clips, their caption grammar, MP4 I/O and the prompt-adherence analyzer."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from distillery.cli.clips import add_command
from distillery.clips import (
    AnalyzerConfig,
    ClipAttributes,
    ClipSetConfig,
    analyze,
    calibrate,
    evaluate,
    format_caption,
    iter_captioned_videos,
    make_clip_set,
    parse_caption,
    read_video,
    score,
    write_video,
)
from distillery.clips.grammar import COLOURS, DIRECTIONS, SHAPES
from distillery.common.errors import UserError


@pytest.fixture(scope="module")
def clip_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clip_set(tmp_path_factory.mktemp("clips") / "set", ClipSetConfig())


@pytest.fixture(scope="module")
def validation_pairs(clip_set: Path) -> list[tuple[np.ndarray, str]]:
    return list(iter_captioned_videos(clip_set / "validation"))


def _truth(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "ground_truth.jsonl").read_text().splitlines()]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _blur(frames: np.ndarray, sigma: float, noise: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian blur over H and W plus Gaussian noise: a stand-in for a small VAE's reconstruction."""
    x = frames.astype(np.float64) / 255.0
    taps = np.arange(-4, 5)
    kernel = np.exp(-(taps**2) / (2 * sigma**2))
    kernel /= kernel.sum()
    for axis in (1, 2):
        padded = np.pad(x, [(4, 4) if a == axis else (0, 0) for a in range(4)], mode="edge")
        x = sum(w * np.take(padded, np.arange(k, k + x.shape[axis]), axis=axis) for k, w in enumerate(kernel))
    return np.clip(x + rng.normal(0.0, noise, x.shape), 0.0, 1.0)


def test_grammar_round_trip_and_tolerance() -> None:
    for colour, shape, direction, speed in itertools.product(COLOURS, SHAPES, DIRECTIONS, ("slowly", "quickly", None)):
        attrs = ClipAttributes(colour, shape, direction, speed, "black")
        assert parse_caption(format_caption(attrs)) == attrs
    assert format_caption(ClipAttributes("red", "circle", "left", None, "black")) == "a red circle moving left on a black background"
    assert parse_caption("  A  Cyan TRIANGLE moving\tup quickly on a gray background. ") == ClipAttributes(
        "cyan", "triangle", "up", "quickly", "gray")


@pytest.mark.parametrize("text", [
    "", "a purple circle moving left on a black background", "a red hexagon moving left on a black background",
    "a red circle moving diagonally on a black background", "a red circle moving left fast on a black background",
    "a red circle moving left", "red circle moving left on a black background",
    "a red circle moving left on a black backdrop", "a red circle moving left on a pink background",
    "a red circle moving left on a black background and a blue square",
])
def test_parse_caption_rejects_out_of_grammar(text: str) -> None:
    assert parse_caption(text) is None


def test_layout_and_captions(clip_set: Path) -> None:
    cfg = ClipSetConfig()
    assert (clip_set / "README.md").read_text().count("a <colour> <shape> moving <direction>") == 1
    assert not list(clip_set.parent.glob(".set.*")), "temp folders left behind"
    truth = {(r["split"], r["path"]): r for r in _truth(clip_set)}
    assert len(truth) == cfg.num_train + cfg.num_validation
    for split, count in (("train", cfg.num_train), ("validation", cfg.num_validation)):
        lines = (clip_set / split / "captions.jsonl").read_text().splitlines()
        assert len(lines) == count
        assert len(list((clip_set / split / "videos").glob("*.mp4"))) == count
        for line in lines:
            record = json.loads(line)
            assert set(record) == {"path", "caption"}
            assert record["path"].startswith("videos/") and record["path"].endswith(".mp4")
            assert (clip_set / split / record["path"]).is_file()
            gt = truth[(split, record["path"])]
            assert gt["caption"] == record["caption"]
            attrs = parse_caption(record["caption"])
            assert attrs == ClipAttributes(gt["colour"], gt["shape"], gt["direction"], gt["speed"], gt["background"])
    frames, fps = read_video(clip_set / "validation" / json.loads(lines[0])["path"])
    assert frames.shape == (17, 32, 32, 3) and frames.dtype == np.uint8 and fps == 8.0


def test_balance_and_paths_inside_frame(clip_set: Path) -> None:
    cfg = ClipSetConfig()
    truth = _truth(clip_set)
    train = [r for r in truth if r["split"] == "train"]
    val = [r for r in truth if r["split"] == "validation"]
    assert {(r["colour"], r["shape"], r["direction"]) for r in train} == set(itertools.product(COLOURS, SHAPES, DIRECTIONS))
    assert {(r["colour"], r["direction"]) for r in val} == set(itertools.product(COLOURS, DIRECTIONS))
    assert sorted(r["shape"] for r in val) == sorted(list(SHAPES) * 8)
    assert sum(r["speed"] == "slowly" for r in train) == sum(r["speed"] == "quickly" for r in train)
    r = cfg.radius
    for rec in truth:
        (x0, y0), (vx, vy) = rec["start_xy"], rec["velocity_xy"]
        for t in (0, cfg.num_frames - 1):
            x, y = x0 + t * vx, y0 + t * vy
            assert r <= x <= cfg.width - r and r <= y <= cfg.height - r
        assert abs(vx) + abs(vy) == pytest.approx({"slowly": 0.6, "quickly": 1.2}[rec["speed"]])


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    small = ClipSetConfig(num_train=4, num_validation=2)  # determinism is the generator's, not the set size's
    first_set, again = make_clip_set(tmp_path / "first", small), make_clip_set(tmp_path / "again", small)
    first, second = _files(first_set), _files(again)
    assert first.keys() == second.keys() and any(name.endswith(".mp4") for name in first)
    for name in first:  # decoded frames first (the weaker promise), then bytes
        if name.endswith(".mp4"):
            assert np.array_equal(read_video(first_set / name)[0], read_video(again / name)[0]), name
    assert first == second
    other = make_clip_set(tmp_path / "other", ClipSetConfig(num_train=4, num_validation=2, seed=1))
    assert _truth(other)[0]["start_xy"] != _truth(first_set)[0]["start_xy"]


def test_refuses_non_empty_out_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "clips"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    small = ClipSetConfig(num_train=3, num_validation=2)
    with pytest.raises(UserError, match="not empty"):
        make_clip_set(out, small)
    assert (out / "keep.txt").read_text() == "user data"
    make_clip_set(out, small, overwrite=True)
    assert not (out / "keep.txt").exists() and len(_truth(out)) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clips"]
    with pytest.raises(UserError):
        ClipSetConfig(colours=["purple"])


def test_video_io_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (5, 11, 13, 3), dtype=np.uint8)  # odd sizes, noise: the worst case
    decoded, fps = read_video(write_video(tmp_path / "a.mp4", frames, fps=12))
    assert decoded.shape == frames.shape and fps == 12.0
    assert np.abs(decoded.astype(int) - frames).max() <= 2
    with pytest.raises(UserError):
        write_video(tmp_path / "b.mp4", frames, fps=8, pix_fmt="yuv420p")
    with pytest.raises(UserError):
        read_video(tmp_path / "missing.mp4")


def test_every_x264_preset_is_lossless_to_the_same_frames(tmp_path: Path) -> None:
    """At crf 0 the preset trades encode time for bytes only: ultrafast (validate's samples and grid) decodes to
    the frames medium (the default) does."""
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (6, 16, 24, 3), dtype=np.uint8)
    medium, _ = read_video(write_video(tmp_path / "m.mp4", frames, fps=8))
    fast, _ = read_video(write_video(tmp_path / "u.mp4", frames, fps=8, preset="ultrafast"))
    assert np.array_equal(medium, fast)
    assert (tmp_path / "m.mp4").read_bytes() != (tmp_path / "u.mp4").read_bytes()  # the preset was applied
    with pytest.raises(UserError, match="preset"):
        write_video(tmp_path / "x.mp4", frames, fps=8, preset="fastest")


def test_analyzer_reads_real_clips_and_not_shuffled_captions(validation_pairs: list) -> None:
    real = evaluate(validation_pairs)
    assert real["colour"] >= 0.95 and real["direction"] >= 0.95 and real["shape"] >= 0.8, real
    captions = [caption for _, caption in validation_pairs]
    rng = np.random.default_rng(0)
    order = rng.permutation(len(captions))
    while np.any(order == np.arange(len(captions))):  # a fixed derangement: no clip keeps its caption
        order = rng.permutation(len(captions))
    deranged = [captions[i] for i in order]
    shuffled = evaluate((frames, caption) for (frames, _), caption in zip(validation_pairs, deranged))
    assert shuffled["colour"] <= 0.4 and shuffled["direction"] <= 0.5, shuffled
    frames, caption = validation_pairs[0]
    assert score(frames, caption) == dict.fromkeys(("colour", "shape", "direction", "all"), True)
    assert score(frames, "a red thing on a black background") == dict.fromkeys(("colour", "shape", "direction", "all"), False)
    as_float, as_uint8 = analyze(frames.astype(np.float32) / 255.0), analyze(frames)
    assert (as_float.colour, as_float.shape, as_float.direction) == (as_uint8.colour, as_uint8.shape, as_uint8.direction)
    assert as_float.h3 == pytest.approx(as_uint8.h3, rel=1e-4)


def test_analyzer_survives_blur_and_calibrates(clip_set: Path, validation_pairs: list) -> None:
    rng = np.random.default_rng(0)
    train = [(_blur(f, 1.5, 0.03, rng), c) for f, c in itertools.islice(iter_captioned_videos(clip_set / "train"), 48)]
    val = [(_blur(f, 1.5, 0.03, rng), c) for f, c in validation_pairs]
    cfg = calibrate(train)
    assert isinstance(cfg, AnalyzerConfig) and cfg != AnalyzerConfig()
    blurred = evaluate(val, cfg)
    assert blurred["colour"] >= 0.95 and blurred["direction"] >= 0.95 and blurred["shape"] >= 0.8, blurred
    empty = analyze(np.zeros((9, 32, 32, 3), np.uint8))
    assert empty.shape is None and empty.direction is None and empty.colour is None


def test_cli_make_and_analyze(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers(dest="command", required=True), "clips", "help")
    args = parser.parse_args(["clips", "make", "--out", str(tmp_path / "c"), "--num-train", "4",
                              "--num-validation", "3", "--frames", "9", "--size", "32", "--seed", "3"])
    assert args.func(args) == 0
    capsys.readouterr()
    args = parser.parse_args(["clips", "analyze", "--data", str(tmp_path / "c")])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"train", "validation"} and report["validation"]["num_clips"] == 3
    assert report["train"]["colour"] == 1.0


def test_no_validation_clips_make_a_set_the_latents_stage_reads(tmp_path, tiny_base):
    """clips.num_validation: 0 (params.yaml's '0: validate on train captions'): no validation/ folder is
    written, so preprocess finds the train split alone (it failed with 'lists no videos' after the clips
    artifact was replaced; issue 46 6b)."""
    from distillery.clips.synthetic import ClipSetConfig, make_clip_set
    from distillery.data.preprocess import PreprocessConfig, preprocess
    from distillery.data.video_folder import find_splits

    data = make_clip_set(tmp_path / "clips", ClipSetConfig(num_train=4, num_validation=0, num_frames=9))
    assert not (data / "validation").exists() and set(find_splits(data)) == {"train"}
    manifest = preprocess(tiny_base, data, tmp_path / "latents", PreprocessConfig(num_frames=9, height=32, width=32))
    assert set(manifest["splits"]) == {"train"} and manifest["splits"]["train"]["rows"] == 4
