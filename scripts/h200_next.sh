#!/usr/bin/env bash
# This session's last H200 call in one script (~7 minutes). Every step has its own time limit,
# so a slow step cannot starve the later ones; logs and JSON land under $OUT.
#
#   run: COMMIT=<sha> bash scripts/h200_next.sh   (on the device machine, from the repo root)
#
# 1. bench_rollout, all four arms at batch 128 / prompt 256, traced (grouped kernel results
#    materialized before the MoE unsort).
# 2. The rows still missing at batch 32: nvfp4_rac and fp8.
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
rollout rollout 290 --quick --profile-steps 4 --precisions nvfp4,nvfp4_rac,bf16,fp8 --budget-s 230
rollout rollout_b32 130 --batches 32 --prompts 256 --decode-steps 16 --reps 2 --prefill-reps 1 \
  --precisions nvfp4_rac,fp8 --budget-s 80
