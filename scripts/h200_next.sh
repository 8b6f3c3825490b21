#!/usr/bin/env bash
# The open H200 measurements of issues 4 and 5 in one device call (~9 minutes). Every step has
# its own time limit, so a slow step cannot starve the later ones; logs and JSON land under
# $OUT (at most 8 files come back: keep this list short).
#
#   run: bash scripts/h200_next.sh        (on the device machine, from the repository root)
#
# 1. kernel_probe --n-group: GPU checks of the grouped kernel with 4 weight-row tiles per work
#    item, timings of the decode-step expert matmuls with 1 and 4. If a check fails, the rollout
#    runs with n_group=1.
# 2. bench_rollout: every arm at batch 128 / prompt 256 with the decode attention kernel, timed
#    mid-generation, each decode traced, then the attention / MoE / rest split.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200_next}
mkdir -p "$OUT"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

timeout 150 python3 scripts/kernel_probe.py --n-group --out "$OUT/ngroup" > "$OUT/ngroup.log" 2>&1
rc=$?
echo "n_group rc $rc"; grep -E "PASS|FAIL|us  floor" "$OUT/ngroup.log" | cut -c1-160
ng=4
if grep -q FAIL "$OUT/ngroup.log" || ! grep -q PASS "$OUT/ngroup.log"; then
  ng=1
fi

XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 420 python3 scripts/bench_rollout.py --quick \
  --no-ragged --bf16-path mgpu --precisions nvfp4,bf16,fp8,nvfp4_rac --budget-s 350 \
  --w4a4-n-group $ng --profile-steps 4 \
  --commit "$commit" --out "$OUT/rollout" > "$OUT/rollout.log" 2>&1
echo "rollout rc $? (n_group: $ng)"; grep -E "^\||split|profile|kernels, busy|mosaic|decode_attention" "$OUT/rollout.log" | cut -c1-200
