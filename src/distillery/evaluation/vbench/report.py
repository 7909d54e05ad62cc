"""What a VBench evaluation reports: ``vbench.json`` (the protocol, the models and their digests, each dimension's
raw and normalised score, the quality score, the published rows) and ``vbench.md`` — our row and the published
rows of one table, so that "published vs ours" is one look, each row naming its protocol.

Numbers in both are VBench's fractions ×100, as papers print them. Ours is marked *comparable* only when its
protocol is (:attr:`~distillery.evaluation.vbench.protocol.Protocol.comparable`) and every model is the published
one (:attr:`~distillery.evaluation.vbench.dimensions.VBenchScorer.published`); otherwise the table says why not.
We compute the quality dimensions and one semantic dimension (overall consistency): the semantic and total
columns of our rows stay empty.
"""

from __future__ import annotations

from dataclasses import asdict

from distillery.evaluation.vbench.score import PUBLISHED, QUALITY, scores


def build_report(candidate: str, protocol: dict, models: dict, published_models: bool, raw: dict[str, float],
                 videos: int) -> dict:
    """The ``vbench.json`` content of one candidate (module doc)."""
    derived = scores(raw)
    comparable = bool(protocol.get("comparable")) and published_models
    why = [] if comparable else ([] if protocol.get("comparable") else [f"protocol {protocol.get('name')} is not comparable"]) + (
        [] if published_models else ["a model is not the published one"])
    return {"candidate": candidate, "protocol": protocol, "models": models, "videos": videos,
            "dimensions": {d: 100 * v for d, v in raw.items()},
            "normalised": {k.removesuffix("_normalised"): 100 * v for k, v in derived.items() if k.endswith("_normalised")},
            "quality_score": 100 * derived["quality_score"] if "quality_score" in derived else None,
            "comparable": comparable, "not_comparable_because": why,
            "published": [asdict(row) for row in PUBLISHED]}


def metrics(report: dict) -> dict[str, float]:
    """The flat numbers a candidate's metrics record: ``vbench_quality_score`` and ``vbench_<dimension>`` (×100)."""
    out = {f"vbench_{d}": v for d, v in report["dimensions"].items()}
    if report["quality_score"] is not None:
        out["vbench_quality_score"] = report["quality_score"]
    return out


def _cell(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


def markdown(reports: list[dict]) -> str:
    """``vbench.md``: the published rows and ours in one table (total / quality / semantic, protocol), then our
    dimensions."""
    lines = ["# VBench", "", "| model | total | quality | semantic | protocol | source |", "|---|---|---|---|---|---|"]
    for row in PUBLISHED:
        lines.append(f"| {row.model} | {_cell(row.total)} | {_cell(row.quality)} | {_cell(row.semantic)} | {row.protocol} | {row.source} |")
    for r in reports:
        note = "ours" if r["comparable"] else "ours, not comparable: " + "; ".join(r["not_comparable_because"])
        lines.append(f"| {r['candidate']} | | {_cell(r['quality_score'])} | | {r['protocol']['name']} "
                     f"({r['videos']} videos) | {note} |")
    dims = [d for d in QUALITY + ("overall_consistency",) if any(d in r["dimensions"] for r in reports)]
    if dims:
        lines += ["", "| candidate | " + " | ".join(dims) + " |", "|---" * (len(dims) + 1) + "|"]
        for r in reports:
            lines.append(f"| {r['candidate']} | " + " | ".join(_cell(r["dimensions"].get(d)) for d in dims) + " |")
    lines += ["", "Numbers ×100. Semantic and total need VBench's 9 semantic dimensions; we compute overall consistency only. "
              "Protocols: vbench_standard (VBench's prompts, 5 videos each), vbench_extended (the same, sampled from "
              "rewritten prompts, as the Self-Forcing paper), custom (own prompts: not comparable); unstated: the source "
              "does not say.", ""]
    return "\n".join(lines)
