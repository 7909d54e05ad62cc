#!/usr/bin/env bash
# One GPU job: the plain-diffusers anchor, then our SFT step, on the same machine state.
# Expects wheels for packages the GPU image lacks in .whl/ (diffusers, importlib_metadata) and the
# anchor script (from shared/anchors/) in .bench_anchor/; both are carried, not committed.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"
python3 .bench_anchor/plain_diffusers_wan_step.py > "$OUT/anchor.log" 2>&1; echo "anchor rc=$?"; grep -v "^{" "$OUT/anchor.log" | tail -8
python3 bench/sft_step.py "$@" > "$OUT/ours.log" 2>&1; echo "ours rc=$?"; tail -12 "$OUT/ours.log"
if [ -n "${PROFILE:-}" ]; then  # host/GPU time split of the small-latent eager step, default wrapper
  python3 bench/sft_step.py --one 21 30 52 0 0 native --steps 8 --profile "$OUT/profile_plain_eager.txt" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
fi
