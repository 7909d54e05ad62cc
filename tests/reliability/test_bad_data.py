"""Case 8.14: hostile or broken data is skipped with a reason (``OUT/skipped.jsonl``), never crashes
preprocessing, and costs no valid item.

Every hostile input is written for real: the captions files hold the bad paths and captions as JSON,
the tiny videos are real H.264 files, the huge-header videos are a real H.264 stream whose sequence
parameter set (SPS) was rewritten to declare 16000×16000 and a real YUV4MPEG2 file whose header
declares 60000×60000. One preprocessing run (the real ``preprocess`` with the tiny Wan base) over a
folder mixing them with valid clips backs the first three tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest

from distillery.clips.video_io import write_video
from distillery.common.errors import UserError
from distillery.data import LatentDataset
from distillery.data.preprocess import PreprocessConfig, preprocess
from distillery.data.video_folder import read_entries
from distillery.data.videos import IngestConfig, load_entry

CASE = "8.14"
CFG = PreprocessConfig(num_frames=9, height=32, width=32, fps=8.0, rows_per_shard=64, batch_size=8,
                       max_bad_fraction=0.9)
VALID = {  # path -> caption of every entry that must be kept
    "videos/v0.mp4": "a red circle moving left on a black background",
    "videos/v1.mp4": "a blue square moving right on a white background",
    "videos/v2.mp4": "a green triangle moving up on a black background",
    "videos/v3.mp4": "a yellow circle moving down on a white background",
    "videos/edge16.mp4": "a red square moving left on a white background",  # exactly the 16×16 minimum
}
LONG_COMPONENT = "videos/" + "x" * 300 + ".mp4"
LONG_PATH = "videos/" + "/".join(["d" * 200] * 25) + ".mp4"  # > 5000 bytes, every component < 255


def _clip(path: Path, size: tuple[int, int] = (32, 32), frames: int = 9, level: int = 0) -> None:
    h, w = size
    video = np.zeros((frames, h, w, 3), np.uint8)
    for i in range(frames):
        video[i] = (40 + 20 * i + level) % 256
    write_video(path, video, fps=8)


def _hostile_folder(root: Path) -> Path:
    data = root / "data"
    for i, rel in enumerate(VALID):
        _clip(data / rel, size=(16, 16) if "edge16" in rel else (32, 32), level=7 * i)
    _clip(data / "videos" / "tiny1.mp4", size=(1, 1))
    _clip(data / "videos" / "tiny8.mp4", size=(8, 8))
    os.symlink("loop.mp4", data / "videos" / "loop.mp4")  # a symlink to itself
    entries: list[dict[str, Any]] = [
        {"path": "videos/v0.mp4", "caption": VALID["videos/v0.mp4"]},
        {"path": "videos/v\x00.mp4", "caption": "a red circle"},
        {"path": LONG_COMPONENT, "caption": "a red circle"},
        {"path": LONG_PATH, "caption": "a red circle"},
        {"path": "videos/v1.mp4", "caption": "a red \ud800 circle"},  # lone surrogate: its later good entry is kept
        {"path": "videos/v\ud800.mp4", "caption": "a red circle"},
        {"path": "videos/v1.mp4", "caption": VALID["videos/v1.mp4"]},
        {"path": "videos/v2.mp4", "caption": "   "},  # empty caption: its later good entry is kept
        {"path": "videos/v2.mp4", "caption": VALID["videos/v2.mp4"]},
        {"path": "videos/tiny1.mp4", "caption": "a red circle"},
        {"path": "videos/tiny8.mp4", "caption": "a red circle"},
        {"path": "videos/loop.mp4", "caption": "a red circle"},
        {"path": "videos/v3.mp4", "caption": VALID["videos/v3.mp4"]},
        {"path": "videos/edge16.mp4", "caption": VALID["videos/edge16.mp4"]},
    ]
    (data / "captions.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="ascii")
    return data


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory: pytest.TempPathFactory, tiny_base: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hostile")
    data = _hostile_folder(root)
    out = root / "latents"
    try:
        manifest = preprocess(tiny_base, data, out, CFG)
    except Exception as e:  # reported by every test below
        return {"crash": f"{type(e).__name__}: {str(e)[:300]}"}
    raw = (out / "skipped.jsonl").read_bytes()
    skipped = [json.loads(line) for line in raw.decode("utf-8").splitlines()]
    ds = LatentDataset(out, "train")
    kept = {ds[i]["caption"] for i in range(len(ds))}
    return {"crash": None, "manifest": manifest, "skipped": skipped, "raw": raw, "kept": kept}


def _reasons(run: dict[str, Any]) -> dict[str, str]:
    return {s["path"]: s["reason"] for s in run["skipped"]}


def _lost(run: dict[str, Any], paths: list[str]) -> int:
    return sum(VALID[p] not in run["kept"] for p in paths)


@pytest.mark.reliability(
    case=CASE, title="hostile paths and captions",
    injected="captions.jsonl entries with a NUL byte, a 304-byte component, a 5000-byte path, a lone surrogate "
             "(\\ud800) in a caption and in a path, a self-symlink loop; real preprocess",
    expect="no crash; each skipped in skipped.jsonl (bad_path, bad_caption, unreadable), one readable UTF-8 line "
           "each; every valid clip kept")
def test_hostile_paths_and_captions_are_skipped(hostile_run, data_lost) -> None:
    assert hostile_run["crash"] is None, f"preprocessing crashed: {hostile_run['crash']}"
    reasons = _reasons(hostile_run)
    assert reasons["videos/v\\x00.mp4"] == "bad_path"
    assert reasons["videos/v\\ud800.mp4"] == "bad_path"
    component = next(p for p in reasons if p.startswith("videos/xxx"))  # echoed cut to 200 characters
    long_path = next(p for p in reasons if p.startswith("videos/ddd"))
    assert reasons[component] == reasons[long_path] == "bad_path" and len(component) == len(long_path) == 200
    assert reasons["videos/loop.mp4"] == "unreadable"
    details = {s["path"]: s["detail"] for s in hostile_run["skipped"]}
    assert "NUL" in details["videos/v\\x00.mp4"] and "surrogate" in details["videos/v\\ud800.mp4"]
    assert "304 bytes" in details[component] and "255" in details[component] and "4095" in details[long_path]
    assert [s["reason"] for s in hostile_run["skipped"] if s["path"] == "videos/v1.mp4"] == ["bad_caption"]
    assert all(len(s["detail"]) <= 400 for s in hostile_run["skipped"])
    assert hostile_run["raw"].count(b"\n") == len(hostile_run["skipped"])  # one line per skipped entry
    lost = data_lost.record(_lost(hostile_run, list(VALID)), "of 5 valid clips missing from the latents")
    assert lost == 0 and hostile_run["manifest"]["splits"]["train"]["rows"] == len(VALID)


@pytest.mark.reliability(
    case=CASE, title="a skipped entry claims no path",
    injected="an entry with a blank caption, and one with a lone-surrogate caption, each followed by a good "
             "entry for the same video",
    expect="the bad entries skipped (empty_caption, bad_caption); the good entries kept, not duplicate_path")
def test_skipped_entry_does_not_claim_its_path(hostile_run, data_lost) -> None:
    assert hostile_run["crash"] is None, f"preprocessing crashed: {hostile_run['crash']}"
    by_path = {}
    for s in hostile_run["skipped"]:
        by_path.setdefault(s["path"], []).append(s["reason"])
    assert by_path["videos/v1.mp4"] == ["bad_caption"] and by_path["videos/v2.mp4"] == ["empty_caption"]
    assert "duplicate_path" not in {s["reason"] for s in hostile_run["skipped"]}
    lost = data_lost.record(_lost(hostile_run, ["videos/v1.mp4", "videos/v2.mp4"]),
                            "of 2 good entries after a skipped one missing")
    assert lost == 0


@pytest.mark.reliability(
    case=CASE, title="tiny source video",
    injected="real 1×1 and 8×8 H.264 videos for a 32×32 clip (minimum 16×16 at max_upscale 2), and a 16×16 one",
    expect="1×1 and 8×8 skipped as too_small naming their size and the 16×16 minimum; 16×16 kept")
def test_tiny_video_is_skipped_with_its_size(hostile_run, data_lost) -> None:
    assert hostile_run["crash"] is None, f"preprocessing crashed: {hostile_run['crash']}"
    reasons = _reasons(hostile_run)
    details = {s["path"]: s["detail"] for s in hostile_run["skipped"]}
    for path, size in (("videos/tiny1.mp4", "1×1"), ("videos/tiny8.mp4", "8×8")):
        assert reasons[path] == "too_small", (path, details.get(path))
        assert size in details[path] and "16×16" in details[path]
    lost = data_lost.record(_lost(hostile_run, ["videos/edge16.mp4"]), "of 1 clip at the 16×16 minimum missing")
    assert lost == 0


@pytest.mark.process
@pytest.mark.reliability(
    case=CASE, title="captions file symlinked out of the folder",
    injected="data/captions.jsonl (and, in a second folder, videos2caption.json) a symlink to a valid captions "
             "file outside the data folder; distillery preprocess CLI",
    expect="exit 2 with one error line naming the symlink; nothing written to OUT")
def test_captions_file_symlinked_out_is_refused(tmp_path: Path, tiny_base: Path, data_lost) -> None:
    elsewhere = tmp_path / "elsewhere"
    _clip(elsewhere / "videos" / "v0.mp4")
    (elsewhere / "captions.jsonl").write_text(json.dumps({"path": "videos/v0.mp4", "caption": "a red circle"}) + "\n")
    (elsewhere / "videos2caption.json").write_text(json.dumps([{"path": "videos/v0.mp4", "cap": "a red circle"}]))
    data = tmp_path / "data"
    _clip(data / "videos" / "v0.mp4")
    os.symlink(elsewhere / "captions.jsonl", data / "captions.jsonl")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "distillery.cli.main", "preprocess", "--base", str(tiny_base), "--data", str(data),
         "--out", str(out), "--frames", "9"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    assert "captions.jsonl" in lines[0] and "symlink" in lines[0] and "outside the data folder" in lines[0]
    assert not out.exists() or not any(out.rglob("*"))

    json_data = tmp_path / "data_json"
    _clip(json_data / "videos" / "v0.mp4")
    os.symlink(elsewhere / "videos2caption.json", json_data / "videos2caption.json")
    with pytest.raises(UserError, match="videos2caption.json is a symlink to .* outside the data folder"):
        preprocess(tiny_base, json_data, tmp_path / "out_json", CFG)
    inside = tmp_path / "inside"  # a symlink that stays inside the folder is fine
    _clip(inside / "videos" / "v0.mp4")
    (inside / "meta").mkdir()
    (inside / "meta" / "caps.jsonl").write_text(json.dumps({"path": "videos/v0.mp4", "caption": "a red circle"}) + "\n")
    os.symlink(inside / "meta" / "caps.jsonl", inside / "captions.jsonl")
    manifest = preprocess(tiny_base, inside, tmp_path / "out_inside", CFG)
    lost = data_lost.record(1 - manifest["splits"]["train"]["rows"], "of 1 clip behind a captions symlink inside the folder lost")
    assert lost == 0


# ---------------------------------------------------------------------------------------------
# huge declared dimensions


def _ue(value: int) -> str:
    """Exp-Golomb code of ``value`` as a bit string."""
    code = bin(value + 1)[2:]
    return "0" * (len(code) - 1) + code


def _rewrite_sps_size(nal: bytes, width: int, height: int) -> bytes:
    """An H.264 SPS NAL unit (header byte + escaped payload) declaring ``width × height`` instead.

    Reads the fields before ``pic_width_in_mbs_minus1`` (profile, level, id, chroma format, bit
    depths, frame-number and picture-order-count fields, reference frames), replaces the two size
    fields and keeps the rest of the bits as they were."""
    payload = bytearray()
    zeros = 0
    for byte in nal[1:]:  # remove emulation-prevention bytes (00 00 03)
        if zeros >= 2 and byte == 3:
            zeros = 0
            continue
        payload.append(byte)
        zeros = zeros + 1 if byte == 0 else 0
    bits = "".join(f"{b:08b}" for b in payload)
    pos = 0

    def u(n: int) -> int:
        nonlocal pos
        pos += n
        return int(bits[pos - n:pos], 2)

    def ue() -> int:
        nonlocal pos
        lead = bits.index("1", pos) - pos
        pos += lead + 1
        value = (1 << lead) - 1 + (int(bits[pos:pos + lead], 2) if lead else 0)
        pos += lead
        return value

    profile = u(8)
    u(16)  # constraint flags, level
    ue()  # seq_parameter_set_id
    if profile in (100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135):
        if ue() == 3:  # chroma_format_idc
            u(1)
        ue(), ue(), u(1)  # bit depths, qpprime_y_zero_transform_bypass
        assert u(1) == 0, "x264 writes no scaling matrix"
    ue()  # log2_max_frame_num_minus4
    poc_type = ue()
    assert poc_type in (0, 2), "x264 writes poc type 0 or 2"
    if poc_type == 0:
        ue()
    ue(), u(1)  # max_num_ref_frames, gaps_in_frame_num_allowed
    start = pos
    ue(), ue()  # pic_width_in_mbs_minus1, pic_height_in_map_units_minus1
    rest = bits[pos:].rstrip("0")  # the remaining fields and the stop bit
    new = bits[:start] + _ue(width // 16 - 1) + _ue(height // 16 - 1) + rest
    new += "0" * (-len(new) % 8)
    out = bytearray(nal[:1])
    zeros = 0
    for i in range(0, len(new), 8):  # re-insert emulation prevention
        byte = int(new[i:i + 8], 2)
        if zeros >= 2 and byte <= 3:
            out.append(3)
            zeros = 0
        out.append(byte)
        zeros = zeros + 1 if byte == 0 else 0
    return bytes(out)


def _h264_declaring(path: Path, width: int, height: int) -> Path:
    """A raw (Annex B) H.264 stream of four real 48×64 frames whose SPS declares ``width × height``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="h264") as c:
        s = c.add_stream("libx264", rate=16)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.options = {"preset": "ultrafast", "threads": "1"}
        for i in range(4):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 40 + 30 * i, np.uint8), format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    units = path.read_bytes().split(b"\x00\x00\x01")
    patched = 0
    for i, unit in enumerate(units):
        if unit and unit[0] & 0x1F == 7:  # sequence parameter set
            body = unit.rstrip(b"\x00")
            units[i] = _rewrite_sps_size(body, width, height) + unit[len(body):]
            patched += 1
    assert patched == 1
    path.write_bytes(b"\x00\x00\x01".join(units))
    with av.open(str(path), options={"max_pixels": "1"}) as c:  # the header's size, without decoding a frame
        assert (c.streams.video[0].codec_context.width, c.streams.video[0].codec_context.height) == (width, height)
    return path


def _peak_rss_mib() -> int:
    return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) // 1024


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux ≥ 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@pytest.mark.reliability(
    case=CASE, title="huge declared dimensions",
    injected="a real H.264 stream whose SPS was rewritten to declare 16000×16000 (4.8 kB file) and a YUV4MPEG2 "
             "file declaring 60000×60000, beside a valid clip",
    expect="each skipped as dimensions_too_large from the header, < 1.5 s CPU and < 200 MiB peak RSS growth; "
           "valid clip kept")
def test_huge_header_is_skipped_before_decoding(tmp_path: Path, data_lost) -> None:
    data = tmp_path / "data"
    _h264_declaring(data / "videos" / "huge.h264", 16000, 16000)
    y4m = data / "videos" / "huge.y4m"
    y4m.write_bytes(b"YUV4MPEG2 W60000 H60000 F16:1 Ip A1:1 C420jpeg\n" + (b"FRAME\n" + bytes(64 * 48 * 3 // 2)) * 2)
    _clip(data / "videos" / "ok.mp4")
    (data / "captions.jsonl").write_text("".join(
        json.dumps({"path": f"videos/{name}", "caption": "a red circle"}) + "\n"
        for name in ("huge.h264", "huge.y4m", "ok.mp4")))
    cfg = IngestConfig(num_frames=1, height=32, width=32, fps=8.0)
    results = {}
    for entry in read_entries(data):  # what preprocess does, one entry at a time
        measured = _reset_peak_rss()
        before, cpu = _peak_rss_mib(), time.process_time()
        r = load_entry(data, entry, cfg)
        cpu = time.process_time() - cpu
        peak = _peak_rss_mib() - before if measured else None  # None: this kernel does not let us reset the peak
        results[r.path] = {"reason": getattr(r, "reason", "kept"), "detail": getattr(r, "detail", ""),
                           "cpu_s": cpu, "peak_mib": peak}
    for name, declared in (("huge.h264", "16000×16000"), ("huge.y4m", "60000×60000")):
        r = results[f"videos/{name}"]
        assert r["reason"] == "dimensions_too_large", (name, r)
        assert declared in r["detail"] and "8192" in r["detail"]
        assert r["cpu_s"] < 1.5, (name, r)  # decoding one 16000×16000 frame takes > 10 s of CPU
        assert r["peak_mib"] is None or r["peak_mib"] < 200, (name, r)  # and > 1 GiB
    lost = data_lost.record(results["videos/ok.mp4"]["reason"] != "kept", "of 1 valid clip beside the huge ones lost")
    assert lost == 0
