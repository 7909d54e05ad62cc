"""Validate's numbers in words: ``report/summary.md``, the page a user reads beside the grid.

:func:`summary_markdown` turns :func:`distillery.evaluation.validate.run_validation`'s metrics and
report into one table (a row per candidate: NFE per video beside how a streaming sampler spends it
— forwards per chunk, chunks, KV-cache writes — and the median latency, then adherence, Fréchet and
paired distance, sharpness, each ± its spread, and whether the row was reused from the sample cache)
and the notes a reader needs to decode it:

- why a streaming student's NFE is not its step count (chunks × forwards per chunk + cache writes),
  so candidates are compared on latency as well as NFE;
- which adherence readings discriminate: a reading (colour, shape, direction) that has the same
  value for every candidate separates none of them on this prompt set, and adherence moves in steps
  of 1 / (prompts × seeds);
- the reference and its seed-to-seed Fréchet noise floor;
- where the plots are as PNG images, which open offline (:func:`plots_section`: ``dvc plots show``'s HTML
  loads its scripts from a CDN);
- which prompts were used and where they came from (report.json ``prompt_source``: the latent set's
  validation split, its train split where the data has no ``validation/`` folder, or ``validate.prompts``),
  and — where the prompts are not the synthetic clips' captions (report.json ``adherence``) — that
  adherence is n/a (its cells read ``n/a``, not a 0.00 that cannot apply);
- with ``validate.clip_model`` (report.json ``clip``), a second table: per candidate the CLIP text–video
  similarity, CLIP frame consistency and motion (:mod:`distillery.evaluation.clip_scores`), each with its 95%
  bootstrap interval, the CLIP folder they were read with, and how they compare with VBench's.

:func:`adherence_readings` is the per-reading spread over candidates (report.json ``adherence_readings``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

READINGS = ("colour", "shape", "direction", "all")  # the analyzer's adherence readings


def adherence_readings(metrics: Mapping[str, float], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per reading: ``min`` and ``max`` over the candidates ``names`` and ``discriminates`` (they differ)."""
    out: dict[str, dict[str, Any]] = {}
    for reading in READINGS:
        values = [float(metrics[f"{n}/{reading}"]) for n in names]
        out[reading] = {"min": min(values), "max": max(values), "discriminates": max(values) > min(values)}
    return out


def _pm(value: float, spread: float | None, digits: int) -> str:
    return f"{value:.{digits}f}" if spread is None else f"{value:.{digits}f} ± {spread:.{digits}f}"


def _forwards_cell(f: Mapping[str, int]) -> str:
    if f["chunks"] <= 1:
        return "—"
    writes = f" + {f['cache_writes']} cache writes" if f["cache_writes"] else ""
    return f"{f['chunks']} chunks × {f['per_chunk']}{writes}"


def _interval(metrics: Mapping[str, float], name: str, key: str, scale: float, digits: int) -> str:
    m = lambda k: scale * float(metrics[f"{name}/{k}"])  # noqa: E731
    return f"{m(key):.{digits}f} [{m(key + '_lo'):.{digits}f}, {m(key + '_hi'):.{digits}f}]"


def _clip_table(metrics: Mapping[str, float], names: Sequence[str], clip: Mapping[str, Any]) -> list[str]:
    """The CLIP scores' section of summary.md (module doc)."""
    lines = ["", f"## Comparable scores (CLIP model `{clip['folder']}`)", "",
             "| candidate | CLIP text–video | CLIP frame consistency | motion ×10⁻³ |", "|---|--:|--:|--:|"]
    for n in names:
        lines.append(f"| {n} | {_interval(metrics, n, 'clip_text', 1.0, 4)} | {_interval(metrics, n, 'clip_consistency', 1.0, 4)} "
                     f"| {_interval(metrics, n, 'motion', 1e3, 2)} |")
    lines += ["", "- Each cell: the mean over the candidate's videos [its 95% bootstrap interval]. CLIP text–video: the "
              "mean over frames of the cosine between the prompt's and the frame's CLIP embeddings (higher: the video "
              "shows the prompt more); CLIP frame consistency: the mean cosine of consecutive frames' embeddings (1: "
              "nothing changes; VBench's subject-consistency idea); motion: the mean absolute change of a pixel's RGB "
              "value between consecutive frames, in [0, 1] units (×10⁻³ here; 0: a still video).",
              "- Not VBench's numbers (VBench reads its own prompt suite with ViCLIP, DINO and RAFT optical flow): the "
              "same ideas, comparable between candidates and runs scored with this CLIP folder, and with papers that "
              "report CLIP similarity with the same CLIP model. High consistency with low motion can be a still video."]
    return lines


def _first_of_each_stage(names: Sequence[str]) -> list[str]:
    """The first candidate of each stage (``<stage>_<steps>``), in order: the one each stage is judged by."""
    seen: set[str] = set()
    out = []
    for n in names:
        stage = n.rpartition("_")[0] or n
        if stage not in seen:
            seen.add(stage)
            out.append(n)
    return out


def versus(metrics: Mapping[str, float], report: Mapping[str, Any], student: str) -> dict[str, Any]:
    """Candidate ``student`` against the reference teacher, fairly: their NFE per video and how many times fewer the
    student spends; quality — adherence (or, where it does not apply, the Fréchet distance to the teacher's videos) of
    each and the difference with its spread over seeds; latency of each and the ratio, only when both were measured in
    the same run (neither reused from the sample cache: one machine, one moment), else ``latency_x`` None and
    ``latency_why`` saying when each was measured."""
    ref = str(report["reference"])
    m = lambda name, key: float(metrics[f"{name}/{key}"])  # noqa: E731
    out: dict[str, Any] = {"student": student, "teacher": ref, "nfe": (m(student, "nfe"), m(ref, "nfe"))}
    out["nfe_x"] = out["nfe"][1] / out["nfe"][0] if out["nfe"][0] else None
    if (report.get("adherence") or {}).get("applicable", True):
        out["quality"] = "adherence"
        out["values"] = (m(student, "all"), m(ref, "all"))
        out["delta"] = out["values"][0] - out["values"][1]
        out["spread"] = (m(student, "all_std") ** 2 + m(ref, "all_std") ** 2) ** 0.5
    else:  # the reference's own Fréchet distance is 0 by construction: the student's is the difference
        out["quality"] = "Fréchet distance to the teacher"
        out["values"] = (m(student, "frechet_distance"), 0.0)
        out["delta"], out["spread"] = out["values"][0], m(student, "frechet_distance_std")
    measured = {n: ((report.get("latency") or {}).get(n) or {}).get("measured") or {} for n in (student, ref)}
    out["latency"] = (m(student, "latency_s"), m(ref, "latency_s"))
    if any(measured[n].get("reused", True) for n in (student, ref)):
        out["latency_x"] = None
        out["latency_why"] = "; ".join(f"{n}'s {'reused, sampled' if measured[n].get('reused', True) else 'sampled'} "
                                       f"{measured[n].get('at', '(when unknown)')} (load {measured[n].get('load_1min')})"
                                       for n in (student, ref))
    else:
        out["latency_x"] = out["latency"][1] / out["latency"][0] if out["latency"][0] else None
    return out


def versus_line(metrics: Mapping[str, float], report: Mapping[str, Any], student: str) -> str:
    """:func:`versus` in one line: ``student vs teacher: NFE ×, quality Δ, latency ×`` (or why the latencies do not
    compare)."""
    v = versus(metrics, report, student)
    nfe = f"NFE {v['nfe'][0]:g} vs {v['nfe'][1]:g}" + (f" (×{v['nfe_x']:.3g} fewer)" if v["nfe_x"] else "")
    quality = (f"{v['quality']} {v['values'][0]:.3f} vs {v['values'][1]:.3f} (Δ {v['delta']:+.3f} ± {v['spread']:.3f})"
               if v["quality"] == "adherence" else f"{v['quality']} {v['delta']:.3f} ± {v['spread']:.3f}")
    if v["latency_x"] is not None:
        faster = (f"×{v['latency_x']:.3g} faster" if v["latency_x"] >= 1 else f"×{1 / v['latency_x']:.3g} slower")
        latency = f"latency {v['latency'][0]:.3g} vs {v['latency'][1]:.3g} s/video ({faster}, measured in one run)"
    else:
        latency = (f"latency not comparable: not measured in one run ({v['latency_why']}); "
                   "`rm -rf runs/validate/cache` re-times both")
    return f"student vs teacher ({v['student']} vs {v['teacher']}): {nfe}, {quality}, {latency}"


def plots_section(adherence_plotted: bool) -> list[str]:
    """The report's plots as images a reader opens offline: the adherence-vs-NFE PNG beside this page (written only
    where adherence applies) and where each training stage's loss curve is; ``dvc plots show`` draws the same data
    through Vega-Lite fetched from a CDN, a page that stays blank without the network."""
    lines = ["", "## Plots (PNG images: no network needed)", ""]
    if adherence_plotted:
        lines += ["![adherence against NFE, per candidate family](plots/adherence_vs_nfe.png)", ""]
    lines.append("- Each training stage's loss per step and its moving mean: `artifacts/<stage>/loss.png` (e.g. "
                 "`artifacts/distill/loss.png`). `dvc plots show` draws the same curves as HTML whose scripts "
                 "load from a CDN: blank offline.")
    return lines


def summary_markdown(metrics: Mapping[str, float], report: Mapping[str, Any]) -> str:
    """The Markdown of ``report/summary.md`` (module doc) from the flat metrics and report.json's content."""
    cands = report["candidates"]
    names = [c["name"] for c in cands]
    cache = report.get("cache") or {}
    videos = len(report["prompts"]) * int(report["num_seeds"])
    applies = (report.get("adherence") or {}).get("applicable", True)
    lines = [f"# Validation: {len(names)} candidates × {len(report['prompts'])} prompts × {report['num_seeds']} seeds",
             "", f"Reference: `{report['reference']}` (paired distance and Fréchet distance are to its videos, same "
             "prompts and noise). ± is the spread over seeds (Fréchet: bootstrap); latency is the median wall time "
             "per video (sampling + decode, after a warm-up video) ± its interquartile range.", "",
             "| candidate | NFE / video | streamed as | latency s/video | adherence | colour | shape | direction "
             "| Fréchet | distance ×10⁻³ | sharpness ×10⁻³ | samples |",
             "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for c in cands:
        n, m = c["name"], lambda k, name=c["name"]: float(metrics[f"{name}/{k}"])  # noqa: E731
        where = cache.get(n) or {}
        samples = ("reused" + (f" (sampled {where['sampled']})" if where.get("sampled") else "")) if where.get("reused") \
            else ("sampled" if where else "sampled (no cache)")
        adherence = (f"{_pm(m('all'), m('all_std'), 2)} | {m('colour'):.2f} | {m('shape'):.2f} | {m('direction'):.2f}"
                     if applies else "n/a | n/a | n/a | n/a")
        lines.append(
            f"| {n} | {int(m('nfe'))} | {_forwards_cell(c['forwards'])} | {_pm(m('latency_s'), m('latency_s_iqr'), 3)} "
            f"| {adherence} "
            f"| {_pm(m('frechet_distance'), m('frechet_distance_std'), 2)} "
            f"| {_pm(1e3 * m('distance_to_teacher'), 1e3 * m('distance_to_teacher_std'), 2)} "
            f"| {_pm(1e3 * m('sharpness'), 1e3 * m('sharpness_std'), 2)} | {samples} |")
    students = [n for n in _first_of_each_stage(names) if n.rpartition("_")[0] != str(report["reference"]).rpartition("_")[0]]
    if students:
        lines += ["", "## Student vs teacher", "", *[f"- {versus_line(metrics, report, n)}" for n in students]]
    lines += plots_section(applies)
    lines += ["", "## Reading it", ""]
    streamed = [c for c in cands if c["forwards"]["chunks"] > 1]
    for c in streamed:
        f = c["forwards"]
        lines.append(f"- **{c['name']} streams chunk by chunk**: {f['chunks']} latent chunks × {f['per_chunk']} "
                     f"denoising forwards each + {f['cache_writes']} forwards that write a finished chunk into the KV "
                     f"cache = {f['per_video']} NFE per video; each forward sees one chunk (and the cache), not the "
                     "whole video, so compare it on latency as well as NFE.")
    lines.append("- NFE = transformer forwards per video (CFG doubles them); candidates that spend them differently "
                 "compare fairly on the latency column, measured on this machine.")
    clip = report.get("clip")
    if not applies:
        lines.append(f"- **Adherence is n/a here**: {report['adherence']['why']}. Compare the candidates on "
                     + ("CLIP text similarity (below), " if clip else "") + "Fréchet, KID, paired distance and sharpness.")
    readings = adherence_readings(metrics, names) if applies else {}
    flat = [r for r in ("colour", "shape", "direction") if r in readings and not readings[r]["discriminates"]]
    moving = [r for r in ("colour", "shape", "direction") if r in readings and readings[r]["discriminates"]]
    if flat:
        lines.append("- **Adherence readings that do not discriminate**: " + ", ".join(
            f"{r} ({readings[r]['min']:.2f} for every candidate)" for r in flat)
            + " — they separate no candidates on these prompts.")
    if moving:
        lines.append("- **Readings that discriminate**: " + ", ".join(
            f"{r} ({readings[r]['min']:.2f}–{readings[r]['max']:.2f})" for r in moving)
            + (f"; `adherence` (all three right: {readings['all']['min']:.2f}–{readings['all']['max']:.2f}) "
               f"follows {' and '.join(moving)}." if flat else "."))
    if applies and not readings["all"]["discriminates"]:
        lines.append(f"- `adherence` (all three right) is {readings['all']['min']:.2f} for every candidate: it ranks none of "
                     "them here.")
    if applies:
        lines.append(f"- Adherence is a fraction of {videos} videos: it moves in steps of 1/{videos} = {1 / videos:.4g}.")
    floor = metrics.get(f"{report['reference']}/frechet_floor")
    if floor is not None:
        lines.append(f"- Fréchet noise floor (the reference's seed 0 vs seed 1 videos): {floor:.2f}; a candidate near it is "
                     "indistinguishable from the reference on these features.")
    reused = [n for n in names if (cache.get(n) or {}).get("reused")]
    if cache:
        lines.append(f"- Sample cache `{cache.get('folder')}`: {len(reused)} of {len(names)} candidates reused"
                     + (f" ({', '.join(reused)})" if reused else "")
            + ("; the others were sampled (report.json `cache` says why)" if len(reused) < len(names) else "")
            + ". A reused candidate's latency is the one measured when it was sampled.")
    measured = {n: (report.get("latency") or {}).get(n, {}).get("measured") for n in names}
    if any(isinstance(m, dict) for m in measured.values()):
        def when(m: dict[str, Any]) -> str:
            load = m.get("load_1min")
            under = f"load {load} on {m.get('cpus')} CPUs" if load is not None else "load not recorded"
            return f"{'reused, sampled' if m.get('reused') else 'sampled'} {m.get('at')} ({under})"
        lines.append("- Latency measured: " + "; ".join(f"{n} {when(m)}" for n, m in measured.items() if isinstance(m, dict))
                     + ". Compare latencies measured under similar loads (`rm -rf runs/validate/cache` re-times all).")
    if clip:
        lines += _clip_table(metrics, names, clip)
    if report.get("prompt_source"):
        lines += ["", f"## Prompts ({len(report['prompts'])}, from {report['prompt_source']})", ""]
        lines += [f"- #{i} {p}" for i, p in enumerate(report["prompts"])]
    return "\n".join(lines) + "\n"
