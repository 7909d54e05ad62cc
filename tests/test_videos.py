"""Video ingestion (distillery.data.videos): decoding, resampling, crop/resize, and every skip reason.

Videos are small lossless H.264 files made here. The frame index is written into the grey
background level (``5 + 4 * i``), so the picked source frame can be read back from the output.
"""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from distillery.common.errors import UserError
from distillery.data.video_folder import REASONS, SkippedItem, clip_id, find_splits
from distillery.data.videos import ClipItem, IngestConfig, iter_clips, load_clips

RED, BLUE, GREEN = (220, 30, 30), (30, 30, 220), (30, 220, 30)


def frame_pixels(i: int, h: int = 48, w: int = 64) -> np.ndarray:
    """Grey level 5 + 4 i; for a landscape frame, green strips outside the centred h×h square,
    a red block at the square's top-left and a blue one at its bottom-right."""
    a = np.full((h, w, 3), 5 + 4 * i, np.uint8)
    x0 = (w - h) // 2
    s = h // 3
    a[:, :x0] = GREEN
    a[:, x0 + h:] = GREEN
    a[:s, x0:x0 + s] = RED
    a[h - s:, x0 + h - s:x0 + h] = BLUE
    return a


def write_video(path: Path, n: int = 24, fps: int = 16, h: int = 48, w: int = 64, gop: int | None = None,
                rotation: int | None = None, faststart: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.options = {"crf": "0", "preset": "ultrafast"}
        if gop:
            s.codec_context.gop_size = gop
        if rotation is not None:
            s.set_display_rotation(rotation)
        for i in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(frame_pixels(i, h, w), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def write_captions(folder: Path, entries: list) -> None:
    """Each entry is a dict (dumped as JSON) or a raw str/bytes line."""
    lines = []
    for e in entries:
        if isinstance(e, bytes):
            lines.append(e)
        elif isinstance(e, str):
            lines.append(e.encode())
        else:
            lines.append(json.dumps(e).encode())
    (folder / "captions.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def frame_indices(frames: np.ndarray) -> list[int]:
    """Read the source frame index back from the grey background at the centre of each frame."""
    _, h, w, _ = frames.shape
    patch = frames[:, h // 2 - 2:h // 2 + 2, w // 2 - 2:w // 2 + 2].reshape(len(frames), -1)
    return [int(round((float(p.mean()) - 5) / 4)) for p in patch]


def nearest_indices(src_fps: int, fps: float, start: str, n: int) -> list[int]:
    """Reference picker: nearest source frame k/src_fps to t_i = start + i/fps, ties to the earlier."""
    st, f = Fraction(start), Fraction(fps)
    return [math.ceil((st + Fraction(i) / f) * src_fps - Fraction(1, 2)) for i in range(n)]


def is_colour(px: np.ndarray, rgb: tuple[int, int, int]) -> bool:
    return bool(np.all(np.abs(px.astype(int) - np.array(rgb)) < 40))


CFG = IngestConfig(num_frames=17, height=32, width=32, fps=16)


def test_config_validation() -> None:
    for bad in [dict(num_frames=16), dict(num_frames=0), dict(height=40), dict(width=8), dict(fps=0),
                dict(start_seconds=-1.0), dict(max_bad_fraction=1.5), dict(max_upscale=0.5),
                dict(max_upscale=float("inf")), dict(max_source_side=16), dict(max_source_side=100.0)]:
        kw = dict(num_frames=17, height=32, width=32, fps=16.0) | bad
        with pytest.raises(UserError):
            IngestConfig(**kw)
    IngestConfig(num_frames=1, height=16, width=16, fps=1)


def test_frames_shape_crop_and_orientation(tmp_path: Path) -> None:
    write_video(tmp_path / "videos" / "a.mp4")
    write_captions(tmp_path, [{"path": "videos/a.mp4", "caption": " a grey clip "}])
    (item,) = list(iter_clips(tmp_path, CFG))
    assert isinstance(item, ClipItem)
    assert item.frames.shape == (17, 32, 32, 3) and item.frames.dtype == np.uint8
    assert item.frames.flags["C_CONTIGUOUS"]
    assert item.caption == "a grey clip" and item.path == "videos/a.mp4"
    assert item.source_fps == pytest.approx(16.0) and item.source_size == (48, 64)
    assert frame_indices(item.frames) == list(range(17))
    f = item.frames[5]
    assert is_colour(f[4, 4], RED) and is_colour(f[28, 28], BLUE)  # top-left red, bottom-right blue
    green = (f[..., 1].astype(int) > 150) & (f[..., 0] < 100)
    assert not green.any(), "the green side strips must be cropped away"

    # a wide target crops rows instead: 48×64 -> rows 8:40 -> 16×32; green strips stay at the sides
    wide = IngestConfig(num_frames=5, height=16, width=32, fps=16)
    (item,) = list(iter_clips(tmp_path, wide))
    assert item.frames.shape == (5, 16, 32, 3)
    f = item.frames[0]
    assert is_colour(f[8, 1], GREEN) and is_colour(f[8, 30], GREEN)
    assert is_colour(f[1, 7], RED) and is_colour(f[14, 24], BLUE)
    assert frame_indices(item.frames) == list(range(5))


def test_upscale_and_rotation(tmp_path: Path) -> None:
    write_video(tmp_path / "videos" / "rot.mp4", n=6, rotation=90)  # displayed 90° counter-clockwise
    write_captions(tmp_path, [{"path": "videos/rot.mp4", "caption": "rotated"}])
    cfg = IngestConfig(num_frames=5, height=64, width=64, fps=16)  # 48×48 crop upscaled to 64×64
    (item,) = list(iter_clips(tmp_path, cfg))
    assert item.source_size == (64, 48)
    f = item.frames[0]
    # stored top-left red / bottom-right blue become bottom-left red / top-right blue when displayed
    assert is_colour(f[58, 5], RED) and is_colour(f[5, 58], BLUE)
    assert is_colour(f[5, 5], (5, 5, 5)) and frame_indices(item.frames) == list(range(5))


@pytest.mark.parametrize(
    "fps,start,n",
    [(8, "0", 9), (12, "0", 5), (32, "0", 9), (16, "0.5", 13), (10, "0.3", 9), (16, "0", 1), (7, "0", 9)],
)
def test_resampling_picks_nearest_source_frame(tmp_path: Path, fps: float, start: str, n: int) -> None:
    write_video(tmp_path / "videos" / "a.mp4")
    write_captions(tmp_path, [{"path": "videos/a.mp4", "caption": "c"}])
    cfg = IngestConfig(num_frames=n, height=16, width=16, fps=fps, start_seconds=float(start))
    (item,) = list(iter_clips(tmp_path, cfg))
    assert isinstance(item, ClipItem), item
    assert frame_indices(item.frames) == nearest_indices(16, fps, start, n)


def test_start_seconds_with_seek(tmp_path: Path) -> None:
    write_video(tmp_path / "videos" / "long.mp4", n=60, gop=4)  # keyframes every 4 frames: a real seek
    write_captions(tmp_path, [{"path": "videos/long.mp4", "caption": "c"}])
    for start in ["1.3", "2.0", "0.7"]:
        cfg = IngestConfig(num_frames=9, height=16, width=16, fps=12, start_seconds=float(start))
        (item,) = list(iter_clips(tmp_path, cfg))
        assert frame_indices(item.frames) == nearest_indices(16, 12, start, 9)
    cfg = IngestConfig(num_frames=9, height=16, width=16, fps=16, start_seconds=3.4)  # ends at 3.9 s > 3.75 s
    (item,) = list(iter_clips(tmp_path, cfg))
    assert isinstance(item, SkippedItem) and item.reason == "too_few_frames"


def test_frame_count_boundary(tmp_path: Path) -> None:
    write_video(tmp_path / "videos" / "exact.mp4", n=17)
    write_video(tmp_path / "videos" / "short.mp4", n=16)
    write_captions(tmp_path, [{"path": "videos/exact.mp4", "caption": "c"},
                              {"path": "videos/short.mp4", "caption": "c"}])
    exact, short = list(iter_clips(tmp_path, CFG))
    assert isinstance(exact, ClipItem) and frame_indices(exact.frames) == list(range(17))
    assert isinstance(short, SkippedItem) and short.reason == "too_few_frames"


def make_messy_folder(root: Path) -> tuple[Path, list[str], dict[str, str]]:
    """A data folder with good clips interleaved with one bad entry of every kind.

    Returns (folder, good paths in order, {skipped path: expected reason})."""
    data = root / "data"
    v = data / "videos"
    good = [f"videos/good{i}.mp4" for i in range(4)]
    for g in good:
        write_video(data / g)
    write_video(data / "videos" / "short.mp4", n=8)
    outside = write_video(root / "outside.mp4")
    (v / "text.mp4").write_text("this is not a video")
    (v / "empty.mp4").write_bytes(b"")
    (v / "adir.mp4").mkdir()
    with av.open(str(v / "audio.mp4"), "w") as c:  # audio only: no video stream
        s = c.add_stream("aac", rate=16000)
        fr = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        fr.sample_rate = 16000
        for p in [*s.encode(fr), *s.encode()]:
            c.mux(p)
    blob = write_video(root / "fs.mp4", faststart=True).read_bytes()
    (v / "cut.mp4").write_bytes(blob[: int(len(blob) * 0.6)])  # header says 24 frames, ~11 decode
    (v / "cut_late.mp4").write_bytes(blob[: int(len(blob) * 0.9)])  # ~20 frames decode: enough for 17
    os.symlink(outside, v / "link_out.mp4")
    os.symlink(v / "good0.mp4", v / "link_in.mp4")  # a symlink that stays inside is fine
    good_all = [good[0], good[1], "videos/cut_late.mp4", good[2], "videos/link_in.mp4", good[3]]

    entries: list = [
        {"path": good[0], "caption": "zero"},
        {"path": "videos/missing.mp4", "caption": "c"},
        "this is not json",
        {"path": "videos/text.mp4", "caption": "c"},
        {"path": "videos/empty.mp4", "caption": "c"},
        {"path": "videos/audio.mp4", "caption": "c"},
        {"path": "videos/adir.mp4", "caption": "c"},
        {"path": good[1], "caption": ["one", "ignored"]},
        "",  # blank lines are ignored, not counted
        {"path": "videos/cut.mp4", "caption": "c"},
        {"path": "videos/cut_late.mp4", "caption": "late cut"},
        {"path": str(outside), "caption": "c"},
        {"path": "../outside.mp4", "caption": "c"},
        {"path": "videos/../../outside.mp4", "caption": "c"},
        {"path": "videos/link_out.mp4", "caption": "c"},
        {"path": "videos/short.mp4", "caption": "c"},
        {"path": good[2], "caption": "two"},
        {"path": good[0], "caption": "again"},
        {"path": "videos/../videos/good1.mp4", "caption": "again"},
        {"path": "videos/link_in.mp4", "caption": "linked"},
        {"path": "videos/e1.mp4", "caption": ""},
        {"path": "videos/e2.mp4", "caption": "  \t\n "},
        {"path": "videos/e3.mp4", "caption": 5},
        {"path": "videos/e4.mp4"},
        {"path": "videos/e5.mp4", "caption": []},
        "[1, 2]",
        {"caption": "no path"},
        {"path": 3, "caption": "non-string path"},
        b"\xff\xfe not utf-8",
        {"path": good[3], "caption": "three"},
    ]
    write_captions(data, entries)
    expected = {
        "videos/missing.mp4": "missing_file",
        "captions.jsonl:3": "bad_caption_entry",
        "videos/text.mp4": "unreadable",
        "videos/empty.mp4": "unreadable",
        "videos/audio.mp4": "unreadable",
        "videos/adir.mp4": "unreadable",
        "videos/cut.mp4": "truncated",
        str(outside): "path_escapes_data_folder",
        "../outside.mp4": "path_escapes_data_folder",
        "videos/../../outside.mp4": "path_escapes_data_folder",
        "videos/link_out.mp4": "path_escapes_data_folder",
        "videos/short.mp4": "too_few_frames",
        good[0]: "duplicate_path",
        "videos/../videos/good1.mp4": "duplicate_path",
        "videos/e1.mp4": "empty_caption",
        "videos/e2.mp4": "empty_caption",
        "videos/e3.mp4": "empty_caption",
        "videos/e4.mp4": "empty_caption",
        "videos/e5.mp4": "empty_caption",
        "captions.jsonl:26": "bad_caption_entry",
        "captions.jsonl:27": "bad_caption_entry",
        "captions.jsonl:28": "bad_caption_entry",
        "captions.jsonl:29": "bad_caption_entry",
    }
    return data, good_all, expected


def test_every_bad_input_is_skipped_with_its_reason(tmp_path: Path) -> None:
    data, good, expected = make_messy_folder(tmp_path)
    cfg = IngestConfig(num_frames=17, height=32, width=32, fps=16, max_bad_fraction=0.9)
    out = list(iter_clips(data, cfg))
    items = [x for x in out if isinstance(x, ClipItem)]
    skipped = [x for x in out if isinstance(x, SkippedItem)]
    assert [i.path for i in items] == good  # nothing good lost, in captions-file order
    assert [i.caption for i in items] == ["zero", "one", "late cut", "two", "linked", "three"]
    for i in items:
        assert frame_indices(i.frames) == list(range(17))
    assert {s.path: s.reason for s in skipped} == expected
    assert len(skipped) == len(expected)  # the duplicate of good0 is the only repeated path key
    assert all(s.reason in REASONS and s.detail and "\n" not in s.detail for s in skipped)
    details = {s.path: s.detail for s in skipped}
    assert details["captions.jsonl:3"].startswith("line 3:") and details["captions.jsonl:26"].startswith("line 26:")
    # videos/cut_late.mp4 is corrupt after ~20 frames: decoding stops once the 17 needed frames are seen

    sk = tmp_path / "out" / "skipped.jsonl"
    res = load_clips(data, cfg, skipped_path=sk)
    assert [i.path for i in res.items] == good and res.num_total == len(good) + len(expected)
    rows = [json.loads(line) for line in sk.read_text().splitlines()]
    assert rows == [s.to_json() for s in res.skipped] == [s.to_json() for s in skipped]
    assert all(set(r) == {"path", "reason", "detail"} for r in rows)
    assert res.reason_counts["empty_caption"] == 5 and res.reason_counts["bad_caption_entry"] == 5
    assert sum(res.reason_counts.values()) == len(expected)
    assert not [p for p in sk.parent.iterdir() if p.name != "skipped.jsonl"]  # no temp files left


def _folder(root: Path, good: int, missing: int) -> Path:
    root.mkdir(parents=True)
    entries = []
    for i in range(good):
        write_video(root / "videos" / f"g{i}.mp4", n=17)
        entries.append({"path": f"videos/g{i}.mp4", "caption": "ok"})
    entries += [{"path": f"videos/m{i}.mp4", "caption": "gone"} for i in range(missing)]
    write_captions(root, entries)
    return root


def test_bad_fraction_limit(tmp_path: Path) -> None:
    data = _folder(tmp_path / "d", good=2, missing=3)
    sk = tmp_path / "skipped.jsonl"
    with pytest.raises(UserError) as e:
        load_clips(data, IngestConfig(num_frames=17, height=32, width=32, fps=16), skipped_path=sk)
    msg = str(e.value)
    assert "\n" not in msg and "3 of 5" in msg and "missing_file: 3" in msg and str(sk) in msg
    assert len(sk.read_text().splitlines()) == 3  # written before failing
    # exactly at the limit is allowed (3/5 = 0.6 is not more than 0.6)
    res = load_clips(data, IngestConfig(num_frames=17, height=32, width=32, fps=16, max_bad_fraction=0.6), sk)
    assert len(res.items) == 2 and res.num_total == 5 and res.reason_counts == {"missing_file": 3}


def test_all_bad_and_empty(tmp_path: Path) -> None:
    data = _folder(tmp_path / "d", good=0, missing=2)
    with pytest.raises(UserError) as e:
        load_clips(data, IngestConfig(num_frames=17, height=32, width=32, fps=16, max_bad_fraction=1.0), None)
    assert "\n" not in str(e.value) and "none of the 2" in str(e.value) and "missing_file: 2" in str(e.value)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "captions.jsonl").write_text("\n")
    with pytest.raises(UserError, match="lists no videos"):
        load_clips(tmp_path / "e", CFG)


def test_no_captions_file(tmp_path: Path) -> None:
    (tmp_path / "videos").mkdir()
    with pytest.raises(UserError) as e:
        list(iter_clips(tmp_path, CFG))
    assert "captions.jsonl" in str(e.value) and "videos2caption.json" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="does not exist"):
        load_clips(tmp_path / "nope", CFG)


def test_videos2caption_json(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        write_video(tmp_path / "videos" / f"{name}.mp4", n=17)
    (tmp_path / "videos2caption.json").write_text(json.dumps([
        {"path": "videos/a.mp4", "cap": ["first caption", "second"]},
        {"path": "videos/b.mp4", "cap": "plain string"},
        "not an object",
        {"path": "videos/c.mp4", "cap": []},
    ]))
    res = load_clips(tmp_path, CFG)
    assert [(i.path, i.caption) for i in res.items] == [("videos/a.mp4", "first caption"),
                                                        ("videos/b.mp4", "plain string")]
    assert [(s.path, s.reason) for s in res.skipped] == [("videos2caption.json[2]", "bad_caption_entry"),
                                                         ("videos/c.mp4", "empty_caption")]
    (tmp_path / "videos2caption.json").write_text("{not json")
    with pytest.raises(UserError, match="videos2caption.json"):
        load_clips(tmp_path, CFG)


def test_find_splits(tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "captions.jsonl").write_text("")
    assert find_splits(flat) == {"train": flat}
    split = tmp_path / "split"
    for s in ("train", "validation"):
        (split / s).mkdir(parents=True)
        (split / s / "videos2caption.json").write_text("[]")
    assert find_splits(split) == {"train": split / "train", "validation": split / "validation"}
    only_val = tmp_path / "only_val"
    (only_val / "validation").mkdir(parents=True)
    with pytest.raises(UserError, match="train"):
        find_splits(only_val)
    no_caps = tmp_path / "no_caps"
    (no_caps / "train").mkdir(parents=True)
    with pytest.raises(UserError, match="captions.jsonl"):
        find_splits(no_caps)
    with pytest.raises(UserError):
        find_splits(tmp_path / "missing")


def test_clip_id_stable_and_safe() -> None:
    a, b = clip_id("videos/a b.mp4"), clip_id("videos/a_b.mp4")
    assert a == clip_id("videos/a b.mp4") and a != b
    assert a.startswith("videos_a_b-")
    for p in ("videos/x.mp4", "vidéos/ü?*:|<>.webm", "../weird/.hidden", "noext"):
        i = clip_id(p)
        assert i and all(ch.isascii() and (ch.isalnum() or ch in "._-") for ch in i) and len(i) < 100


def test_source_size_limits(tmp_path: Path) -> None:
    """Too small: below ceil(target / max_upscale) per side (displayed size); too large: a header side
    above max_source_side, refused before decoding."""
    sizes = {"edge": (8, 16), "short": (6, 16), "thin": (8, 14), "big": (48, 64)}
    for name, (h, w) in sizes.items():
        write_video(tmp_path / "videos" / f"{name}.mp4", n=6, h=h, w=w)
    write_video(tmp_path / "videos" / "rot.mp4", n=6, h=16, w=8, rotation=90)  # displayed 8×16
    write_captions(tmp_path, [{"path": f"videos/{n}.mp4", "caption": "c"} for n in [*sizes, "rot"]])
    cfg = IngestConfig(num_frames=5, height=16, width=32, fps=16, max_source_side=32)
    assert cfg.min_source_size() == (8, 16)
    out = {x.path: x for x in iter_clips(tmp_path, cfg)}
    assert isinstance(out["videos/edge.mp4"], ClipItem) and out["videos/edge.mp4"].frames.shape == (5, 16, 32, 3)
    assert isinstance(out["videos/rot.mp4"], ClipItem) and out["videos/rot.mp4"].source_size == (8, 16)
    for name, size in (("short", "6×16"), ("thin", "8×14")):
        item = out[f"videos/{name}.mp4"]
        assert isinstance(item, SkippedItem) and item.reason == "too_small"
        assert size in item.detail and "at least 8×16" in item.detail
    big = out["videos/big.mp4"]
    assert big.reason == "dimensions_too_large" and "header declares 48×64" in big.detail and "32" in big.detail
    # a YUV4MPEG2 header FFmpeg cannot even open is read before FFmpeg sees the file
    (tmp_path / "videos" / "huge.y4m").write_bytes(b"YUV4MPEG2 W60000 H60000 F16:1 C420jpeg\nFRAME\n" + bytes(64))
    write_captions(tmp_path, [{"path": "videos/huge.y4m", "caption": "c"}])
    (item,) = list(iter_clips(tmp_path, CFG))
    assert item.reason == "dimensions_too_large" and "60000×60000" in item.detail


def test_unusable_paths_and_captions_are_skipped(tmp_path: Path) -> None:
    write_video(tmp_path / "videos" / "a.mp4", n=17)
    os.symlink("loop.mp4", tmp_path / "videos" / "loop.mp4")
    long_path = "videos/" + "/".join(["d" * 250] * 17) + ".mp4"
    write_captions(tmp_path, [
        {"path": "videos/a\x00.mp4", "caption": "c"},
        {"path": "videos/" + "é" * 128 + ".mp4", "caption": "c"},  # 260 bytes in UTF-8, 132 characters
        {"path": long_path, "caption": "c"},
        {"path": "videos/\udfff.mp4", "caption": "c"},
        {"path": "videos/loop.mp4", "caption": "c"},
        {"path": "videos/a.mp4", "caption": "bad \ud800"},
        {"path": "videos/a.mp4", "caption": ""},
        {"path": "videos/a.mp4", "caption": "kept"},
        {"path": "videos/a.mp4", "caption": "again"},
    ])
    out = list(iter_clips(tmp_path, CFG))
    assert [(x.path, x.reason) for x in out if isinstance(x, SkippedItem)] == [
        ("videos/a\\x00.mp4", "bad_path"),
        ("videos/" + "é" * 128 + ".mp4", "bad_path"),
        (long_path[:199] + "…", "bad_path"),
        ("videos/\\udfff.mp4", "bad_path"),
        ("videos/loop.mp4", "unreadable"),
        ("videos/a.mp4", "bad_caption"),
        ("videos/a.mp4", "empty_caption"),
        ("videos/a.mp4", "duplicate_path"),  # only the entry that passed every check claimed the path
    ]
    (kept,) = [x for x in out if isinstance(x, ClipItem)]
    assert kept.caption == "kept" and frame_indices(kept.frames) == list(range(17))
    sk = tmp_path / "out" / "skipped.jsonl"
    load_clips(tmp_path, IngestConfig(num_frames=17, height=32, width=32, fps=16, max_bad_fraction=0.9), sk)
    lines = sk.read_bytes().decode("utf-8").splitlines()  # valid UTF-8, one line per skipped entry
    assert len(lines) == 8 and all(len(json.loads(line)["detail"]) <= 400 for line in lines)


def test_captions_file_must_not_link_out(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "captions.jsonl").write_text('{"path": "videos/a.mp4", "caption": "c"}\n')
    data = tmp_path / "data"
    write_video(data / "videos" / "a.mp4", n=17)
    os.symlink(outside / "captions.jsonl", data / "captions.jsonl")
    with pytest.raises(UserError) as e:
        list(iter_clips(data, CFG))
    assert "\n" not in str(e.value) and "symlink" in str(e.value) and "outside the data folder" in str(e.value)
    with pytest.raises(UserError, match="outside the data folder"):
        find_splits(data)
    (data / "captions.jsonl").unlink()  # a link that stays inside the folder is fine
    (data / "meta").mkdir()
    (data / "meta" / "c.jsonl").write_text('{"path": "videos/a.mp4", "caption": "c"}\n')
    os.symlink(Path("meta") / "c.jsonl", data / "captions.jsonl")
    assert [x.caption for x in iter_clips(data, CFG)] == ["c"]
