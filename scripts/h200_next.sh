#!/usr/bin/env bash
# The next H200 call in one script (~6 minutes). Every step has its own time limit,
# so a slow step cannot starve the later ones; logs and JSON land under $OUT.
#
#   run: COMMIT=<sha> bash scripts/h200_next.sh   (on the device machine, from the repo root)
#
# 1. The GPU checks the previous call's time limit cut (bench_kernels --part check-grouped:
#    grouped NVFP4 +-RAC at 256 tokens, grouped W4A16, dense and grouped FP8), for the epilogues
#    that apply the scales and store the caller's dtype.
# 2. bench_rollout, all four arms at batch 128 / prompt 256, traced, with the decode program's
#    compiler options (engine.DECODE_COMPILER_OPTIONS).
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
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 120 python3 scripts/bench_kernels.py \
  --part check-grouped --out "$OUT/check" > "$OUT/check.log" 2>&1
echo "check rc $?"; grep -E "PASS|FAIL" "$OUT/check.log" | cut -c1-110
rollout rollout 250 --quick --profile-steps 4 --precisions nvfp4,nvfp4_rac,bf16,fp8 --budget-s 200
