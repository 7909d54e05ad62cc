"""Summary of a ``bench/gpu_job.sh fa4`` run from what it left in ``$OUT`` (any subset: a cut job still summarises).

Reads ``fa4_checks_*.json`` (kernels, block lists, agreement), the anchors' ``fa4_compiled.json`` and
``anchor_dmd2_<latent>.json``, our steps' ``step_<name>.json`` (``bench/sft_step.py --one``) and
``distill_step_<name>.json`` (``bench/distill_step.py``); prints one table against the issue's goals and writes
``$OUT/summary.json``.  Usage:  python bench/fa4_job_summary.py [OUT]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

GOALS = {"sft": 1.50, "dmd2": 4.5, "sf": 5.5, "pdd": 2.4}  # seconds per step / iteration (issue 24)
DMD2_MEMORY_GOAL = 120.0  # GiB


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summarize(out: Path) -> dict:
    summary: dict = {"steps": [], "anchors": {}, "kernels": {}, "agreement": {}, "memory_peak": None}
    checks: dict = {}
    for path in sorted(out.glob("fa4_checks*.json")):  # one file per fa4_checks.py invocation (its --parts)
        for key, value in (_load(path) or {}).items():
            if isinstance(value, dict) and isinstance(checks.get(key), dict):
                checks[key].update(value)
            else:
                checks[key] = value
    summary["errors"] = {k: v for k, v in checks.items() if k.endswith("_error")}
    for name, row in (checks.get("kernels") or {}).items():
        if isinstance(row, dict) and ("fwd_ms" in row or "error" in row):
            summary["kernels"][name] = {k: row.get(k) for k in ("fwd_ms", "fwd_bwd_ms", "fwd_bwd_tflops", "error") if k in row}
    if checks.get("kernels", {}).get("block_lists"):
        summary["block_lists"] = checks["kernels"]["block_lists"]
    for name, entry in (checks.get("agreement") or {}).items():
        if isinstance(entry, dict):
            summary["agreement"][name] = {b: {k: r.get(k) for k in ("rel_l2", "agrees", "error") if k in r}
                                          for b, r in entry.items() if isinstance(r, dict)}
            summary["agreement"][name]["floor_rel_l2"] = entry.get("floor_rel_l2")
    anchor = _load(out / "fa4_compiled.json") or {}
    for key in ("step_regional_native", "step_regional_fa4"):
        if isinstance(anchor.get(key), dict):
            summary["anchors"][f"plain_diffusers_{key}"] = anchor[key]
    for path in sorted(out.glob("anchor_dmd2_*.json")):
        ref = _load(path) or {}
        summary["anchors"][path.stem] = {"iteration_s": ref.get("iteration_s"), "peak_mem_gib": ref.get("peak_mem_gib")}
    for path in sorted(out.glob("step_*.json")):
        r = _load(path)
        if isinstance(r, dict) and "step_s" in r:
            summary["steps"].append({"name": path.stem[5:], "method": r.get("method", "sft"), "s": r["step_s"],
                                     "first_s": r.get("first_step_s"), "peak_gib": r.get("peak_mem_gib"),
                                     "attention": r.get("attention_resolved"), "compile_mode": r.get("compile_mode"),
                                     "gpu_s": r.get("gpu_step_s")})
    for path in sorted(out.glob("distill_step_*.json")):
        for r in (_load(path) or {}).get("ours", []):
            row = {"name": f"{path.stem[13:]}:{r.get('method')}", "method": r.get("method")}
            if "error" in r:
                lines = [ln for ln in r["error"].splitlines() if ln.strip()]
                row["error"] = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")[-300:]
            else:
                row.update(s=r["iteration_s"], first_s=r.get("first_iteration_s"), peak_gib=r.get("peak_mem_gib"),
                           attention=(r.get("attention_resolved") or {}).get("student"), compile_mode=r.get("compile_mode"),
                           gpu_s=r.get("gpu_iteration_s"), ratio_to_anchor=r.get("ratio_to_anchor"))
                if r.get("memory_peak"):
                    summary["memory_peak"] = r["memory_peak"]
            summary["steps"].append(row)
    for row in summary["steps"]:
        goal = GOALS.get({"dmd2_data": "dmd2", "pdd_euler": "pdd"}.get(row.get("method"), row.get("method")))
        if goal is not None and row.get("s") is not None:
            row["goal_s"], row["meets_goal"] = goal, row["s"] <= goal
        if row.get("method") == "dmd2_data" and row.get("peak_gib") is not None:
            row["memory_goal_gib"], row["meets_memory_goal"] = DMD2_MEMORY_GOAL, row["peak_gib"] <= DMD2_MEMORY_GOAL
    return summary


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp"))
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
    print("== steps (median of the timed steps; first = the compiling one)")
    for r in summary["steps"]:
        if "error" in r:
            print(f"  {r['name']:28s} FAILED {r['error'][:120]!r}")
            continue
        goal = "" if "goal_s" not in r else f" goal {r['goal_s']} s {'met' if r['meets_goal'] else 'missed'}"
        print(f"  {r['name']:28s} {fmt(r['s'])} s (GPU {fmt(r.get('gpu_s'))}) first {fmt(r['first_s'], '{:.1f}')} s "
              f"peak {fmt(r['peak_gib'], '{:.1f}')} GiB [{r['attention']}, {r['compile_mode']}]{goal}")
    print("== anchors")
    for k, v in summary["anchors"].items():
        print(f"  {k:36s} {json.dumps(v)[:160]}")
    print("== kernels, 1x32760x12x128 bf16 (ms)")
    for k, v in summary["kernels"].items():
        print(f"  {k:40s} fwd {fmt(v.get('fwd_ms'), '{:.2f}')} fwd+bwd {fmt(v.get('fwd_bwd_ms'), '{:.2f}')} "
              f"({fmt(v.get('fwd_bwd_tflops'), '{:.0f}')} TFLOP/s) {v.get('error', '')[:80]}")
    if summary.get("block_lists"):
        print("  block lists", json.dumps(summary["block_lists"]))
    print("== agreement with native (relative L2; floor: SDPA vs SDPA)")
    for k, v in summary["agreement"].items():
        cells = [f"{b} {fmt(r.get('rel_l2'), '{:.2e}')}{'' if r.get('agrees', True) else ' DISAGREES'}"
                 for b, r in v.items() if isinstance(r, dict) and b != "native" and "rel_l2" in r]
        errors = [f"{b}: {r['error'][:60]}" for b, r in v.items() if isinstance(r, dict) and "error" in r]
        print(f"  {k:24s} floor {fmt(v.get('floor_rel_l2'), '{:.2e}')}  " + "  ".join(cells) + ("  " + "; ".join(errors) if errors else ""))
    for k, v in summary["errors"].items():
        print(f"== {k}: {v[:200]}")
    if summary["memory_peak"]:
        m = summary["memory_peak"]
        print(f"== DMD2 memory peak {m['peak_gib']:.1f} GiB: " + ", ".join(f"{k} {v:.1f}" for k, v in m["by_category_gib"].items()))
        for s in m["top_sites"][:10]:
            print(f"    {s['gib']:7.2f} GiB  {s['category'][:28]:28s} {s['site'][:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
