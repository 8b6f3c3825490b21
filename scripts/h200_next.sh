#!/usr/bin/env bash
# The next H200 call in one script (~8 minutes). Every step has its own time limit,
# so a slow step cannot starve the later ones; logs and JSON land under $OUT.
#
#   run: COMMIT=<sha> bash scripts/h200_next.sh   (on the device machine, from the repo root)
#
# 1. The GPU checks of every kernel path (bench_kernels --part check: NVFP4 dense/grouped +-RAC,
#    W4A16, FP8), now that the epilogues apply the scales and store the caller's dtype.
# 2. bench_rollout, all four arms at batch 128 / prompt 256, traced.
# 3. nvfp4 with cuBLAS GEMMs and dynamic-slice fusion (below).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200_next}
mkdir -p "$OUT"
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

rollout() {  # rollout TAG SECONDS ARGS...
  local tag=$1 limit=$2; shift 2
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "$limit" python3 scripts/bench_rollout.py \
    --no-ragged --bf16-path mgpu --no-split --commit "$commit" \
    --out "$OUT/$tag" "$@" > "$OUT/$tag.log" 2>&1
  echo "$tag rc $?"; grep -E "^\||busy|^ +[0-9.]+ ms" "$OUT/$tag.log" | cut -c1-120
}
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 170 python3 scripts/bench_kernels.py --part check \
  --out "$OUT/check" > "$OUT/check.log" 2>&1
echo "check rc $?"; grep -E "PASS|FAIL" "$OUT/check.log" | cut -c1-110
rollout rollout 300 --quick --profile-steps 4 --precisions nvfp4,nvfp4_rac,bf16,fp8 --budget-s 240
# 3. The per-layer copies of the scanned attention weights (memcpy128, 1.2 ms per step): with
#    cuBLAS instead of XLA's Triton GEMM, dynamic-slice fusion can read the stacked weight in place.
XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true" \
  rollout rollout_cublas 150 --quick --profile-steps 4 --precisions nvfp4 --budget-s 100
