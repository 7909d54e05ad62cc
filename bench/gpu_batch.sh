#!/usr/bin/env bash
# Several one-GPU benchmarks in one device call (2026-12-08: BENCHMARKS.md "The issues' one-GPU numbers"), from the
# repository root on the device machine, with .whl/ (bench/gpu_job.sh's wheels), .bench_anchor/ and .bench_base/ carried:
#   bash bench/gpu_batch.sh BUDGET_S PART...      PART: nft vbench sparse latency cd sp cosmos hunyuan
# Each part runs in its own process under `timeout` (its cap below, or what is left of BUDGET_S), its log and files in
# /tmp/res/PART; all of /tmp/res is tarred into $OUT/results.tgz after each part, so a call cut short still returns what
# finished (a device call returns at most 8 files). FlashAttention-4 imports only with the device-wheels pieces
# (../shared/tools/device-wheels.sh, `source device-env.sh`); with .whl/ alone the FA4 paths fall back and say so.
set -u
START=$(date +%s); BUDGET=$1; shift
FINAL=${OUT:-/tmp/final}; mkdir -p "$FINAL" /tmp/res
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
part() {  # part NAME CAP_S COMMAND...
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) - 12 )); local t=$(( cap < left ? cap : left ))
  if [ "$t" -lt 40 ]; then echo "== $name skipped: $left s left"; return; fi
  mkdir -p /tmp/res/$name; local s; s=$(date +%s)
  OUT=/tmp/res/$name JOB_BUDGET=$((t - 5)) timeout "$t" "$@" > /tmp/res/$name/log.txt 2>&1
  echo "== $name rc=$? wall=$(( $(date +%s) - s )) s (cap $t)"; grep -v "^\s*$" /tmp/res/$name/log.txt | tail -${TAIL:-6} | cut -c1-400
  (cd /tmp && tar czf "$FINAL/results.tgz" res)
}
for p in "$@"; do
  case $p in
    nft) part nft 300 python3 bench/nft_step.py --k 4 --prompts 1 ;;
    vbench) part vbench 130 bash -c 'python3 bench/vbench_speed.py --device cuda --videos 3 --out $OUT/vbench-speed.json' ;;
    sparse) part sparse 110 python3 bench/sparse_attention_check.py ;;
    latency) part latency 180 python3 bench/export_latency.py --kinds dmd2_sparse,dmd2 --variants fast --repeats 2 --budget-s 150 --skip-kernel-check ;;
    cd) part cd 330 env ANCHOR_LATENTS= bash bench/gpu_job.sh distill --runs "causal_cd:21x60x104:default:on,sf:21x60x104:default:on" --steps 5 --warmup 2 --tag _cd ;;
    sp) part sp 240 bash bench/gpu_job.sh sp regression --base .bench_base --runs sft:21x60x104:on,dmd2_data:21x60x104:on --rounds 1 --steps 5 --warmup 2 --attention native --timeout 220 ;;
    cosmos) part cosmos 280 python3 bench/cosmos_bench.py --parts sft ;;
    hunyuan) part hunyuan 290 python3 bench/hunyuan15_bench.py --parts sft ;;
    *) echo "unknown part $p" ;;
  esac
done
echo "batch done in $(( $(date +%s) - START )) s"
