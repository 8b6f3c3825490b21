#!/usr/bin/env bash
# This session's H200 measurements in one device call (~6 minutes). Every step has its own time
# limit, so a slow step cannot starve the later ones; logs and JSON land under $OUT.
#
#   run: COMMIT=<sha> bash scripts/h200_next.sh   (on the device machine, from the repo root)
#
# 1. kernel_probe --trace-grouped: every kernel of a decode-step grouped call, +-RAC, with the
#    kernel output read back by one gather of the live rows (was: a transposed copy of every
#    tile).
# 2. bench_rollout, all four arms at batch 128 / prompt 256, traced.
# 3. The nvfp4 arm again under XLA's dynamic-slice fusion (the per-layer slices of the stacked
#    attention weights are 4 device memcpys per layer without it).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200_next}
mkdir -p "$OUT"
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

timeout 100 python3 scripts/kernel_probe.py --trace-grouped --out "$OUT/tg" > "$OUT/trace_grouped.log" 2>&1
echo "trace-grouped rc $?"; grep -A8 "== traced" "$OUT/trace_grouped.log" | cut -c1-150

rollout() {  # rollout TAG SECONDS ARGS...
  local tag=$1 limit=$2; shift 2
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "$limit" python3 scripts/bench_rollout.py --quick \
    --no-ragged --bf16-path mgpu --no-split --profile-steps 4 --commit "$commit" \
    --out "$OUT/$tag" "$@" > "$OUT/$tag.log" 2>&1
  echo "$tag rc $?"; grep -E "^\||busy|^ +[0-9.]+ ms" "$OUT/$tag.log" | cut -c1-120
}
rollout rollout 280 --precisions nvfp4,nvfp4_rac,bf16,fp8 --budget-s 230
XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true rollout rollout_dsf 110 --precisions nvfp4
