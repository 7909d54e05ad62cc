#!/usr/bin/env bash
# Wall time and metrics of the default `dvc repro` (from nothing) for two commits, side by side, in
# one sitting: bench/repro_compare.sh BEFORE_COMMIT AFTER_COMMIT [RUNS]
# Each commit is cloned into a scratch folder and run with this checkout's venv, the clone's
# own code first on PYTHONPATH (stages, launcher and workers all import it). Prints one line per
# run: label, commit, seconds; then each clone's `dvc metrics show --json` summary lines.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
before=$1 after=$2 runs=${3:-1}
venv=$here/.venv/bin
scratch=$(mktemp -d /tmp/repro-compare.XXXXXX)
for label in before after; do
  commit=${!label}
  git clone -q "$here" "$scratch/$label"
  git -C "$scratch/$label" checkout -q "$commit"
  # the clone's own `distillery` command (the venv's console script names this checkout's entry point)
  mkdir -p "$scratch/$label/.bench-bin"
  printf '#!%s\nimport sys\nfrom distillery.cli import main as m\nsys.exit((getattr(m, "entry", None) or m.main)())\n' \
    "$venv/python" > "$scratch/$label/.bench-bin/distillery"
  chmod +x "$scratch/$label/.bench-bin/distillery"
done
for i in $(seq 1 "$runs"); do
  for label in before after; do
    ws=$scratch/$label
    (cd "$ws" && rm -rf artifacts runs metrics plots mlflow.db dvc.lock .dvc/cache .dvc/tmp)
    start=$(date +%s.%N)
    (cd "$ws" && PATH="$ws/.bench-bin:$venv:$PATH" PYTHONPATH="$ws/src" MLFLOW_TRACKING_URI="sqlite:///$ws/mlflow.db" \
       dvc repro -q > "$ws/repro-$i.log" 2>&1)
    end=$(date +%s.%N)
    printf '%s %s run %d: %.1f s\n' "$label" "${!label:0:7}" "$i" "$(echo "$end - $start" | bc)"
  done
done
for label in before after; do
  echo "== $label metrics"
  (cd "$scratch/$label" && PATH="$venv:$PATH" PYTHONPATH="$scratch/$label/src" dvc metrics show --json) \
    | "$venv/python" -c 'import json,sys
from distillery.common.treeutil import flatten
d = json.load(sys.stdin)
for ws in d.values():
    for path, m in sorted(ws["data"].items()):
        for k, v in flatten(m.get("data", {})).items():
            print(path, k, v)' 2>/dev/null || true
done
echo "scratch: $scratch"
