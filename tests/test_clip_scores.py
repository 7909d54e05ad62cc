"""Issue 44 item 5: CLIP text–video similarity, CLIP frame consistency and motion, read with a CLIP folder the user
points at (``validate.clip_model``). A tiny random ``CLIPModel`` and a tiny byte-level BPE tokenizer saved by
transformers stand in for a real download; the reference values are computed here through transformers' public
``get_text_features`` / ``get_image_features`` and numpy, not through the scorer."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from distillery.common.errors import UserError
from distillery.evaluation.candidates import Candidate
from distillery.evaluation.clip_scores import (
    CLIP_METRICS,
    CLIP_SCORES,
    OPENAI_MEAN,
    OPENAI_STD,
    ClipScorer,
    check_clip_folder,
    motion,
    summarise,
)
from distillery.evaluation.sample_cache import SampleCache
from distillery.evaluation.validate import CLIP_HEADLINE, headline_metrics, run_validation
from distillery.evaluation.validation_config import ValidationConfig
from distillery.tinybase.shipped import shipped_tiny_base

PROMPTS = ["a red circle moving left slowly on a black background", "a blue square moving up quickly on a black background"]
CFG = dict(num_seeds=2, progress_bar=False, grid_formats=["gif"], bootstrap_resamples=50)


def _byte_chars() -> list[str]:
    """The 256 printable stand-ins of byte-level BPE (bytes that print as themselves keep their character)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out


def make_clip_folder(where: Path, seed: int, image_size: int = 32, patch_size: int = 8) -> Path:
    """A CLIP folder in transformers' layout: random tiny towers (``image_size``-px images, ``patch_size``-px patches,
    8-d projections) saved with ``save_pretrained`` beside a byte-level CLIP tokenizer with no merges (a token per character)."""
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    chars = _byte_chars()
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    text = dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=64, bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                pad_token_id=vocab["<|endoftext|>"])
    vision = dict(image_size=image_size, patch_size=patch_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(seed)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("clip")
    return make_clip_folder(root / "clip-a", 0), make_clip_folder(root / "clip-b", 1)


def reference_scores(folder: Path, frames: np.ndarray, prompt: str) -> dict[str, float]:
    """The three scores by their definitions: transformers' public feature functions on frames preprocessed by hand
    (square 32-px frames, or 32 rows: the centre crop only, no resize), cosines and differences in numpy."""
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(folder).eval()
    tokens = AutoTokenizer.from_pretrained(folder)([prompt], return_tensors="pt")
    t, h, w, _ = frames.shape
    assert h == 32 and w >= 32
    left = (w - 32) // 2
    x = frames[:, :, left:left + 32].astype(np.float64) / 255.0
    x = (x - np.asarray(OPENAI_MEAN)) / np.asarray(OPENAI_STD)
    with torch.no_grad():
        text = model.get_text_features(**tokens).pooler_output[0].double().numpy()
        images = model.get_image_features(pixel_values=torch.from_numpy(x).permute(0, 3, 1, 2).float()).pooler_output.double().numpy()
    text /= np.linalg.norm(text)
    images /= np.linalg.norm(images, axis=1, keepdims=True)
    pixels = frames.astype(np.float64) / 255.0
    return {"clip_text": float(np.mean(images @ text)),
            "clip_consistency": float(np.mean([images[i] @ images[i + 1] for i in range(t - 1)])),
            "motion": float(np.mean(np.abs(pixels[1:] - pixels[:-1])))}


def test_scores_are_the_cosines_and_differences_by_hand(clips):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(5, 32, 48, 3), dtype=np.uint8)  # wider than square: the centre crop applies
    scorer = ClipScorer(clips[0])
    got, want = scorer.score(frames, PROMPTS[0]), reference_scores(clips[0], frames, PROMPTS[0])
    assert set(got) == set(CLIP_SCORES)
    assert got == pytest.approx(want, abs=1e-5)
    assert -1 <= got["clip_text"] <= 1 and -1 <= got["clip_consistency"] <= 1 and 0 < got["motion"] < 1
    still = np.repeat(frames[:1], 4, axis=0)  # nothing moves: consistency 1, motion 0
    assert scorer.score(still, PROMPTS[0])["clip_consistency"] == pytest.approx(1.0, abs=1e-6)
    assert motion(still) == 0.0 and motion(frames[:1]) == 0.0
    assert scorer.score(frames, PROMPTS[1])["clip_text"] != pytest.approx(got["clip_text"], abs=1e-6)  # the prompt counts
    other = ClipScorer(clips[1]).score(frames, PROMPTS[0])  # another CLIP model reads other numbers
    assert other["clip_text"] != pytest.approx(got["clip_text"], abs=1e-4) and other["motion"] == got["motion"]
    big = rng.integers(0, 256, size=(2, 64, 80, 3), dtype=np.uint8)  # resized (shorter side 32) then centre-cropped
    assert scorer.pixels(big).shape == (2, 3, 32, 32)


def test_a_candidates_score_is_the_mean_with_a_bootstrap_interval():
    rows = [{"clip_text": v, "clip_consistency": 1 - v, "motion": v / 10} for v in (0.1, 0.2, 0.3, 0.6)]
    out = summarise(rows, 200, 7)
    assert set(out) == set(CLIP_METRICS)
    values = np.asarray([[r[k] for k in CLIP_SCORES] for r in rows])
    rng = np.random.default_rng(7)  # the same draws, by hand
    means = np.stack([values[rng.integers(0, 4, size=4)].mean(axis=0) for _ in range(200)])
    for i, k in enumerate(CLIP_SCORES):
        assert out[k] == pytest.approx(values[:, i].mean())
        assert (out[f"{k}_lo"], out[f"{k}_hi"]) == pytest.approx(tuple(np.percentile(means[:, i], (2.5, 97.5))))
        assert out[f"{k}_lo"] < out[k] < out[f"{k}_hi"]
    flat = summarise(rows, 1, 7)  # no resampling: the interval is the point
    assert all(flat[f"{k}_lo"] == flat[k] == flat[f"{k}_hi"] for k in CLIP_SCORES)


def test_a_folder_that_is_not_a_clip_model_is_one_line(clips, tmp_path):
    good = clips[0]
    assert check_clip_folder(good) == good
    cases = {"missing": (tmp_path / "nowhere", "does not exist"), "empty": (tmp_path / "empty", "has no config.json")}
    (tmp_path / "empty").mkdir()
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5"}))
    cases["t5"] = (t5, "is not a CLIPModel folder (config.json model_type 't5'")
    for name, drop in (("no-weights", "model.safetensors"), ("no-tokenizer", "tokenizer.json")):
        folder = tmp_path / name
        folder.mkdir()
        for f in good.iterdir():
            if f.name != drop:
                (folder / f.name).write_bytes(f.read_bytes())
        cases[name] = (folder, "has no .safetensors weights" if name == "no-weights" else "has no tokenizer")
    for name, (folder, said) in cases.items():
        with pytest.raises(UserError) as err:
            check_clip_folder(folder)
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"validate.clip_model: {folder}") and said in text, (name, text)
    with pytest.raises(UserError, match="validate.clip_model: .* does not exist"):  # before anything loads or samples
        ValidationConfig(clip_model=str(tmp_path / "nowhere"))
    assert ValidationConfig(clip_model="").clip_model is None and ValidationConfig().clip_model is None  # empty: off


def test_a_wrong_clip_model_stops_the_first_stage_and_params_check_in_one_line(tmp_path, monkeypatch, capsys):
    """Through the real parser and its error guard (what ``distillery ...`` runs): exit 2, one line, nothing written."""
    from distillery.cli.guard import run_guarded
    from distillery.cli.main import build_parser

    shipped = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    assert shipped["validate"]["clip_model"] is None  # off by default: the default DAG's numbers do not change
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.chdir(ws)
    not_clip = tmp_path / "downloads" / "clip"
    not_clip.mkdir(parents=True)
    for folder, said in ((tmp_path / "nowhere", "does not exist"), (not_clip, "has no config.json")):
        shipped["validate"]["clip_model"] = str(folder)
        (ws / "params.yaml").write_text(yaml.safe_dump(shipped, sort_keys=False))
        for command in (["stage", "clips", "--params", "params.yaml"], ["stage", "validate", "--params", "params.yaml"],
                        ["params", "check"]):
            ns = build_parser().parse_args(command)
            capsys.readouterr()
            rc = run_guarded(lambda ns=ns: ns.func(ns))
            lines = capsys.readouterr().err.strip().splitlines()
            assert rc == 2 and len(lines) == 1, (command, lines)
            assert lines[0].startswith(f"error: params.yaml: validate.clip_model: {folder}") and said in lines[0], lines
        assert sorted(p.name for p in ws.iterdir()) == ["params.yaml"]  # nothing written before the check


@pytest.fixture(scope="module")
def runs(clips, tmp_path_factory):
    """The same two candidates validated three times with one sample cache: without CLIP, with CLIP folder A, with B."""
    root = tmp_path_factory.mktemp("clip-validate")
    base = shipped_tiny_base()
    cands = [Candidate("teacher_2", base, 2, 4.0, "euler"), Candidate("student_1", base, 1, 1.0, "few_step_x0")]
    cache = SampleCache(root / "cache")
    out = {}
    for name, clip in (("plain", None), ("a", clips[0]), ("b", clips[1])):
        cfg = ValidationConfig(**CFG, clip_model=None if clip is None else str(clip))
        metrics = run_validation(base, cands, PROMPTS, root / name, cfg, cache=cache)
        out[name] = (metrics, json.loads((root / name / "report.json").read_text()), root / name)
    return out, cands, cache


def _cached_frames(cache: SampleCache, report: dict, name: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(cache.root / report["cache"][name]["key"] / "frames.safetensors"))


def test_validate_reports_clip_scores_with_intervals_everywhere(runs, clips):
    out, cands, cache = runs
    metrics, report, folder = out["a"]
    names = [c.name for c in cands]
    for n in names:
        for k in CLIP_SCORES:
            assert metrics[f"{n}/{k}_lo"] <= metrics[f"{n}/{k}"] <= metrics[f"{n}/{k}_hi"], (n, k)
        frames = _cached_frames(cache, report, n)  # the exact decoded frames (the mp4s are yuv444p)
        rows = report["per_video"][n]
        for row in rows:  # every video's scores are its frames' by the definitions
            want = reference_scores(clips[0], frames[row["sample"]], PROMPTS[row["prompt"]])
            assert {k: row[k] for k in CLIP_SCORES} == pytest.approx(want, abs=1e-5), (n, row["sample"])
        assert metrics[f"{n}/clip_text"] == pytest.approx(np.mean([r["clip_text"] for r in rows]), abs=1e-6)
    written = json.loads((folder / "metrics.json").read_text())
    assert {k: written[k] for k in metrics} == metrics and all(f"{n}/{k}" in written for n in names for k in CLIP_METRICS)
    shown = headline_metrics(metrics, names, "teacher_2")  # what the stage gives DVC
    assert {f"{n}/{k}" for n in names for k in CLIP_HEADLINE} <= set(shown)
    summary = (folder / "summary.md").read_text()
    assert f"## Comparable scores (CLIP model `{clips[0]}`)" in summary and "Not VBench's numbers" in summary
    for n in names:
        cell = f"{metrics[f'{n}/clip_text']:.4f} [{metrics[f'{n}/clip_text_lo']:.4f}, {metrics[f'{n}/clip_text_hi']:.4f}]"
        assert f"| {n} | {cell} |" in summary
    with (folder / "plots" / "adherence.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert all(float(r["clip_text"]) == metrics[f"{r['candidate']}/clip_text"] for r in table)
    assert report["clip"]["folder"] == str(clips[0]) and report["clip"]["scores"] == list(CLIP_SCORES)
    assert report["config"]["clip_model"] == str(clips[0])


def test_without_clip_nothing_changes_and_another_clip_rescores_cached_samples(runs, clips):
    out, cands, cache = runs
    plain, _, plain_folder = out["plain"]
    for name in ("a", "b"):
        metrics, report, _ = out[name]
        assert {c: report["cache"][c]["reused"] for c in ("teacher_2", "student_1")} == {"teacher_2": True, "student_1": True}
        # the other numbers are bitwise the run's without CLIP (latency too: reused from it)
        assert {k: v for k, v in metrics.items() if k.rpartition("/")[2] not in CLIP_METRICS} == plain
    assert not any(k.rpartition("/")[2] in CLIP_METRICS for k in plain)
    assert json.loads((plain_folder / "report.json").read_text())["clip"] is None
    assert "Comparable scores" not in (plain_folder / "summary.md").read_text()
    with (plain_folder / "plots" / "adherence.csv").open() as fh:
        assert "clip_text" not in next(csv.reader(fh))
    a, b = out["a"][0], out["b"][0]  # the samples reused, the scores read again with B: not A's stale ones
    assert all(a[f"{n}/motion"] == b[f"{n}/motion"] for n in ("teacher_2", "student_1"))  # the frames' own
    assert all(a[f"{n}/clip_text"] != b[f"{n}/clip_text"] for n in ("teacher_2", "student_1"))
    report = out["b"][1]
    frames = _cached_frames(cache, report, "student_1")
    row = report["per_video"]["student_1"][0]
    want = reference_scores(clips[1], frames[row["sample"]], PROMPTS[row["prompt"]])
    assert {k: row[k] for k in CLIP_SCORES} == pytest.approx(want, abs=1e-5)


def test_off_the_clips_grammar_the_summary_points_at_the_clip_score():
    """Issue 44 item 3's other half: with a CLIP model, one's own prompts have a text score that applies."""
    from distillery.evaluation.summary import summary_markdown
    from distillery.evaluation.video_scores import METRIC_NAMES

    metrics = {f"own_4/{k}": 0.5 for k in (*METRIC_NAMES, *CLIP_METRICS)}
    report = {"reference": "own_4", "prompts": ["a dog on a beach"], "num_seeds": 1,
              "candidates": [{"name": "own_4", "forwards": {"per_video": 4, "chunks": 1, "per_chunk": 4, "cache_writes": 0}}],
              "adherence": {"applicable": False, "why": "0 of 1 prompts are captions of the synthetic clips' grammar"}}
    assert "CLIP text similarity" not in summary_markdown(metrics, report)
    text = summary_markdown(metrics, {**report, "clip": {"folder": "/models/clip"}})
    assert "Compare the candidates on CLIP text similarity (below), Fréchet" in text
    assert "| own_4 | 0.5000 [0.5000, 0.5000] | 0.5000 [0.5000, 0.5000] | 500.00 [500.00, 500.00] |" in text


def test_the_validate_artifacts_lineage_pins_the_clip_folder():
    from stages.validate import validation_inputs

    plain = validation_inputs()
    assert all(role != "clip_model" for role, _ in plain)
    assert validation_inputs(clip_model="/models/clip") == [*plain, ("clip_model", Path("/models/clip"))]
