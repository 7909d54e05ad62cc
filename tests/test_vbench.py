"""Issue 65: VBench's quality dimensions, quality score and protocols (``distillery.evaluation.vbench``) on tiny random
models of the real classes — transformers' ViT and CLIP, our RAFT, AMT-S and MUSIQ at their published sizes, a small
ViCLIP — loaded from folders as a user names them; ``distillery vbench`` end to end; bad input is one line and exit 2
with nothing written. (Equality with vbench's own code: ``test_vbench_faithfulness.py``.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from distillery.cli.main import main
from distillery.common.errors import UserError
from distillery.evaluation.vbench import score as vscore
from distillery.evaluation.vbench.protocol import SELF_FORCING_EXTENDED_SHA256, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent / "vbench_faithfulness"))
import common  # noqa: E402
from test_clip_scores import make_clip_folder  # noqa: E402

PROMPTS = ["a red square moving to the right", "a quiet room with a lamp"]


def tiny_frames(n: int = 5) -> np.ndarray:
    return common.clip_moving_square()[:n]


MODEL_KEYS = ("dino", "clip_b32", "clip_l14", "aesthetic", "amt", "raft", "musiq", "viclip")


def write_model_folders(root: Path, keys: tuple[str, ...] = MODEL_KEYS) -> dict[str, str]:
    """The folders of ``keys``, as a user lays them out, holding tiny or published-size random weights (``common.fill``:
    scaled like an initialisation, so that the flows and interpolations stay finite)."""
    from transformers import ViTModel

    from distillery.evaluation.vbench.amt import AMTS
    from distillery.evaluation.vbench.dino import dino_vit_config
    from distillery.evaluation.vbench.musiq import MUSIQ
    from distillery.evaluation.vbench.raft import RAFT
    from distillery.evaluation.vbench.viclip import ViCLIP

    torch.manual_seed(0)
    folders = {k: root / k for k in keys}
    if "dino" in keys:
        ViTModel(dino_vit_config(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, intermediate_size=128),
                 add_pooling_layer=False).save_pretrained(folders["dino"])
    if "clip_b32" in keys:
        make_clip_folder(folders["clip_b32"], 1, image_size=224, patch_size=32)
    if "clip_l14" in keys:
        make_clip_folder(folders["clip_l14"], 2, image_size=224, patch_size=32)
    for key, module, name, wrap in (("aesthetic", lambda: torch.nn.Linear(8, 1), "sa_0_4_vit_l_14_linear.pth", None),
                                    ("amt", AMTS, "amt-s.pth", "state_dict"),
                                    ("raft", RAFT, "raft-things.pth", None),
                                    ("musiq", MUSIQ, "musiq_spaq_ckpt-358bb6af.pth", "params"),
                                    ("viclip", lambda: ViCLIP("tiny"), "ViClip-InternVid-10M-FLT.pth", "model")):
        if key not in keys:
            continue
        folders[key].mkdir()
        shapes = {k: list(v.shape) for k, v in module().state_dict().items()}
        state = {k: torch.from_numpy(v) for k, v in common.fill(shapes, 1).items()}
        if key == "raft":
            state = {f"module.{k}": v for k, v in state.items()}  # the published file's DataParallel prefix
        torch.save({wrap: state} if wrap else state, folders[key] / name)
    if "viclip" in keys:
        common.write_bpe(folders["viclip"] / "bpe_simple_vocab_16e6.txt.gz", PROMPTS)
    return {k: str(v) for k, v in folders.items()}


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory) -> dict[str, str]:
    """Every model key's folder (:func:`write_model_folders`)."""
    return write_model_folders(tmp_path_factory.mktemp("vbench-models"))


@pytest.fixture(scope="module")
def scorer(model_folders):
    from distillery.evaluation.vbench.dimensions import VBenchScorer

    return VBenchScorer(model_folders, vscore.COMPUTED)


@pytest.mark.slow  # published-size RAFT, AMT-S and MUSIQ on the CPU: about a minute
def test_every_dimension_scores_a_clip_in_its_range(scorer):
    rows = scorer.score(tiny_frames(), 16.0, PROMPTS[0], vscore.COMPUTED, "clip-0")
    got = {r.dimension: r.value for r in rows}
    assert set(got) == set(vscore.COMPUTED)
    for d in ("subject_consistency", "background_consistency", "temporal_flickering", "motion_smoothness"):
        assert 0.0 <= got[d] <= 1.0, (d, got[d])
    assert got["dynamic_degree"] in (0.0, 1.0)
    assert all(np.isfinite(v) for v in got.values())
    assert {r.dimension: r.weight for r in rows}["subject_consistency"] == 4.0  # T - 1 frame pairs
    # a still video is perfectly consistent and does not flicker; the same clip scores the same again
    still = np.repeat(tiny_frames(1), 5, axis=0)
    cheap = ("subject_consistency", "background_consistency", "temporal_flickering")
    again = {r.dimension: r.value for r in scorer.score(still, 16.0, PROMPTS[0], cheap, "still")}
    assert again["temporal_flickering"] == 1.0
    assert again["subject_consistency"] == pytest.approx(1.0, abs=1e-6)
    assert again["background_consistency"] == pytest.approx(1.0, abs=1e-6)
    assert not scorer.published  # tiny models: recorded as not VBench's
    assert scorer.describe()["musiq"]["published_architecture"] is False  # random weights: digest not IQA-PyTorch's


def test_aggregate_weighs_consistency_by_frame_pairs_and_scales_imaging_quality():
    from distillery.evaluation.vbench.dimensions import VideoScore, aggregate

    rows = [VideoScore("a", "subject_consistency", 0.9, 16), VideoScore("b", "subject_consistency", 0.5, 4),
            VideoScore("a", "imaging_quality", 60.0), VideoScore("b", "imaging_quality", 40.0),
            VideoScore("a", "dynamic_degree", 1.0), VideoScore("b", "dynamic_degree", 0.0)]
    got = aggregate(rows)
    assert got["subject_consistency"] == pytest.approx((0.9 * 16 + 0.5 * 4) / 20)
    assert got["imaging_quality"] == pytest.approx(0.5) and got["dynamic_degree"] == 0.5


def test_quality_score_is_vbench_normalisation_and_weights():
    best = {d: vscore.NORMALIZE[d][1] for d in vscore.QUALITY}
    assert vscore.quality_score(best) == pytest.approx(1.0)
    worst = {d: vscore.NORMALIZE[d][0] for d in vscore.QUALITY}
    assert vscore.quality_score(worst) == pytest.approx(0.0)
    raw = {"subject_consistency": 0.95, "background_consistency": 0.96, "temporal_flickering": 0.98,
           "motion_smoothness": 0.985, "aesthetic_quality": 0.6, "imaging_quality": 0.68, "dynamic_degree": 0.6}
    by_hand = ((0.95 - 0.1462) / 0.8538 + (0.96 - 0.2615) / 0.7385 + (0.98 - 0.6293) / 0.3707
               + (0.985 - 0.706) / 0.2915 + 0.6 + 0.68 + 0.5 * 0.6) / 6.5
    assert vscore.quality_score(raw) == pytest.approx(by_hand)
    assert vscore.total_score(0.85, 0.80) == pytest.approx(0.84)
    with pytest.raises(ValueError, match="all 7"):
        vscore.quality_score({"subject_consistency": 1.0})
    out = vscore.scores({**raw, "overall_consistency": 0.25})
    assert out["overall_consistency_normalised"] == pytest.approx(0.25 / 0.364)
    assert "semantic_score" not in out and "total_score" not in out


def test_protocols_choose_and_record_their_videos(tmp_path):
    standard = Protocol("vbench_standard")
    quality_only = Protocol("vbench_standard", dimensions=vscore.QUALITY)
    from distillery.evaluation.vbench.protocol import load_suite

    assert len(quality_only.entries) == 326  # the quality dimensions' prompts of VBench's 946
    assert len(standard.entries) == sum(1 for e in load_suite() if set(e["dimension"]) & set(vscore.COMPUTED))
    assert standard.comparable and len(standard.videos()) == 5 * len(standard.entries)
    assert standard.videos()[0].name.endswith("-0") and standard.videos()[4].name.endswith("-4")
    full = Protocol("vbench_standard", dimensions=("temporal_flickering",))
    rewrites = tmp_path / "extended.txt"
    suite_lines = 946
    rewrites.write_text("\n".join(f"a longer prompt number {i}" for i in range(suite_lines)) + "\n")
    extended = Protocol("vbench_extended", dimensions=("temporal_flickering",), extended_prompts=str(rewrites))
    assert [e.prompt for e in extended.entries] == [e.prompt for e in full.entries]  # scored against VBench's prompts
    assert extended.entries[0].sampled.startswith("a longer prompt number")
    assert not extended.comparable and extended.prompts_sha256 != SELF_FORCING_EXTENDED_SHA256
    assert not Protocol("vbench_standard", seeds_per_prompt=2).comparable
    custom = Protocol("custom", custom_prompts=PROMPTS, seeds_per_prompt=1)
    assert not custom.comparable and [v.name for v in custom.videos()] == [f"{p}-0" for p in PROMPTS]
    rewrites.write_text("one line\n")
    with pytest.raises(UserError, match="has 1 lines"):
        Protocol("vbench_extended", extended_prompts=str(rewrites))
    with pytest.raises(UserError, match="valid: vbench_standard"):
        Protocol("vbench_long")


def test_dino_checkpoint_and_transformers_folder_give_the_same_features(tmp_path):
    from distillery.evaluation.vbench.consistency import subject_consistency
    from distillery.evaluation.vbench.models import check_folders, load_model

    shapes = {"cls_token": [1, 1, 64], "pos_embed": [1, 197, 64], "patch_embed.proj.weight": [64, 3, 16, 16],
              "patch_embed.proj.bias": [64], "norm.weight": [64], "norm.bias": [64]}
    for part, shape in (("norm1.weight", [64]), ("norm1.bias", [64]), ("attn.qkv.weight", [192, 64]), ("attn.qkv.bias", [192]),
                        ("attn.proj.weight", [64, 64]), ("attn.proj.bias", [64]), ("norm2.weight", [64]), ("norm2.bias", [64]),
                        ("mlp.fc1.weight", [256, 64]), ("mlp.fc1.bias", [256]), ("mlp.fc2.weight", [64, 256]), ("mlp.fc2.bias", [64])):
        shapes[f"blocks.0.{part}"] = shape
    state = {k: torch.from_numpy(v) for k, v in common.fill(shapes, 3).items()}
    (tmp_path / "pth").mkdir()
    torch.save(state, tmp_path / "pth" / "dino_vitbase16_pretrain.pth")
    from_pth = load_model("dino", check_folders({"dino": str(tmp_path / "pth")}, ["subject_consistency"])["dino"], torch.device("cpu"))
    from_pth.module.save_pretrained(tmp_path / "hf")
    from_hf = load_model("dino", tmp_path / "hf", torch.device("cpu"))
    frames = tiny_frames()
    assert subject_consistency(from_pth.module, frames, "cpu") == subject_consistency(from_hf.module, frames, "cpu")
    assert not from_pth.published and set(from_pth.files) == {"dino_vitbase16_pretrain.pth"}


def test_clip_bpe_tokenizes_as_clip(tmp_path):
    from distillery.evaluation.vbench.bpe import ClipBPE

    bpe = ClipBPE(common.write_bpe(tmp_path / "bpe.txt.gz", PROMPTS))
    ids = bpe.tokenize("A  red&amp;square!", 8)
    assert ids[0] == bpe.encoder["<|startoftext|>"] and bpe.encoder["<|endoftext|>"] in ids and len(ids) == 8
    assert bpe.encode("A  red&amp;square!") == bpe.encode("a red&square!")  # cleaned, lower-cased
    long = bpe.tokenize(" ".join(["square"] * 40), 8)
    assert len(long) == 8 and long[-1] == bpe.encoder["<|endoftext|>"] and 0 not in long


def write_videos(folder: Path, prompts: list[str], frames: int = 5) -> None:
    from distillery.clips.video_io import write_video

    for i, p in enumerate(prompts):
        write_video(folder / f"{p}-0.mp4", np.roll(tiny_frames(frames), i, axis=2), 16.0)


def config_file(tmp_path: Path, models: dict[str, str], **extra) -> Path:
    cfg = {"protocol": "custom", "prompts": PROMPTS, "seeds_per_prompt": 1, "models": models, **extra}
    path = tmp_path / "vbench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow  # the whole command on two videos, every model loaded
def test_cli_scores_a_folder_and_sets_the_published_rows_beside_ours(tmp_path, model_folders, capsys):
    videos = tmp_path / "videos"
    write_videos(videos, PROMPTS)
    cfg = config_file(tmp_path, model_folders)
    assert main(["vbench", "prompts", "--config", str(cfg)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{p}-0\t0\t{p}" for p in PROMPTS]
    assert main(["vbench", "score", "--config", str(cfg), "--videos", str(videos), "--out", str(tmp_path / "out"),
                 "--candidate", "student"]) == 0
    report = json.loads((tmp_path / "out" / "vbench.json").read_text())
    assert set(report["dimensions"]) == set(vscore.COMPUTED) and report["videos"] == 2
    assert report["quality_score"] is not None and not report["comparable"]
    assert "protocol custom is not comparable" in report["not_comparable_because"]
    assert report["models"]["raft"]["files"]["raft-things.pth"] == __import__("hashlib").sha256(
        (Path(model_folders["raft"]) / "raft-things.pth").read_bytes()).hexdigest()
    table = (tmp_path / "out" / "vbench.md").read_text()
    assert "| Self-Forcing (chunk-wise, 4-step) | 84.31 | 85.07 | 81.28 | vbench_extended |" in table
    assert "FastGen DMD2, 4-step | 84.72 | 85.86 | 80.15" in table and f"| student | | {report['quality_score']:.2f} |" in table
    lines = (tmp_path / "out" / "videos.jsonl").read_text().splitlines()
    assert len(lines) == 2 * len(vscore.COMPUTED)


@pytest.fixture(scope="module")
def amt_folder(tmp_path_factory) -> Path:
    """One real checkpoint (AMT-S, random weights) for the refusals, which need no other model."""
    from distillery.evaluation.vbench.amt import AMTS

    folder = tmp_path_factory.mktemp("amt")
    torch.save({"state_dict": AMTS().state_dict()}, folder / "amt-s.pth")
    return folder


def _bad_cases(tmp_path: Path, amt: Path):
    wrong = tmp_path / "wrong-raft"
    wrong.mkdir()
    (wrong / "raft-things.pth").write_bytes((amt / "amt-s.pth").read_bytes())
    corrupt = tmp_path / "corrupt-musiq"
    corrupt.mkdir()
    (corrupt / "musiq_spaq_ckpt-358bb6af.pth").write_bytes(b"not a checkpoint")
    return {  # (models, the config's dimensions and other settings, video frames, the line expected)
        "missing model": ({"amt": str(amt)}, {"dimensions": ["subject_consistency", "motion_smoothness"]}, 5,
                          "models.dino is not set: the dino model is needed; get DINO ViT-B/16"),
        "missing folder": ({"amt": str(tmp_path / "nowhere")}, {"dimensions": ["motion_smoothness"]}, 5,
                           "does not exist or is not a folder"),
        "wrong class": ({"raft": str(wrong)}, {"dimensions": ["dynamic_degree"]}, 5, "is not a RAFT checkpoint"),
        "corrupt file": ({"musiq": str(corrupt)}, {"dimensions": ["imaging_quality"]}, 5, "cannot read"),
        "too short": ({"amt": str(amt)}, {"dimensions": ["motion_smoothness"]}, 2, "vbench motion_smoothness: video"),
        "bad protocol": ({"amt": str(amt)}, {"dimensions": ["motion_smoothness"], "protocol": "vbench_extended"}, 5,
                         "needs vbench.extended_prompts"),
        "unknown key": ({"amt": str(amt)}, {"promtps": []}, 5, "unknown key 'promtps'"),
        "unknown model": ({"amt": str(amt), "dinov2": "x"}, {"dimensions": ["motion_smoothness"]}, 5, "unknown model key 'dinov2'"),
    }


@pytest.mark.parametrize("case", ["missing model", "missing folder", "wrong class", "corrupt file", "too short", "bad protocol",
                                  "unknown key", "unknown model"])
def test_cli_refuses_bad_input_in_one_line_and_writes_nothing(case, tmp_path, amt_folder, capsys):
    models, cfg, frames, message = _bad_cases(tmp_path, amt_folder)[case]
    videos = tmp_path / "videos"
    write_videos(videos, PROMPTS, frames=frames)
    out = tmp_path / "out"
    argv = ["vbench", "score", "--config", str(config_file(tmp_path, models, **cfg)), "--videos", str(videos), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
