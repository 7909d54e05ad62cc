"""What holds the peak of a CUDA memory snapshot (``torch.cuda.memory._snapshot()`` taken with
``torch.cuda.memory._record_memory_history(stacks="python")`` on since before the models were built).

:func:`peak_summary` replays the allocator trace (``alloc`` adds a block, ``free_completed`` removes it), finds the
moment the live total is largest, and groups the blocks live at that moment two ways:

- by **category**, from each block's Python stack: optimizer state (``torch/optim``), fp32 master gradients
  collected from a compute copy, the bf16 compute copies, weights (model construction and placement), autograd's
  backward (gradients, recomputation, temporaries: stacks inside the backward, no frame of the training code), and
  forward activations (the rest: the training code's forwards, compiled or eager, whose outputs autograd keeps);
- by **site**: the innermost frame of the training library (``distillery/…``, e.g. ``methods/dmd2.py:229``) with the
  innermost frame of the model code under it (``diffusers/…`` or the compiled graph).

Usage on a saved snapshot:  python bench/memory_peak.py SNAPSHOT.pickle  (prints the summary as JSON).
"""

from __future__ import annotations

import json
import pickle
import sys
from collections import defaultdict

GIB = 2**30


def _where(frame: dict) -> str:
    path = frame.get("filename", "")
    for marker in ("distillery/", "diffusers/", "torch/", "torchinductor"):
        if marker in path:
            path = path[path.index(marker):]
            break
    return f"{path}:{frame.get('line', '?')} {frame.get('name', '')}"


def category(frames: list[dict]) -> str:
    """The coarse owner of a block from its stack (module doc)."""
    files = [f.get("filename", "") for f in frames]
    names = [f.get("name", "") for f in frames]
    if any("torch/optim" in f for f in files):
        return "optimizer state"
    if "collect_grads" in names:
        return "fp32 master gradients"
    if any(f.endswith("components/precision.py") for f in files):
        return "bf16 compute copies"
    if any(n in ("from_config", "from_pretrained", "place_model", "build_models", "cast_parameters_", "shard_transformer")
           for n in names):
        return "weights"
    ours = any("distillery/" in f for f in files)
    in_backward = any(n == "backward" and ("torch/autograd" in f or "torch/_tensor.py" in f or "_functorch" in f)
                      for f, n in zip(files, names))
    if in_backward or (not ours and any("_functorch" in f or "torch/autograd" in f for f in files)):
        return "backward (gradients, recomputation, temporaries)"
    if not frames:
        return "unknown (no stack)"
    return "forward activations and outputs"


def site(frames: list[dict]) -> str:
    """``innermost training-library frame ← innermost model-code frame`` of a block (either may be absent)."""
    ours = next((_where(f) for f in frames if "distillery/" in f.get("filename", "")), "-")
    model = next((_where(f) for f in frames if "diffusers/" in f.get("filename", "") or "torchinductor" in f.get("filename", "")), "-")
    return f"{ours} <- {model}"


def peak_summary(snapshot: dict, device: int = 0, top: int = 25) -> dict:
    """Peak of the live total over the trace of ``device`` and what holds it (module doc). Blocks allocated
    before recording began are not in the trace: they count as ``before recording`` (from the snapshot's
    segments, those still live at the end that the trace never allocated)."""
    trace = snapshot["device_traces"][device]
    seen = {e["addr"] for e in trace if e["action"] == "alloc"}
    before = [(b["address"], b["size"]) for seg in snapshot.get("segments", []) if seg.get("device", device) == device
              for b in _blocks(seg) if b.get("state") == "active_allocated" and b["address"] not in seen]
    base = sum(size for _, size in before)
    total = peak = base
    peak_at = -1
    sizes: dict[int, int] = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == "free_completed" and e["addr"] in sizes:
            total -= sizes.pop(e["addr"])
    live: dict[int, dict] = {}
    for e in trace[:peak_at + 1]:  # replay up to the peak: the blocks live then
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_site: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        frames = e.get("frames") or []
        cat = category(frames)
        for table, key in ((by_cat, cat), (by_site, (cat, site(frames)))):
            table[key][0] += e["size"]
            table[key][1] += 1
    if base:
        by_cat["before recording"] = [base, len(before)]
    return {
        "peak_gib": peak / GIB, "trace_entries": len(trace), "peak_entry": peak_at, "before_recording_gib": base / GIB,
        "by_category_gib": {k: round(v[0] / GIB, 3) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1][0])},
        "top_sites": [{"category": cat, "site": s, "gib": round(v[0] / GIB, 3), "blocks": v[1]}
                      for (cat, s), v in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def _blocks(segment: dict) -> list[dict]:
    """A segment's blocks with absolute addresses (snapshots give each block's size; addresses run in order)."""
    addr, out = segment["address"], []
    for b in segment.get("blocks", []):
        out.append({**b, "address": b.get("address", addr)})
        addr += b["size"]
    return out


def main() -> int:
    with open(sys.argv[1], "rb") as fh:
        snapshot = pickle.load(fh)  # a snapshot this benchmark wrote itself
    print(json.dumps(peak_summary(snapshot), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
