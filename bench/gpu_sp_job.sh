#!/usr/bin/env bash
# GPU job of sequence/tensor parallelism (bench/sp_step.py; arguments go to it). Everything lands in $OUT:
# sp_step.log, sp_step_<part>.json.
#   bench/gpu_sp_job.sh regression --base .bench_base --runs sft:21x60x104:off          (one GPU, ~7 min)
#   bench/gpu_sp_job.sh regression --base .bench_base --runs dmd2_data:21x60x104:on --rounds 1 --steps 6 --warmup 2
#   bench/gpu_sp_job.sh sp --nproc 2 --tp                                                 (two GPUs of one host)
#   bench/gpu_sp_job.sh activations                                                      (one GPU)
# Expects, carried and not committed: wheels for what the GPU image lacks in .whl/ (diffusers, importlib_metadata, the
# FA4 wheels) and, for regression, the base commit's code in .bench_base/ (git archive <commit> src bench | tar -x -C
# .bench_base).
set -u
source bench/gpu_env.sh
python3 bench/sp_step.py "$@" > "$OUT/sp_step.log" 2>&1; echo "sp_step rc=$?"
grep -v "^{" "$OUT/sp_step.log" | tail -30
