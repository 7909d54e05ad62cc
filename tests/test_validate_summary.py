"""Validate's summary.md decodes its numbers: a streaming student's NFE as chunks × forwards per chunk +
cache writes beside its latency, and which adherence readings discriminate between candidates."""

from __future__ import annotations

import json
from pathlib import Path

from distillery.evaluation.candidates import Candidate, forwards
from distillery.evaluation.summary import adherence_readings, summary_markdown
from distillery.evaluation.video_scores import METRIC_NAMES

STREAMING = {"sampler": "causal_streaming", "shift": 3.0, "num_train_timesteps": 1000,
             "timesteps": [1000.0, 900.0, 750.0, 500.0], "chunk_size": 1, "context_noise": 0.0, "renoise": "sde"}


def test_a_streaming_students_nfe_is_chunks_times_steps_plus_cache_writes(tmp_path):
    (tmp_path / "sampling.json").write_text(json.dumps(STREAMING))
    student = Candidate.from_artifact("distill_4", tmp_path)
    assert forwards(student, 5) == {"per_video": 24, "chunks": 5, "per_chunk": 4, "cache_writes": 4}  # the DAG's 5 latent frames
    teacher = Candidate("teacher_40", Path("unused"), 40, 4.0, "euler")
    assert forwards(teacher, 5) == {"per_video": 80, "chunks": 1, "per_chunk": 80, "cache_writes": 0}
    causal = Candidate("pretrain_40", Path("unused"), 40, 4.0, "euler", options={"chunk_size": 1})  # a causal mask, one pass
    assert forwards(causal, 5) == {"per_video": 80, "chunks": 1, "per_chunk": 80, "cache_writes": 0}


def _metrics(values: dict[str, dict[str, float]]) -> dict[str, float]:
    out = {}
    for name, given in values.items():
        out.update({f"{name}/{k}": 0.0 for k in METRIC_NAMES})
        out.update({f"{name}/{k}": v for k, v in given.items()})
    return out


def test_the_summary_says_why_24_nfe_and_which_readings_discriminate():
    metrics = _metrics({"teacher_40": {"colour": 1.0, "direction": 1.0, "shape": 0.5, "all": 0.5, "nfe": 80, "latency_s": 2.5},
                        "distill_4": {"colour": 1.0, "direction": 1.0, "shape": 0.75, "all": 0.75, "nfe": 24, "latency_s": 0.2}})
    metrics["teacher_40/frechet_floor"] = 1.09
    report = {"reference": "teacher_40", "prompts": ["a", "b", "c", "d", "e", "f", "g", "h"], "num_seeds": 2,
              "candidates": [{"name": "teacher_40", "forwards": {"per_video": 80, "chunks": 1, "per_chunk": 80, "cache_writes": 0}},
                             {"name": "distill_4", "forwards": {"per_video": 24, "chunks": 5, "per_chunk": 4, "cache_writes": 4}}],
              "cache": {"folder": "runs/validate/cache", "teacher_40": {"reused": True, "sampled": "2026-12-01T10:00:00Z"},
                        "distill_4": {"reused": False, "why": "changed: candidate.model_files.x"}}}
    readings = adherence_readings(metrics, ["teacher_40", "distill_4"])
    assert {k: r["discriminates"] for k, r in readings.items()} == {"colour": False, "shape": True, "direction": False, "all": True}
    text = summary_markdown(metrics, report)
    row = next(line for line in text.splitlines() if line.startswith("| distill_4 |"))
    assert "| 24 | 5 chunks × 4 + 4 cache writes | 0.200 ± 0.000 |" in row and row.endswith("| sampled |")
    assert "5 latent chunks × 4 denoising forwards each + 4 forwards that write a finished chunk into the KV cache = 24 NFE" in text
    assert "do not discriminate**: colour (1.00 for every candidate), direction (1.00 for every candidate)" in text
    assert "shape (0.50–0.75)" in text and "steps of 1/16" in text and "noise floor" in text
    assert "1 of 2 candidates reused (teacher_40)" in text
    # the plots a reader opens offline (issue 58 item 9: `dvc plots show`'s page loads its scripts from a CDN)
    assert "\n![adherence against NFE, per candidate family](plots/adherence_vs_nfe.png)\n" in text
    assert "`artifacts/<stage>/loss.png`" in text and "blank offline" in text
    assert "Latency measured" not in text  # a report without the times (an older run) says nothing of them
    report["latency"] = {"teacher_40": {"measured": {"reused": True, "at": "2026-12-01T10:00:00Z", "load_1min": 7.5, "cpus": 2}},
                         "distill_4": {"measured": {"reused": False, "at": "2026-12-03T12:00:00Z", "load_1min": 0.4, "cpus": 2}}}
    text = summary_markdown(metrics, report)
    assert ("- Latency measured: teacher_40 reused, sampled 2026-12-01T10:00:00Z (load 7.5 on 2 CPUs); distill_4 sampled "
            "2026-12-03T12:00:00Z (load 0.4 on 2 CPUs).") in text  # issue 44 item 7: a busy run's latency says it was busy


def test_adherence_off_the_clips_grammar_reads_n_a_and_the_prompts_are_named():
    """Metrics without adherence (prompts the analyzer cannot read): the table says n/a, a note says why, no reading
    is called discriminating or not, and the prompts are listed with where they came from."""
    metrics = {k: v for k, v in _metrics({"teacher_40": {"nfe": 80}, "distill_4": {"nfe": 24, "frechet_distance": 3.5}}).items()
               if k.split("/")[1].removesuffix("_std") not in ("colour", "shape", "direction", "all")}
    report = {"reference": "teacher_40", "prompts": ["a dog in a park", "waves on a beach"], "num_seeds": 1,
              "prompt_source": "the latent set's TRAIN split", "adherence": {
                  "applicable": False, "prompts_in_grammar": 0, "why": "0 of 2 prompts are captions of the grammar"},
              "candidates": [{"name": "teacher_40", "forwards": {"per_video": 80, "chunks": 1, "per_chunk": 80, "cache_writes": 0}},
                             {"name": "distill_4", "forwards": {"per_video": 24, "chunks": 5, "per_chunk": 4, "cache_writes": 4}}]}
    text = summary_markdown(metrics, report)
    row = next(line for line in text.splitlines() if line.startswith("| distill_4 |"))
    assert "| n/a | n/a | n/a | n/a | 3.50 ± 0.00 |" in row
    assert "**Adherence is n/a here**: 0 of 2 prompts are captions of the grammar." in text
    assert "discriminate" not in text and "steps of 1/" not in text
    assert "adherence_vs_nfe.png" not in text and "`artifacts/<stage>/loss.png`" in text  # no adherence, no plot of it
    assert text.endswith("## Prompts (2, from the latent set's TRAIN split)\n\n- #0 a dog in a park\n- #1 waves on a beach\n")
