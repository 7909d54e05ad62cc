#!/usr/bin/env bash
# One GPU job: the plain-diffusers DMD2 anchor (per latent), then our DMD2 / Self-Forcing iterations
# (bench/distill_step.py, one process per configuration), on the same machine state.
# Expects, carried and not committed: wheels for what the GPU image lacks in .whl/ (diffusers,
# importlib_metadata) and the anchor (shared/anchors/plain_diffusers_dmd2_step.py) in .bench_anchor/.
# ANCHOR_LATENTS: space-separated latents for the anchor (default "21x60x104 21x30x52"; empty: skip).
# Arguments go to bench/distill_step.py. Everything lands in $OUT: anchor.log, anchor_dmd2_<latent>.json,
# ours.log, distill_step<tag>.json.
set -u
JOB_START=$(date +%s)  # --deadline for distill_step.py: JOB_BUDGET (default 560 s) minus what the job has spent
source bench/gpu_env.sh
for latent in ${ANCHOR_LATENTS-21x60x104 21x30x52}; do
  start=$(date +%s)
  LATENT=$latent timeout 300 python3 .bench_anchor/plain_diffusers_dmd2_step.py >> "$OUT/anchor.log" 2>&1
  echo "anchor $latent rc=$? wall=$(( $(date +%s) - start )) s"
  if [ -f "$OUT/dmd2_step.json" ]; then mv "$OUT/dmd2_step.json" "$OUT/anchor_dmd2_$latent.json"; fi
done
[ -f "$OUT/anchor.log" ] && grep "^{" "$OUT/anchor.log" | cut -c1-200
start=$(date +%s)
python3 bench/distill_step.py --deadline $(( ${JOB_BUDGET:-560} - (start - JOB_START) )) "$@" > "$OUT/ours.log" 2>&1; echo "ours rc=$? wall=$(( $(date +%s) - start )) s"
grep -v "^{" "$OUT/ours.log" | tail -40
