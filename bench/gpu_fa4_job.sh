#!/usr/bin/env bash
# One GPU job for issue 24 (FlashAttention-4 on Hopper), on one H200, inside the 9-minute device limit:
#   bash bench/gpu_fa4_job.sh            (after `source device-env.sh`, which installs the FA4 wheels of .whl/ and
#                                         /tmp/parts; when flash_attn.cute does not import, the job sources it itself
#                                         from shared/tools/, ../shared/tools/ or the repo root if it finds it)
# Parts, most important first ($PARTS, space-separated, picks and orders them); each is skipped when the job has
# less than its need left of $JOB_BUDGET (default 530 s), runs under `timeout`, and writes to $OUT as it ends
# (a cut job still reports; bench/fa4_job_summary.py summarises whatever is there after every part):
#   agreement    bench/fa4_checks.py: FA4 against SDPA on every plugin's real-shape forward (bidirectional, PDD,
#                causal full + streaming over the KV cache) and one training step's gradients (bidirectional, causal)
#   kernels      bench/fa4_checks.py: attention alone at 1x32760x12x128, full and block-causal (SDPA bool mask,
#                SDPA per-chunk prefix, FA4 mask_mod only, FA4 per chunk, FA4 block-sparse); block lists vs FA4's own
#   anchor_fa4   plain_diffusers_fa4_step.py (plain diffusers, blocks compiled, SDPA and FA4 as a custom op)
#   anchor_dmd2  plain_diffusers_dmd2_step.py at 21x60x104 (eager)
#   sft          our SFT step, fa4, regional compile, + GPU time per kernel family of 2 steady steps
#   distill      DMD2 (data_latent, AC off, with a CUDA memory snapshot after iteration 3: what holds the peak)
#                and PDD (Euler target), fa4, regional compile
#   dfsft_sparse DFSFT step of the causal student (block-causal training attention), fa4_sparse (one block-sparse call)
#   sf           Self-Forcing iteration, fa4, regional compile, AC on
#   dfsft_prefix DFSFT step, fa4 (per-chunk prefix calls)
#   sft_native   our SFT step, native SDPA, regional compile (the same job's baseline)
#   sft_whole    our SFT step, fa4, the whole transformer compiled (compile_mode: model) against regional
# 21x60x104 latents, batch 1, 512x4096 text; 4 warm-up + 6 timed steps (sft: + 2 for the profiled ones).
# The whole list needs about three 9-minute calls (the whole-model compile alone takes minutes); the job ends by
# naming the parts it skipped for time as the PARTS of the next call.
# Anchors: the first of $ANCHOR_DIR, .bench_anchor/, shared/anchors/, ../shared/anchors/ holding them.
set -u
JOB_START=$(date +%s)
BUDGET=${JOB_BUDGET:-530}
OUT=${OUT:-/tmp/fa4_job}; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/fa4_kernel_cache}
if ! python3 -c "import flash_attn.cute" 2>/dev/null; then
  for env in shared/tools/device-env.sh ../shared/tools/device-env.sh device-env.sh; do
    if [ -f "$env" ]; then echo "sourcing $env"; source "$env"; break; fi
  done
fi
case ":${PYTHONPATH:-}:" in *":$PWD/src:"*) ;; *) export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH};; esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
python3 -c "import flash_attn.cute; from importlib.metadata import version; print('flash-attn-4', version('flash-attn-4'))" 2>&1 \
  | tail -1 | tee -a "$OUT/gpu.txt"
ANCHORS=""
for d in ${ANCHOR_DIR:-} .bench_anchor shared/anchors ../shared/anchors; do
  if [ -f "$d/plain_diffusers_fa4_step.py" ]; then ANCHORS=$d; break; fi
done
echo "anchors: ${ANCHORS:-none found}" | tee -a "$OUT/gpu.txt"

SKIPPED=""
left() { echo $(( BUDGET - ($(date +%s) - JOB_START) )); }
# part NAME NEED CAP COMMAND...: run COMMAND (log $OUT/NAME.log) if NEED seconds are left, under min(CAP, left) s
part() {
  local name=$1 need=$2 cap=$3; shift 3
  local l; l=$(left)
  if [ "$l" -lt "$need" ]; then echo "SKIP $name: $l s left, needs $need" | tee -a "$OUT/job.txt"; SKIPPED="$SKIPPED $name"; return; fi
  local t=$(( l < cap ? l : cap )) s; s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? wall=$(( $(date +%s) - s )) s (limit $t s, $(left) s left)" | tee -a "$OUT/job.txt"
}
# result NAME: the RESULT line of $OUT/NAME.log as $OUT/step_NAME.json
result() { grep "^RESULT " "$OUT/$1.log" 2>/dev/null | tail -1 | sed 's/^RESULT //' > "$OUT/step_$1.json"; }
summary() { python3 bench/fa4_job_summary.py "$OUT" > "$OUT/summary.txt" 2>&1; }
L=${JOB_LATENT:-21x60x104}  # our steps' latent (a CPU dry run of this script: JOB_LATENT=9x8x8 BENCH_SMOKE=1)
SFT=(python3 bench/sft_step.py --one ${L//x/ } default 0)  # then ATTENTION and flags

for p in ${PARTS:-agreement anchor_fa4 anchor_dmd2 sft distill kernels dfsft_sparse dfsft_prefix sf sft_native sft_whole}; do
  case $p in
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
    *) echo "unknown part $p" | tee -a "$OUT/job.txt" ;;
  esac
  summary
done
cat "$OUT/summary.txt"
echo "job wall $(( $(date +%s) - JOB_START )) s"
[ -n "$SKIPPED" ] && echo "skipped for time; run them in another call: PARTS=\"${SKIPPED# }\" bash bench/gpu_fa4_job.sh" | tee -a "$OUT/job.txt"
exit 0
