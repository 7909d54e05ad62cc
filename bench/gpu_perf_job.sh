#!/usr/bin/env bash
# One GPU job for the one-GPU step's performance (issue 12): attention kernels at the training shape
# (bench/attention_kernels.py), the plain-diffusers anchor (eager + compiled), then our SFT step in the
# configurations of $PERF_RUNS, each in its own process with GPU time per kernel family of two steady steps.
# $PERF_RUNS: space-separated "T H W COMPILE SHARD ATTENTION RESHARD" tuples joined by ':' (RESHARD: -, 0, 1).
# Expects, carried and not committed: .whl/ and .bench_anchor/ (see gpu_env.sh). Everything lands in $OUT.
set -u
JOB_START=$(date +%s)
source bench/gpu_env.sh
python3 -c "import torch; print('cudnn', torch.backends.cudnn.version())"
python3 -m pip list 2>/dev/null | grep -i -E "flash|cudnn|triton" | head
if [ -z "${SKIP_KERNELS:-}" ]; then
  start=$(date +%s)
  timeout 150 python3 bench/attention_kernels.py --tokens "${KERNEL_TOKENS:-32760}" > "$OUT/attention.log" 2>&1
  echo "attention rc=$? wall=$(( $(date +%s) - start )) s"; cut -c1-260 "$OUT/attention.log" | grep "^{"
fi
if [ -z "${SKIP_ANCHOR:-}" ]; then
  start=$(date +%s)
  COMPILE=1 timeout 200 python3 .bench_anchor/plain_diffusers_wan_step.py > "$OUT/anchor.log" 2>&1
  echo "anchor rc=$? wall=$(( $(date +%s) - start )) s"; grep -v "^{" "$OUT/anchor.log" | tail -5
fi
i=0
for run in ${PERF_RUNS:-"21:60:104:default:0:native:-"}; do
  IFS=: read -r T H W COMP SHARD ATT RESHARD <<< "$run"
  i=$((i + 1)); left=$(( ${JOB_BUDGET:-570} - ($(date +%s) - JOB_START) ))
  if [ "$left" -lt 60 ]; then echo "skip $run: $left s left"; continue; fi
  extra=(); [ "$RESHARD" != "-" ] && extra=(--reshard "$RESHARD")
  comp=$COMP; [ "$COMP" = "default" ] && comp=default; [ "$COMP" = "1" ] && comp=1
  start=$(date +%s)
  timeout "$left" python3 bench/sft_step.py --one "$T" "$H" "$W" "$comp" "$SHARD" "$ATT" --steps "${STEPS:-10}" --warmup 3 \
    --breakdown "${extra[@]}" > "$OUT/ours_$i.log" 2>&1
  echo "run $i ($run) rc=$? wall=$(( $(date +%s) - start )) s"
  grep "^RESULT" "$OUT/ours_$i.log" | sed 's/^RESULT //' > "$OUT/ours_$i.json"
  python3 - "$OUT/ours_$i.json" <<'PY'
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read())
except Exception:
    print("  no result"); sys.exit(0)
print(f"  step_s {r['step_s']:.4f} gpu_step_s {r.get('gpu_step_s', float('nan')):.4f} peak {r['peak_mem_gib']:.1f} GiB "
      f"first {r['first_step_s']:.1f} s loss {r['final_loss']:.4f}")
b = r.get("breakdown", {})
print("  kernels/step", b.get("kernels_per_step_s"), json.dumps(b.get("per_step_s")))
for name, s, fam in b.get("top", [])[:8]:
    print(f"    {s:8.4f}  {fam:30s} {name[:90]}")
PY
done
