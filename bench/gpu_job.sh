#!/usr/bin/env bash
# The one entry point of the GPU jobs (one device call each), from the repository root on the device machine:
#   bash bench/gpu_job.sh JOB [ARGS...]          results in $OUT (default /tmp; fa4: /tmp/fa4_job)
# JOB:
#   sft      the plain-diffusers Wan step anchor, then our SFT step (bench/sft_step.py ARGS); with PROFILE set, the
#            host/GPU time split of the small-latent eager step. The default when ARGS start with an option.
#   perf     the one-GPU step's performance (issue 12): attention kernels at the training shape
#            (bench/attention_kernels.py; SKIP_KERNELS), the compiled anchor (SKIP_ANCHOR), then our SFT step per
#            $PERF_RUNS ("T:H:W:COMPILE:SHARD:ATTENTION:RESHARD" tuples, space-separated; RESHARD -, 0, 1), each in its
#            own process with GPU time per kernel family of two steady steps ($STEPS timed steps).
#   distill  the plain-diffusers DMD2 anchor per $ANCHOR_LATENTS (default "21x60x104 21x30x52"; empty: none), then
#            our DMD2 / Self-Forcing iterations (bench/distill_step.py ARGS, one process per configuration).
#   pdd      fused-block PDD sampling against the teacher's 40-step Euler (bench/pdd_sampling.py), the DMD2 anchor at
#            21x60x104, then our PDD steps ($PDD_RUNS, ARGS to bench/distill_step.py).
#   fa4      FlashAttention-4 on Hopper (issue 24): the parts of $PARTS in order, each skipped when the job has less
#            than its need left (bench/fa4_checks.py, the FA4 and DMD2 anchors, our steps; see fa4_parts below);
#            bench/fa4_job_summary.py summarises what is there after every part. After `source device-env.sh`
#            (sourced here from shared/tools/ when flash_attn.cute does not import).
#   dag      the real-shape DAG (bench/real_shape_dag.py $DAG_ARGS), after a device-wheels batch put its pieces in
#            /tmp/parts (PyAV, MLflow, ruamel.yaml: bench/stage_wheels.sh).
#   sp       sequence / tensor parallelism (issue 62): bench/sp_step.py ARGS — `regression --base .bench_base` (one GPU:
#            our sp-1 step beside the base commit's code, carried in .bench_base/: git archive <commit> src bench | tar
#            -x -C .bench_base), `sp --nproc N [--tp]` (N GPUs: sp N and tp N against N data ranks), `activations` (one
#            GPU: peak memory against tokens); its log in $OUT/sp_step.log, results in $OUT/sp_step_<part>.json.
#   batch    `batch BUDGET_S PART...`: several one-GPU benchmarks in one device call, each PART in its own process
#            under `timeout` (its cap in job_batch, or what is left of BUDGET_S), its log and files in /tmp/res/PART; all
#            of /tmp/res tarred into $OUT/results.tgz after each part, so a call cut short returns what finished (a device
#            call returns at most 8 files). PART: nft vbench sparse latency cd sp cosmos hunyuan (BENCHMARKS.md "The
#            issues' one-GPU numbers", 2026-12-08). Without `source device-env.sh` the FA4 paths fall back and say so.
#   run      the wheels' environment below, then ARGS as a command (e.g. `run python3 bench/real_shape_pipeline.py --steps 4`).
# JOB_BUDGET: the seconds the job may take (a device call is at most 600). sft, perf, distill, pdd, sp and run expect the
# wheels the GPU image lacks in .whl/ (diffusers, importlib_metadata) and the anchors (shared/anchors/) in
# .bench_anchor/, both carried, not committed.
set -u
JOB_START=$(date +%s)
job=${1:-sft}
case $job in -*|"") job=sft ;; *) shift ;; esac

wheels_env() {  # the carried wheels into /tmp/site; them and src/ on PYTHONPATH; NCCL off NVLink multicast; offline
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
  OUT=${OUT:-/tmp}
  export OUT
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"
}

left() { echo $(( ${JOB_BUDGET:-570} - ($(date +%s) - JOB_START) )); }

dmd2_anchor() {  # dmd2_anchor LATENT TIMEOUT: the plain-diffusers DMD2 step at LATENT, its JSON as anchor_dmd2_LATENT
  local start; start=$(date +%s)
  LATENT=$1 timeout "$2" python3 .bench_anchor/plain_diffusers_dmd2_step.py >> "$OUT/anchor.log" 2>&1
  echo "anchor $1 rc=$? wall=$(( $(date +%s) - start )) s"
  if [ -f "$OUT/dmd2_step.json" ]; then mv "$OUT/dmd2_step.json" "$OUT/anchor_dmd2_$1.json"; fi
}

job_sft() {
  wheels_env
  python3 .bench_anchor/plain_diffusers_wan_step.py > "$OUT/anchor.log" 2>&1; echo "anchor rc=$?"
  grep -v "^{" "$OUT/anchor.log" | tail -8
  python3 bench/sft_step.py "$@" > "$OUT/ours.log" 2>&1; echo "ours rc=$?"; tail -12 "$OUT/ours.log"
  if [ -n "${PROFILE:-}" ]; then  # host/GPU time split of the small-latent eager step, default wrapper
    python3 bench/sft_step.py --one 21 30 52 0 0 native --steps 8 --profile "$OUT/profile_plain_eager.txt" \
      > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
  fi
}

job_perf() {
  wheels_env
  python3 -c "import torch; print('cudnn', torch.backends.cudnn.version())"
  python3 -m pip list 2>/dev/null | grep -i -E "flash|cudnn|triton" | head
  local start i=0 run T H W COMP SHARD ATT RESHARD l extra
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
  for run in ${PERF_RUNS:-"21:60:104:default:0:native:-"}; do
    IFS=: read -r T H W COMP SHARD ATT RESHARD <<< "$run"
    i=$((i + 1)); l=$(left)
    if [ "$l" -lt 60 ]; then echo "skip $run: $l s left"; continue; fi
    extra=(); [ "$RESHARD" != "-" ] && extra=(--reshard "$RESHARD")
    start=$(date +%s)
    timeout "$l" python3 bench/sft_step.py --one "$T" "$H" "$W" "$COMP" "$SHARD" "$ATT" --steps "${STEPS:-10}" --warmup 3 \
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
}

job_distill() {
  JOB_BUDGET=${JOB_BUDGET:-560}
  wheels_env
  local latent start
  for latent in ${ANCHOR_LATENTS-21x60x104 21x30x52}; do dmd2_anchor "$latent" 300; done
  [ -f "$OUT/anchor.log" ] && grep "^{" "$OUT/anchor.log" | cut -c1-200
  start=$(date +%s)
  python3 bench/distill_step.py --deadline "$(left)" "$@" > "$OUT/ours.log" 2>&1
  echo "ours rc=$? wall=$(( $(date +%s) - start )) s"
  grep -v "^{" "$OUT/ours.log" | tail -40
}

job_pdd() {
  wheels_env
  local start; start=$(date +%s)
  timeout 200 python3 bench/pdd_sampling.py > "$OUT/sampling.log" 2>&1; echo "sampling rc=$? wall=$(( $(date +%s) - start )) s"
  tail -6 "$OUT/sampling.log"
  dmd2_anchor 21x60x104 150
  grep "^{" "$OUT/anchor.log" | cut -c1-200
  start=$(date +%s)
  python3 bench/distill_step.py --deadline "$(left)" --tag _pdd \
    --runs "${PDD_RUNS:-pdd_euler:21x60x104:default:off,pdd_mid:21x60x104:default:off}" "$@" > "$OUT/ours.log" 2>&1
  echo "ours rc=$? wall=$(( $(date +%s) - start )) s"
  grep -v "^{" "$OUT/ours.log" | tail -20
}

job_dag() {
  [ -n "${DEVICE_ENV_DONE:-}" ] || source device-env.sh || exit 1  # a caller that sourced it already sets DEVICE_ENV_DONE=1
  python3 -c "import av, mlflow, ruamel.yaml; print('av', av.__version__, 'mlflow', mlflow.__version__)" || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 bench/real_shape_dag.py --budget "${JOB_BUDGET:-540}" ${DAG_ARGS:-}
  local rc=$?
  python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "real_shape_dag.json")))
print("setup_s", d.get("setup_s"), "total_s", d.get("total_s"))
for r in d["stages"]:
    print(f'{r["stage"]:24s} rc={r.get("rc")} wall={r.get("wall_s")} busy={r.get("gpu_busy_fraction")} peak={r.get("peak_gpu_mem_gib")} '
          f'pre={r.get("before_gpu_s")} post={r.get("after_gpu_s")} hashed={r.get("hashed_mib")} reused={r.get("reused_mib")} '
          f'{r.get("skipped", "")}{r.get("error", "")[:300]}')
PY
  return $rc
}

# fa4: parts, most important first ($PARTS picks and orders them; default: all of these), each with the seconds it
# needs and its cap: agreement (FA4 against SDPA on every plugin's real-shape forward and one training step's
# gradients), kernels (attention alone at 1x32760x12x128, full and block-causal), anchor_fa4 / anchor_dmd2 (plain
# diffusers: FA4 as a custom op; DMD2 at 21x60x104), sft (fa4, regional compile, GPU time per kernel family), distill
# (DMD2 with a memory snapshot after iteration 3, and PDD), dfsft_sparse / dfsft_prefix (the causal student's
# block-causal attention: one block-sparse call / per-chunk prefix calls), sf (Self-Forcing, AC on), sft_native (the
# same job's SDPA baseline), sft_whole (the whole transformer compiled). 21x60x104 latents ($JOB_LATENT; a CPU dry run:
# JOB_LATENT=9x8x8 BENCH_SMOKE=1), batch 1; the job ends naming the parts it skipped for time as the next call's PARTS.
job_fa4() {
  JOB_BUDGET=${JOB_BUDGET:-530}
  OUT=${OUT:-/tmp/fa4_job}; mkdir -p "$OUT"; export OUT
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/fa4_kernel_cache}
  local env d p
  if ! python3 -c "import flash_attn.cute" 2>/dev/null; then
    for env in shared/tools/device-env.sh ../shared/tools/device-env.sh device-env.sh; do
      if [ -f "$env" ]; then echo "sourcing $env"; source "$env"; break; fi
    done
  fi
  case ":${PYTHONPATH:-}:" in *":$PWD/src:"*) ;; *) export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH};; esac
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" 2>&1 \
    | tee -a "$OUT/gpu.txt"
  python3 -c "import flash_attn.cute; from importlib.metadata import version; print('flash-attn-4', version('flash-attn-4'))" \
    2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
  ANCHORS=""
  for d in ${ANCHOR_DIR:-} .bench_anchor shared/anchors ../shared/anchors; do
    if [ -f "$d/plain_diffusers_fa4_step.py" ]; then ANCHORS=$d; break; fi
  done
  echo "anchors: ${ANCHORS:-none found}" | tee -a "$OUT/gpu.txt"
  SKIPPED=""
  L=${JOB_LATENT:-21x60x104}
  SFT=(python3 bench/sft_step.py --one ${L//x/ } default 0)  # then ATTENTION and flags
  for p in ${PARTS:-agreement anchor_fa4 anchor_dmd2 sft distill kernels dfsft_sparse dfsft_prefix sf sft_native sft_whole}; do
    fa4_part "$p"
    python3 bench/fa4_job_summary.py "$OUT" > "$OUT/summary.txt" 2>&1
  done
  cat "$OUT/summary.txt"
  echo "job wall $(( $(date +%s) - JOB_START )) s"
  [ -n "$SKIPPED" ] && echo "skipped for time; run them in another call: PARTS=\"${SKIPPED# }\" bash bench/gpu_job.sh fa4" \
    | tee -a "$OUT/job.txt"
  return 0
}

part() {  # part NAME NEED CAP COMMAND...: run COMMAND (log $OUT/NAME.log) if NEED seconds are left, under min(CAP, left) s
  local name=$1 need=$2 cap=$3; shift 3
  local l; l=$(left)
  if [ "$l" -lt "$need" ]; then echo "SKIP $name: $l s left, needs $need" | tee -a "$OUT/job.txt"; SKIPPED="$SKIPPED $name"; return; fi
  local t=$(( l < cap ? l : cap )) s; s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? wall=$(( $(date +%s) - s )) s (limit $t s, $(left) s left)" | tee -a "$OUT/job.txt"
}

result() { grep "^RESULT " "$OUT/$1.log" 2>/dev/null | tail -1 | sed 's/^RESULT //' > "$OUT/step_$1.json"; }  # RESULT line as JSON

fa4_part() {
  case $1 in
    agreement) part agreement 60 140 python3 bench/fa4_checks.py --parts agreement ;;
    kernels) part kernels 40 100 python3 bench/fa4_checks.py --parts kernels ;;
    anchor_fa4)
      if [ -n "$ANCHORS" ]; then part anchor_fa4 70 140 python3 "$ANCHORS/plain_diffusers_fa4_step.py"
      else echo "SKIP anchor_fa4: no anchors" | tee -a "$OUT/job.txt"; fi ;;
    anchor_dmd2)
      if [ -n "$ANCHORS" ]; then
        part anchor_dmd2 90 140 env LATENT=21x60x104 python3 "$ANCHORS/plain_diffusers_dmd2_step.py"
        [ -f "$OUT/dmd2_step.json" ] && mv "$OUT/dmd2_step.json" "$OUT/anchor_dmd2_21x60x104.json"
      else echo "SKIP anchor_dmd2: no anchors" | tee -a "$OUT/job.txt"; fi ;;
    sft) part sft 50 110 "${SFT[@]}" fa4 --steps 12 --warmup 4 --breakdown; result sft ;;
    distill)
      part distill 90 260 python3 bench/distill_step.py --tag _distill --steps 10 --warmup 4 --deadline "$(( $(left) - 10 ))" \
        --runs "dmd2_data:$L:default:off:attention=fa4;snapshot=3;need=85,pdd_euler:$L:default:off:attention=fa4;need=65" ;;
    dfsft_sparse) part dfsft_sparse 50 110 "${SFT[@]}" fa4_sparse --method dfsft --steps 10 --warmup 4; result dfsft_sparse ;;
    sf)
      part sf 110 200 python3 bench/distill_step.py --tag _sf --no-probe --steps 10 --warmup 4 --deadline "$(( $(left) - 10 ))" \
        --runs "sf:$L:default:on:attention=fa4;need=100" ;;
    dfsft_prefix) part dfsft_prefix 50 110 "${SFT[@]}" fa4 --method dfsft --steps 10 --warmup 4; result dfsft_prefix ;;
    sft_native) part sft_native 50 110 "${SFT[@]}" native --steps 10 --warmup 4; result sft_native ;;
    sft_whole) part sft_whole 150 400 "${SFT[@]}" fa4 --compile-mode model --steps 8 --warmup 3; result sft_whole ;;
    *) echo "unknown part $1" | tee -a "$OUT/job.txt" ;;
  esac
}

job_sp() {
  wheels_env
  local start; start=$(date +%s)
  python3 bench/sp_step.py "$@" > "$OUT/sp_step.log" 2>&1
  echo "sp_step rc=$? wall=$(( $(date +%s) - start )) s"
  grep -v "^{" "$OUT/sp_step.log" | tail -30
}

job_batch() {
  local budget=${1:?batch BUDGET_S PART...}; shift
  local final=$OUT; mkdir -p /tmp/res
  wheels_env
  part() {  # part NAME CAP_S COMMAND...
    local name=$1 cap=$2; shift 2
    local left=$(( budget - ($(date +%s) - JOB_START) - 12 )); local t=$(( cap < left ? cap : left ))
    if [ "$t" -lt 40 ]; then echo "== $name skipped: $left s left"; return; fi
    mkdir -p "/tmp/res/$name"; local s; s=$(date +%s)
    OUT=/tmp/res/$name JOB_BUDGET=$((t - 5)) timeout "$t" "$@" > "/tmp/res/$name/log.txt" 2>&1
    echo "== $name rc=$? wall=$(( $(date +%s) - s )) s (cap $t)"; grep -v "^\s*$" "/tmp/res/$name/log.txt" | tail -"${TAIL:-6}" | cut -c1-400
    (cd /tmp && tar czf "$final/results.tgz" res)
  }
  local p
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
      *) echo "unknown part $p (nft vbench sparse latency cd sp cosmos hunyuan)" ;;
    esac
  done
  echo "batch done in $(( $(date +%s) - JOB_START )) s"
}

case $job in
  sft) job_sft "$@" ;;
  perf) job_perf ;;
  distill) job_distill "$@" ;;
  pdd) job_pdd "$@" ;;
  fa4) job_fa4 ;;
  dag) job_dag ;;
  sp) job_sp "$@" ;;
  batch) job_batch "$@" ;;
  run) wheels_env; "$@" ;;
  *) echo "unknown job $job: sft, perf, distill, pdd, fa4, dag, sp, batch or run (bench/gpu_job.sh's header)"; exit 2 ;;
esac
