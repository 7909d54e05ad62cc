"""VBench's dimensions on the validate stage's videos (``validate.vbench``; docs/vbench.md "In the DAG").

The stage samples its candidates once; the headline candidates' videos (``report/samples/<candidate>/<key>.mp4``,
the teacher at its reference steps and each student) are then scored on the chosen dimensions, decoded from their
files as ``distillery vbench score`` decodes a folder (:func:`~distillery.evaluation.vbench.run.score_videos`). The
prompts are validate's, ``num_seeds`` videos each: protocol ``custom``, so each number is labelled not comparable
with a published row (VBench's own suite is ``distillery vbench``'s job). A candidate reused from validate's sample
cache is scored from its cached videos; one whose videos (every byte), models, code and machine are those it was
scored with before keeps those scores (:mod:`.score_cache`: a validate rerun that leaves its videos as they were scores
nothing again).

Before any sampling, :func:`check` and :func:`load` refuse what can be known (one line each): a model a dimension needs that is
not given, a folder missing or without its file, a checkpoint of another class (the models load on the CPU here), a
video length or size a dimension cannot read (validate's videos have the latents' frames and size). After
sampling, :func:`score_candidates` moves the models to the device, scores, and writes ``report/vbench/``
(``vbench.json``: every candidate's report, with the protocol and the models' digests; ``vbench.md``: the published
rows beside ours; ``videos.jsonl``) and returns the flat metrics ``<candidate>/vbench_<dimension>`` and
``<candidate>/vbench_quality_score`` (×100; the quality score only with all 7 quality dimensions).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from distillery.common.log import get_logger
from distillery.evaluation.sample_cache import entry_key
from distillery.evaluation.vbench.dimensions import VBenchScorer, check_video
from distillery.evaluation.vbench.models import check_folders
from distillery.evaluation.vbench.protocol import Protocol, VideoSpec
from distillery.evaluation.vbench.report import metrics as report_metrics
from distillery.evaluation.vbench.run import score_videos, videos_report, write_results
from distillery.evaluation.vbench.score_cache import ScoreCache, material

log = get_logger(__name__)

WHERE = "validate.vbench.models"  # how the params name the model folders in a refusal
OUT = "vbench"  # the report's folder of the VBench results


def check(dimensions: list[str], models: dict[str, str], num_frames: int, height: int, width: int) -> dict[str, Path]:
    """What can be refused before sampling and loading (module doc): validate's videos long and large enough, the
    folder of every model ``dimensions`` read given and holding its file. Returns those folders (what the artifact's
    lineage pins)."""
    check_video(num_frames, height, width, dimensions, f"of validate ({num_frames} frames of {height}×{width}, the latents')")
    return check_folders(models, dimensions, WHERE)


def load(dimensions: list[str], models: dict[str, str]) -> VBenchScorer:
    """The scorer of ``dimensions``, its models loaded on the CPU from ``models`` (key → folder): a checkpoint of
    another class refused before the stage samples."""
    return VBenchScorer(models, tuple(dimensions), "cpu", where=WHERE)


def score_candidates(scorer: VBenchScorer, report_dir: Path, candidates: list[str], device: str,
                     cache: ScoreCache | None = None, models: Mapping[str, Sequence[Mapping]] | None = None) -> dict[str, float]:
    """Score each of ``candidates``' videos in ``report_dir`` (validate's report, whose ``report.json`` names the
    prompts and each video's key) on ``scorer``'s dimensions on ``device``; write ``report_dir/vbench/`` and add the
    numbers to ``report_dir/metrics.json``. Returns the flat metrics (module doc). With ``cache`` (and ``models``: each
    model folder's pinned files, :func:`~distillery.lineage.manifest.pin_input`), a candidate whose videos, models,
    code and machine are those of an entry is not scored again: its scores are the entry's (:mod:`.score_cache`)."""
    if cache is not None and set(models or {}) != set(scorer.loaded):  # a key without a model's files could go stale
        raise ValueError(f"a VBench score cache needs the files of every model scored: {sorted(scorer.loaded)}")
    report = json.loads((report_dir / "report.json").read_text())
    prompts, keys = report["prompts"], report["sample_keys"]  # keys[prompt][seed index]
    protocol = Protocol("custom", scorer.dimensions, report["num_seeds"], custom_prompts=list(prompts))
    described = {**protocol.describe(), "videos_from": "validate (its prompts and seeds)"}
    scorer.to(device)
    reports, rows, flat, reused, used = [], [], {}, [], set()
    for name in candidates:
        videos = [(VideoSpec(entry, j), report_dir / "samples" / name / f"{keys[entry.index][j]}.mp4")
                  for entry in protocol.entries for j in range(protocol.seeds_per_prompt)]
        want = None if cache is None else material(videos, models or {}, scorer.device)
        cached = None if want is None else cache.load(name, want)
        if cached is not None:
            reused.append(name)
            scored, video_rows = videos_report(scorer, protocol, cached, len(videos), name), cached
        else:
            scored, video_rows = score_videos(scorer, protocol, videos, name)
            if want is not None:
                cache.store(name, want, video_rows)
        if want is not None:
            used.add(entry_key(want))
        scored["protocol"] = described
        reports.append(scored)
        rows += [r.__class__(f"{name}/{r.name}", r.dimension, r.value, r.weight) for r in video_rows]
        flat.update({f"{name}/{k}": round(v, 6) for k, v in report_metrics(scored).items()})
        log.info("validate %s: VBench %s", name, ", ".join(f"{k} {v:.2f}" for k, v in report_metrics(scored).items()))
    if cache is not None:
        log.info("validate: VBench scores of %d of %d candidates reused from %s%s", len(reused), len(candidates),
                 cache.root, f" ({', '.join(reused)})" if reused else "")
        cache.prune(used)
    write_results(report_dir / OUT, reports, rows)
    metrics_file = report_dir / "metrics.json"  # every metric of the run stays in one file
    metrics_file.write_text(json.dumps({**json.loads(metrics_file.read_text()), **flat}, indent=2) + "\n")
    return flat
