"""Validate's sample cache: an unchanged candidate is reused with bitwise-equal metrics; a changed one
(one weight byte, one sampling setting) or a bad cache entry is always sampled again, and the log says which."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from distillery.evaluation.candidates import Candidate
from distillery.evaluation.sample_cache import SampleCache
from distillery.evaluation.validate import run_validation
from distillery.evaluation.validation_config import ValidationConfig
from distillery.tinybase.shipped import shipped_tiny_base

PROMPTS = ["a red circle moving left slowly on a black background", "a blue square moving up quickly on a black background"]
CFG = ValidationConfig(num_seeds=2, progress_bar=False, grid_formats=["gif"], bootstrap_resamples=20)
WEIGHTS = Path("transformer") / "diffusion_pytorch_model.safetensors"


def _student_folder(base: Path, where: Path) -> Path:
    """A model folder as the training stages publish one: transformer/ + scheduler/ (the base supplies the rest)."""
    for part in ("transformer", "scheduler"):
        shutil.copytree(base / part, where / part)
    return where


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample-cache")
    base = shipped_tiny_base()
    student = _student_folder(base, root / "student")
    cands = [Candidate("teacher_2", base, 2, 4.0, "euler"), Candidate("student_1", student, 1, 1.0, "few_step_x0")]
    cache = SampleCache(root / "cache")
    first = run_validation(base, cands, PROMPTS, root / "first", CFG, cache=cache)
    return root, base, student, cands, cache, first


def _run(setup, name: str, cands=None, caplog=None, cfg: ValidationConfig = CFG):
    root, base, _, default, cache, _ = setup
    with caplog.at_level(logging.INFO, logger="distillery") if caplog is not None else contextlib.nullcontext():
        metrics = run_validation(base, cands or default, PROMPTS, root / name, cfg, cache=cache)
    report = json.loads((root / name / "report.json").read_text())
    return metrics, {c: v["reused"] for c, v in report["cache"].items() if c != "folder"}, report


def test_an_unchanged_candidate_is_reused_with_bitwise_equal_results(setup, caplog):
    root, *_, first = setup
    metrics, reused, report = _run(setup, "again", caplog=caplog)
    assert reused == {"teacher_2": True, "student_1": True}
    assert metrics == first  # every number, latency included (measured when it was sampled)
    for name in ("teacher_2", "student_1"):
        for f in sorted((root / "first" / "samples" / name).iterdir()):
            assert (root / "again" / "samples" / name / f.name).read_bytes() == f.read_bytes(), f
    before = json.loads((root / "first" / "report.json").read_text())
    assert report["per_video"] == before["per_video"] and report["per_prompt"] == before["per_prompt"]
    assert (root / "again" / "grid.gif").read_bytes() == (root / "first" / "grid.gif").read_bytes()
    assert "reusing 2 of 2 candidates' samples" in caplog.text and "sampling 0" in caplog.text
    # issue 44 item 7: a reused latency says when and beside what load it was measured — the first run's
    for name in ("teacher_2", "student_1"):
        then, now = before["latency"][name]["measured"], report["latency"][name]["measured"]
        assert then["reused"] is False and isinstance(then["load_1min"], float) and then["cpus"] >= 1
        assert now["reused"] is True and then["at"] <= now["at"]  # the entry's time: stored after its sampling began
        assert {k: now[k] for k in ("load_1min", "cpus")} == {k: then[k] for k in ("load_1min", "cpus")}


def test_one_flipped_weight_byte_is_sampled_again_even_with_its_mtime_restored(setup, caplog, tmp_path, monkeypatch):
    root, _, student, *_ = setup
    monkeypatch.setenv("DISTILLERY_HASH_CACHE", str(tmp_path / "hash_cache.json"))  # the stages' cache, trusting mtime
    from distillery.common.hashcache import file_sha256, flush_active

    weights = student / WEIGHTS
    file_sha256(weights)
    flush_active()  # the workspace hash cache knows the old bytes
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    original = bytes(data)
    data[-1] ^= 0x01  # the high byte of the last float32 weight: its exponent
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as before
    try:
        metrics, reused, report = _run(setup, "flipped", caplog=caplog)
    finally:
        weights.write_bytes(original)
    assert reused == {"teacher_2": True, "student_1": False}
    assert report["cache"]["student_1"]["why"] == "changed: candidate.model_files.transformer/diffusion_pytorch_model.safetensors"
    assert "student_1 (changed: candidate.model_files.transformer/diffusion_pytorch_model.safetensors)" in caplog.text
    latents = Path("samples") / "student_1" / "latents.safetensors"
    assert (root / "flipped" / latents).read_bytes() != (root / "first" / latents).read_bytes()  # the changed weights sampled
    assert metrics["teacher_2/sharpness"] == setup[-1]["teacher_2/sharpness"]


def test_a_changed_sampling_setting_is_sampled_again(setup, caplog):
    _, base, student, cands, *_ = setup
    more = [cands[0], Candidate("student_1", student, 1, 1.0, "few_step_x0", timesteps=(900.0,))]
    _, reused, report = _run(setup, "ladder", more, caplog=caplog)
    assert reused == {"teacher_2": True, "student_1": False}
    assert "candidate.timesteps" in report["cache"]["student_1"]["why"]  # (against the last stored student_1)
    _, reused, _ = _run(setup, "guidance", [Candidate("teacher_2", base, 2, 3.0, "euler"), cands[1]], caplog=caplog)
    assert reused == {"teacher_2": False, "student_1": True}  # the reference changed: the others' distances follow it


@pytest.mark.parametrize("damage", ["flip_frames", "edit_score", "swap_entries", "link"])
def test_a_bad_cache_entry_is_never_used(setup, caplog, damage):
    root, _, _, _, cache, first = setup
    report = json.loads((root / "first" / "report.json").read_text())
    entry = cache.root / report["cache"]["student_1"]["key"]
    other = cache.root / report["cache"]["teacher_2"]["key"]
    saved = root / f"saved-{damage}"
    shutil.copytree(entry, saved)
    try:
        if damage == "flip_frames":
            data = bytearray((entry / "frames.safetensors").read_bytes())
            data[-1] ^= 0x01
            (entry / "frames.safetensors").write_bytes(bytes(data))
        elif damage == "edit_score":  # a score made better in entry.json, nothing else touched
            doc = json.loads((entry / "entry.json").read_text())
            doc["videos"][0]["scores"]["all"] = not doc["videos"][0]["scores"]["all"]
            (entry / "entry.json").write_text(json.dumps(doc))
        elif damage == "swap_entries":  # another candidate's entry under this key
            shutil.rmtree(entry)
            shutil.copytree(other, entry)
        else:  # a link to another entry where this one was
            shutil.rmtree(entry)
            entry.symlink_to(other)
        metrics, reused, report = _run(setup, f"bad-{damage}", caplog=caplog)
        assert reused == {"teacher_2": True, "student_1": False}
        assert metrics == {**first, "student_1/latency_s": metrics["student_1/latency_s"],
                           "student_1/latency_s_iqr": metrics["student_1/latency_s_iqr"]}  # sampled again: the same videos
        assert "student_1's cached samples in" in caplog.text and "are not used" in caplog.text
        assert report["cache"]["student_1"]["why"].startswith("unusable entry: ")
        assert entry.is_dir() and not entry.is_symlink()  # the fresh entry replaced it
        if damage == "flip_frames":
            _, reused, _ = _run(setup, f"fixed-{damage}", caplog=caplog)
            assert reused == {"teacher_2": True, "student_1": True}
    finally:
        if entry.is_symlink():
            entry.unlink()
        shutil.rmtree(entry, ignore_errors=True)
        shutil.copytree(saved, entry)


def _tensors(setup, run: str, candidate: str, what: str) -> dict:
    """``latents`` or ``frames`` of a candidate in a run, from the cache entry the run's report names."""
    from safetensors.torch import load_file

    root, cache = setup[0], setup[4]
    key = json.loads((root / run / "report.json").read_text())["cache"][candidate]["key"]
    return load_file(str(cache.root / key / f"{what}.safetensors"))


def test_a_bf16_vae_decodes_the_same_latents_to_nearby_frames_under_its_own_cache_key(setup):
    """``vae_precision: bf16``: every candidate is sampled again (the decoded frames are not fp32's), its latents are
    bitwise the fp32 run's (the VAE only decodes), its frames within a few grey levels of them; fp32 again reuses."""
    import dataclasses

    import torch

    _, reused, report = _run(setup, "vae-bf16", cfg=dataclasses.replace(CFG, vae_precision="bf16"))
    assert reused == {"teacher_2": False, "student_1": False}
    assert "context.vae_dtype" in report["cache"]["teacher_2"]["why"], report["cache"]["teacher_2"]["why"]
    assert report["latency"]["vae_dtype"] == "torch.bfloat16" and report["latency"]["dtype"] == "torch.float32"
    for name in ("teacher_2", "student_1"):
        fp32, bf16 = (_tensors(setup, run, name, "latents") for run in ("first", "vae-bf16"))
        assert fp32.keys() == bf16.keys() and all(torch.equal(fp32[k], bf16[k]) for k in fp32)
        fp32, bf16 = (_tensors(setup, run, name, "frames") for run in ("first", "vae-bf16"))
        diffs = [(fp32[k].int() - bf16[k].int()).abs() for k in fp32]
        assert any(d.max() > 0 for d in diffs)  # decoded in bf16 indeed
        assert max(float(d.float().mean()) for d in diffs) < 1.0 and max(int(d.max()) for d in diffs) <= 8  # seen: 0.36, 3
    _, reused, _ = _run(setup, "vae-fp32-again")
    assert reused == {"teacher_2": True, "student_1": True}
    with pytest.raises(Exception, match="vae_precision"):
        ValidationConfig(vae_precision="fp8")


@pytest.mark.process
def test_compiled_blocks_sample_what_eager_does_up_to_rounding_under_their_own_cache_key(setup):
    """``compile: true`` (each transformer block compiled by Inductor, here on CPU): sampled again under its own key,
    latents within rounding of the eager run's; report.json says so."""
    import dataclasses

    import torch
    from torch._dynamo.utils import counters

    counters.clear()
    _, reused, report = _run(setup, "compiled", cfg=dataclasses.replace(CFG, compile=True, grid_formats=[]))
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo compiled the blocks' forward
    assert reused == {"teacher_2": False, "student_1": False}
    assert "context.compiled" in report["cache"]["student_1"]["why"], report["cache"]["student_1"]["why"]
    assert report["latency"]["compiled"] is True
    for name in ("teacher_2", "student_1"):
        eager, compiled = (_tensors(setup, run, name, "latents") for run in ("first", "compiled"))
        for k in eager:
            assert torch.allclose(eager[k], compiled[k], atol=1e-4, rtol=1e-4), (name, k, (eager[k] - compiled[k]).abs().max())
