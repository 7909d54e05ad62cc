"""The default DAG at ``gpus.sp_size: 2`` against its ``sp_size: 1`` twin, on the CPU (issue 62, "Must show").

Two fresh workspaces, each a ``git clone`` of this checkout's HEAD with its own DVC site cache: ``sp1`` runs
``dvc repro`` as shipped (one process per training stage), ``sp2`` runs ``dvc exp run -S gpus.nproc_per_node=2
-S gpus.sp_size=2`` (every training stage on two gloo ranks splitting each sample's tokens: one data rank, the same
global batch). Then, per stage folder under ``artifacts/``, every ``*.safetensors`` tensor of the two runs is compared
(max |Δ|, max |Δ| over the largest |value| of the sp-1 tensor, mean |Δ|), each stage's ``lineage.json`` launch layout
is read back (the SP group it trained at), and ``metrics/validate.json``'s numbers are set side by side (wall-clock
keys left out). Too heavy for CI (two whole DAG runs, the second on two processes per training stage): run it
through ``/work/bin/heavy`` on the 2-core machine.

    python bench/sp_dag.py --scratch /tmp/sp-dag [--extra-set KEY=VALUE ...] [--json OUT.json]

Exit status 0 when both runs completed (the comparison is printed, whatever it shows), 1 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SP2_SETS = ["gpus.nproc_per_node=2", "gpus.sp_size=2"]
WALL_CLOCK = ("second", "latency", "time", "throughput")  # in a key's last part, or a last part ending in _s


def _workspace(scratch: Path, label: str) -> Path:
    """A fresh clone of HEAD with its own DVC site cache (DVC's lock files do not meet another workspace's)."""
    ws = scratch / label
    if ws.exists():
        shutil.rmtree(ws)
    subprocess.run(["git", "clone", "-q", str(REPO), str(ws)], check=True)
    subprocess.run(["git", "-C", str(ws), "checkout", "-q", subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()], check=True)
    subprocess.run(["dvc", "config", "--local", "core.site_cache_dir", str(ws / ".dvc-site")], cwd=ws, check=True, env=_env(ws))
    return ws


def _env(ws: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ws / "src")  # the clone's own code in every stage, launcher and worker
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{ws / 'mlflow.db'}"
    return env


def _run(ws: Path, command: list[str]) -> tuple[float, int]:
    start = time.monotonic()
    with open(ws / "repro.log", "w") as log:
        rc = subprocess.run(command, cwd=ws, env=_env(ws), stdout=log, stderr=subprocess.STDOUT).returncode
    return time.monotonic() - start, rc


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """``{relative file::tensor name: fp32 tensor}`` of every safetensors file under ``folder``."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted(folder.rglob("*.safetensors")):
        rel = path.relative_to(folder).as_posix()
        found.update({f"{rel}::{k}": v.float() for k, v in load_file(path).items()})
    return found


def compare_stage(a: Path, b: Path) -> dict[str, Any]:
    """sp 2 (``b``) against sp 1 (``a``) over one stage's artifact folder: tensors, worst and mean differences."""
    ta, tb = _tensors(a), _tensors(b)
    if not ta:
        return {"tensors": 0}
    if ta.keys() != tb.keys():
        return {"tensors": len(ta), "mismatch": sorted(ta.keys() ^ tb.keys())[:5]}
    worst, worst_rel, total, count, worst_key = 0.0, 0.0, 0.0, 0, ""
    for key, x in ta.items():
        y = tb[key]
        if x.shape != y.shape:
            return {"tensors": len(ta), "mismatch": [f"{key}: {tuple(x.shape)} vs {tuple(y.shape)}"]}
        d = (x - y).abs()
        m = d.max().item() if d.numel() else 0.0
        scale = x.abs().max().item() if x.numel() else 0.0
        if m > worst:
            worst, worst_key = m, key
        worst_rel = max(worst_rel, m / scale if scale > 0 else (0.0 if m == 0 else math.inf))
        total += d.sum().item()
        count += d.numel()
    return {"tensors": len(ta), "elements": count, "max_abs": worst, "max_rel": worst_rel,
            "mean_abs": total / max(count, 1), "worst": worst_key}


def _launch(folder: Path) -> dict[str, Any] | None:
    try:
        launch = json.loads((folder / "lineage.json").read_text()).get("launch")
    except (OSError, ValueError):
        return None
    return {k: launch.get(k) for k in ("world_size", "sp_size")} if isinstance(launch, dict) else None


def _numbers(data: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            out.update(_numbers(v, f"{prefix}{k}."))
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        key = prefix.rstrip(".")
        last = key.rsplit(".", 1)[-1].lower()
        if not (last.endswith("_s") or any(w in last for w in WALL_CLOCK)):
            out[key] = float(data)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scratch", type=Path, required=True, help="where the two workspaces are made (removed first)")
    ap.add_argument("--extra-set", action="append", default=[], help="another -S KEY=VALUE for both runs")
    ap.add_argument("--json", type=Path, help="write the comparison here")
    args = ap.parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                                       capture_output=True, text=True).stdout.strip(), "runs": {}}
    extra = [x for s in args.extra_set for x in ("-S", s)]
    runs = {"sp1": ["dvc", "exp", "run", *extra] if extra else ["dvc", "repro"],
            "sp2": ["dvc", "exp", "run", *[x for s in SP2_SETS for x in ("-S", s)], *extra]}
    spaces = {}
    for label, command in runs.items():
        ws = spaces[label] = _workspace(args.scratch, label)
        seconds, rc = _run(ws, command)
        result["runs"][label] = {"command": " ".join(command), "seconds": round(seconds, 1), "rc": rc}
        print(f"{label}: {' '.join(command)}: rc {rc}, {seconds:.1f} s (log: {ws / 'repro.log'})", flush=True)
        if rc:
            print((ws / "repro.log").read_text()[-4000:], file=sys.stderr)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
            return 1
    stages = {}
    for folder in sorted((spaces["sp1"] / "artifacts").iterdir()):
        if folder.is_dir():
            row = compare_stage(folder, spaces["sp2"] / "artifacts" / folder.name)
            row["launch"] = {"sp1": _launch(folder), "sp2": _launch(spaces["sp2"] / "artifacts" / folder.name)}
            stages[folder.name] = row
    result["stages"] = stages
    print(f"\n{'stage':10} {'tensors':>7} {'max |Δ|':>10} {'max rel':>10} {'mean |Δ|':>10}  sp-2 launch (world, sp)")
    for name, row in stages.items():
        if "max_abs" in row:
            print(f"{name:10} {row['tensors']:7d} {row['max_abs']:10.3g} {row['max_rel']:10.3g} {row['mean_abs']:10.3g}  "
                  f"{row['launch']['sp2']}")
        elif row.get("tensors"):
            print(f"{name:10} mismatch: {row['mismatch']}")
    metrics = [_numbers(json.loads((spaces[label] / "metrics" / "validate.json").read_text())) for label in ("sp1", "sp2")]
    result["validate"] = {k: [metrics[0][k], metrics[1].get(k)] for k in sorted(metrics[0])}
    print(f"\n{'validate metric':60} {'sp 1':>12} {'sp 2':>12} {'Δ':>10}")
    for key, (x, y) in result["validate"].items():
        print(f"{key:60} {x:12.6g} {y if y is not None else float('nan'):12.6g} {(y - x) if y is not None else float('nan'):10.3g}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
