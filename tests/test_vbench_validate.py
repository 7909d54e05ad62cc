"""Issue 65 item 3: VBench's dimensions in the validate stage (``validate.vbench``): typed params, off by default, what
can be known refused in one line before any work, and the headline candidates' validation videos — sampled, or
reused from the sample cache — scored as ``distillery vbench score`` scores a folder, their numbers in the report and
the metrics. (The stage in the DAG, rerun with VBench on: ``tests/test_pipeline.py``.)"""

from __future__ import annotations

import dataclasses
import json
import shutil
import typing
from pathlib import Path

import pytest
import yaml
from test_vbench import write_model_folders
from workspace import project_log

from distillery.common.errors import UserError
from distillery.evaluation.candidates import Candidate
from distillery.evaluation.sample_cache import SampleCache
from distillery.evaluation.validate import run_validation
from distillery.evaluation.validation_config import ValidationConfig
from distillery.evaluation.vbench import validation as vbench
from distillery.evaluation.vbench.models import WHERE
from distillery.evaluation.vbench.score import COMPUTED
from distillery.pipeline.params.loading import validate_params
from distillery.pipeline.params.schema import VBenchDimension, VBenchModelsParams
from distillery.tinybase.shipped import shipped_tiny_base

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red circle moving left slowly on a black background"]
CFG = dict(num_seeds=2, progress_bar=False, grid_formats=["gif"], bootstrap_resamples=20)
# the dimensions that read 32×32 videos (the optical flows of motion smoothness and dynamic degree need >= 113 pixels)
SMALL = ["subject_consistency", "background_consistency", "temporal_flickering", "aesthetic_quality", "overall_consistency"]
SMALL_MODELS = ("dino", "clip_b32", "clip_l14", "aesthetic", "viclip")


def _params(**vbench) -> dict:
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["validate"]["vbench"] = {**data["validate"]["vbench"], **vbench}
    return data


def test_params_are_typed_off_by_default_and_name_what_is_wrong():
    shipped = validate_params(yaml.safe_load((ROOT / "params.yaml").read_text()))
    assert shipped.validate.vbench.dimensions == [] and shipped.validate.vbench.models.given() == {}  # off: the DAG unchanged
    assert typing.get_args(VBenchDimension) == COMPUTED  # the schema's names are the computed dimensions
    assert [f.name for f in dataclasses.fields(VBenchModelsParams)] == list(WHERE)  # one key per model
    typed = validate_params(_params(dimensions=["subject_consistency"], models={"dino": "/models/dino"}))
    assert typed.validate.vbench.dimensions == ["subject_consistency"]
    assert typed.validate.vbench.models.given() == {"dino": "/models/dino"}
    for vb, said in (({"dimensions": ["subject_consistancy"]}, "validate.vbench.dimensions"),
                     ({"dimensions": ["dynamic_degree", "dynamic_degree"]}, "'dynamic_degree' is listed twice"),
                     ({"models": {"dinov2": "/m"}}, "validate.vbench.models.dinov2"),
                     ({"dimensions": "subject_consistency"}, "expected a list")):
        with pytest.raises(UserError) as err:
            validate_params(_params(**vb))
        assert "\n" not in str(err.value) and said in str(err.value), str(err.value)
    with pytest.raises(UserError, match="valid values: subject_consistency, background_consistency"):
        validate_params(_params(dimensions=["subject_consistancy"]))


def test_a_missing_model_stops_the_first_stage_and_params_check_in_one_line(tmp_path, monkeypatch, capsys):
    """Through the real parser and its error guard: exit 2, one line, nothing written — before the first stage works."""
    from distillery.cli.guard import run_guarded
    from distillery.cli.main import build_parser

    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.chdir(ws)
    for vb, said in (({"dimensions": ["subject_consistency"]}, "validate.vbench.models.dino is not set: the dino model is "
                                                              "needed; get DINO ViT-B/16"),
                     ({"dimensions": ["motion_smoothness"], "models": {"amt": str(tmp_path / "nowhere")}},
                      "validate.vbench.models.amt: " + str(tmp_path / "nowhere") + " does not exist or is not a folder")):
        (ws / "params.yaml").write_text(yaml.safe_dump(_params(**vb), sort_keys=False))
        for command in (["stage", "clips", "--params", "params.yaml"], ["stage", "validate", "--params", "params.yaml"],
                        ["params", "check"]):
            ns = build_parser().parse_args(command)
            capsys.readouterr()
            rc = run_guarded(lambda ns=ns: ns.func(ns))
            lines = capsys.readouterr().err.strip().splitlines()
            assert rc == 2 and len(lines) == 1, (command, lines)
            assert lines[0].startswith("error: params.yaml: validate.vbench.models") and said in lines[0], lines
        assert sorted(p.name for p in ws.iterdir()) == ["params.yaml"]  # nothing written before the check


def test_videos_a_dimension_cannot_read_and_a_wrong_checkpoint_are_refused_before_sampling(tmp_path):
    import torch

    amt = tmp_path / "amt"
    amt.mkdir()
    (amt / "amt-s.pth").write_bytes(b"")  # the checks before loading read no weights
    with pytest.raises(UserError, match=r"vbench motion_smoothness: video of validate \(17 frames of 32×32, the latents'\) "
                                        r"is 32×32; its optical flow needs frames of at least 113 pixels"):
        vbench.check(["motion_smoothness"], {"amt": str(amt)}, 17, 32, 32)
    with pytest.raises(UserError, match="needs at least 3"):
        vbench.check(["motion_smoothness"], {"amt": str(amt)}, 1, 128, 128)
    assert vbench.check(["motion_smoothness"], {"amt": str(amt)}, 17, 128, 128) == {"amt": amt}
    raft = tmp_path / "raft"
    raft.mkdir()
    torch.save({"weight": torch.zeros(1, 8)}, raft / "raft-things.pth")  # another model's tensors under RAFT's name
    with pytest.raises(UserError, match="validate.vbench.models.raft: .* is not a RAFT checkpoint"):
        vbench.load(["dynamic_degree"], {"raft": str(raft)})


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """Two candidates validated twice with one sample cache (the second run reuses both), each run's headline
    candidates' videos then scored on the dimensions 32×32 videos allow, with tiny models of the real classes."""
    root = tmp_path_factory.mktemp("vbench-validate")
    models = write_model_folders(root / "models", SMALL_MODELS)
    base = shipped_tiny_base()
    cands = [Candidate("teacher_2", base, 2, 4.0, "euler"), Candidate("student_1", base, 1, 1.0, "few_step_x0")]
    cache = SampleCache(root / "cache")
    runs = []
    for name in ("sampled", "reused"):
        folders = vbench.check(SMALL, models, 17, 32, 32)
        scorer = vbench.load(SMALL, {k: str(v) for k, v in folders.items()})
        out = root / name
        metrics = run_validation(base, cands, PROMPTS, out, ValidationConfig(**CFG), cache=cache)
        shown = vbench.score_candidates(scorer, out, [c.name for c in cands], "cpu")
        runs.append((metrics, shown, out, json.loads((out / "report.json").read_text())))
    return runs, models, scorer


def test_the_headline_videos_are_scored_as_vbench_scores_their_files(scored):
    from distillery.clips.video_io import read_video

    runs, models, scorer = scored
    metrics, shown, out, report = runs[0]
    assert set(shown) == {f"{c}/vbench_{d}" for c in ("teacher_2", "student_1") for d in SMALL}  # no quality score: 5 of 7
    written = json.loads((out / "metrics.json").read_text())
    assert {k: written[k] for k in shown} == shown and {k: written[k] for k in metrics} == metrics  # every metric, one file
    results = json.loads((out / "vbench" / "vbench.json").read_text())["candidates"]
    assert [r["candidate"] for r in results] == ["teacher_2", "student_1"]
    for r in results:
        assert r["protocol"]["name"] == "custom" and r["protocol"]["videos_from"].startswith("validate")
        assert r["videos"] == len(PROMPTS) * CFG["num_seeds"] and not r["comparable"] and r["quality_score"] is None
        assert set(r["models"]) == set(SMALL_MODELS) and all(m["folder"] == models[k] for k, m in r["models"].items())
    rows = [json.loads(line) for line in (out / "vbench" / "videos.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * len(PROMPTS) * CFG["num_seeds"] * len(SMALL)
    for cand in ("teacher_2", "student_1"):  # each number is the dimension's aggregate of its videos' own scores
        for i, prompt in enumerate(PROMPTS):
            for j in range(CFG["num_seeds"]):
                key = report["sample_keys"][i][j]
                frames, fps = read_video(out / "samples" / cand / f"{key}.mp4")
                want = {s.dimension: s.value for s in scorer.score(frames, fps, prompt, SMALL, key)}
                got = {r["dimension"]: r["value"] for r in rows if r["video"] == f"{cand}/{prompt}-{j}"}
                assert got == pytest.approx(want, abs=1e-6), (cand, key)
        mine = [r for r in rows if r["video"].startswith(f"{cand}/")]
        flicker = [r["value"] for r in mine if r["dimension"] == "temporal_flickering"]
        assert shown[f"{cand}/vbench_temporal_flickering"] == pytest.approx(100 * sum(flicker) / len(flicker), abs=1e-5)
    table = (out / "vbench" / "vbench.md").read_text()
    assert "| Self-Forcing (chunk-wise, 4-step) | 84.31 | 85.07 | 81.28 | vbench_extended |" in table
    assert "| teacher_2 | |  | | custom (2 videos) | ours, not comparable: protocol custom is not comparable" in table


def test_a_candidate_reused_from_the_sample_cache_is_scored_from_its_cached_videos(scored):
    runs, _, _ = scored
    (_, first, _, _), (_, second, _, report) = runs
    assert all(report["cache"][c]["reused"] for c in ("teacher_2", "student_1"))
    assert second == first  # its frames', bitwise: the same files decoded and scored again


def test_the_validate_artifacts_lineage_pins_the_vbench_models():
    from stages.validate import validation_inputs

    plain = validation_inputs()
    assert validation_inputs(vbench_models={"dino": Path("/models/dino"), "raft": Path("/models/raft")}) == [
        *plain, ("vbench_dino", Path("/models/dino")), ("vbench_raft", Path("/models/raft"))]



def test_a_candidate_whose_videos_are_as_they_were_is_not_scored_again(scored, tmp_path):
    """Issue 65 item 3, "cached per candidate like validate's": validate rerun (a change of its own params that leaves
    a headline candidate's videos as they were) keeps that candidate's VBench scores — bitwise its files' — and scores
    nothing again; a candidate with another video is scored again, the other kept; an entry edited without its seal,
    and the same videos on other model files, are scored again."""
    from distillery.evaluation.sample_cache import entry_key
    from distillery.evaluation.vbench.score_cache import ScoreCache, material
    from distillery.lineage.manifest import pin_input

    runs, models, scorer = scored
    _, first, out, report = runs[0]
    work, names = tmp_path / "report", ["teacher_2", "student_1"]
    shutil.copytree(out, work)
    files = {k: pin_input(v) for k, v in models.items()}
    cache = ScoreCache(tmp_path / "vbench_cache")

    def score() -> tuple[dict, str]:
        with project_log() as lines:
            shown = vbench.score_candidates(scorer, work, names, "cpu", cache=cache, models=files)
        return shown, "\n".join(lines)

    shown, said = score()
    assert shown == first and "VBench scores of 0 of 2 candidates reused" in said and "videos scored" in said
    assert len(list(cache.root.glob("*.json"))) == 2
    written = (work / "vbench" / "videos.jsonl").read_text()
    shown, said = score()  # validate rerun: the same videos
    assert shown == first and "VBench scores of 2 of 2 candidates reused" in said and "videos scored" not in said, said
    assert (work / "vbench" / "videos.jsonl").read_text() == written  # every video's score as it was read from its file

    key = report["sample_keys"][0][0]  # student_1 sampled again into other frames: its first video is teacher_2's now
    shutil.copy2(work / "samples" / "teacher_2" / f"{key}.mp4", work / "samples" / "student_1" / f"{key}.mp4")
    shown, said = score()
    assert "VBench scores of 1 of 2 candidates reused from" in said and "(teacher_2)" in said, said
    fresh = vbench.score_candidates(scorer, work, names, "cpu")  # no cache: every video read from its file
    assert shown == fresh and shown != first

    entry = next(p for p in cache.root.glob("*.json") if json.loads(p.read_text())["candidate"] == "teacher_2")
    data = json.loads(entry.read_text())
    data["rows"][0][2] += 0.5  # a score edited, its seal left
    entry.write_text(json.dumps(data))
    shown, said = score()
    assert shown == fresh and "teacher_2: VBench score cache entry" in said and "its seal does not match" in said, said
    assert "VBench scores of 1 of 2 candidates reused" in said  # student_1's kept

    videos = vbench_videos(work, "teacher_2", report)
    other = {**files, "dino": tuple({**f, "sha256": "0" * 64} for f in files["dino"])}
    assert entry_key(material(videos, other, "cpu")) != entry_key(material(videos, files, "cpu"))  # another model: another key
    with pytest.raises(ValueError, match="needs the files of every model scored"):
        vbench.score_candidates(scorer, work, names, "cpu", cache=cache, models={"dino": files["dino"]})


def vbench_videos(report_dir: Path, name: str, report: dict) -> list:
    """(video spec, mp4) of ``name``'s videos in ``report_dir`` as the validate stage scores them."""
    from distillery.evaluation.vbench.protocol import Protocol, VideoSpec

    protocol = Protocol("custom", tuple(SMALL), report["num_seeds"], custom_prompts=list(report["prompts"]))
    return [(VideoSpec(entry, j), report_dir / "samples" / name / f"{report['sample_keys'][entry.index][j]}.mp4")
            for entry in protocol.entries for j in range(protocol.seeds_per_prompt)]
