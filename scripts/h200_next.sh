#!/usr/bin/env bash
# This session's second H200 call in one script (~7 minutes). Every step has its own time
# limit, so a slow step cannot starve the later ones; logs and JSON land under $OUT.
#
#   run: COMMIT=<sha> bash scripts/h200_next.sh   (on the device machine, from the repo root)
#
# 1. kernel_probe --n-group: the grouped decode matmuls with 1, 2, 4 weight-row tiles per work
#    item (now copied together in one pipeline step), +-RAC, checked against the reference.
# 2. bench_rollout nvfp4 and nvfp4_rac at batch 128 / prompt 256, traced, at n_group 1 and 2.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200_next}
mkdir -p "$OUT"
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

timeout 170 python3 scripts/kernel_probe.py --n-group --out "$OUT/ng" > "$OUT/n_group.log" 2>&1
echo "n-group rc $?"; grep -E "PASS|FAIL|n_group=|TB/s" "$OUT/n_group.log" | cut -c1-170

rollout() {  # rollout TAG SECONDS ARGS...
  local tag=$1 limit=$2; shift 2
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "$limit" python3 scripts/bench_rollout.py --quick \
    --no-ragged --bf16-path mgpu --no-split --profile-steps 4 --commit "$commit" \
    --out "$OUT/$tag" "$@" > "$OUT/$tag.log" 2>&1
  echo "$tag rc $?"; grep -E "^\||busy|^ +[0-9.]+ ms" "$OUT/$tag.log" | cut -c1-120
}
rollout rollout_ng1 150 --precisions nvfp4,nvfp4_rac
rollout rollout_ng2 150 --precisions nvfp4,nvfp4_rac --w4a4-n-group 2
