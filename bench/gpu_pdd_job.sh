#!/usr/bin/env bash
# One GPU job for PDD: fused-block sampling latency vs the teacher's 40-step Euler (bench/pdd_sampling.py), the
# plain-diffusers DMD2 anchor at 21x60x104 (the distillation-step reference of the same call), then our PDD steps
# (bench/distill_step.py: Euler and midpoint targets), with the bf16 matmul ceiling measured in the same job.
# Expects, carried and not committed: .whl/ (diffusers, importlib_metadata wheels) and .bench_anchor/ (shared/anchors/).
# Arguments go to bench/distill_step.py. Everything lands in $OUT.
set -u
JOB_START=$(date +%s)
source bench/gpu_env.sh
start=$(date +%s)
timeout 200 python3 bench/pdd_sampling.py > "$OUT/sampling.log" 2>&1; echo "sampling rc=$? wall=$(( $(date +%s) - start )) s"
tail -6 "$OUT/sampling.log"
start=$(date +%s)
LATENT=21x60x104 timeout 150 python3 .bench_anchor/plain_diffusers_dmd2_step.py > "$OUT/anchor.log" 2>&1
echo "anchor rc=$? wall=$(( $(date +%s) - start )) s"
if [ -f "$OUT/dmd2_step.json" ]; then mv "$OUT/dmd2_step.json" "$OUT/anchor_dmd2_21x60x104.json"; fi
grep "^{" "$OUT/anchor.log" | cut -c1-200
start=$(date +%s)
python3 bench/distill_step.py --deadline $(( ${JOB_BUDGET:-570} - (start - JOB_START) )) --tag _pdd \
  --runs "${PDD_RUNS:-pdd_euler:21x60x104:default:off,pdd_mid:21x60x104:default:off}" "$@" > "$OUT/ours.log" 2>&1
echo "ours rc=$? wall=$(( $(date +%s) - start )) s"
grep -v "^{" "$OUT/ours.log" | tail -20
