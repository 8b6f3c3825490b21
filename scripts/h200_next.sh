#!/usr/bin/env bash
# The open H200 measurements of issues 4 and 5 in one device call (~9 minutes). Every step has
# its own time limit, so a slow step cannot starve the later ones; logs and JSON land under
# $OUT (at most 8 files come back: keep this list short).
#
#   run: bash scripts/h200_next.sh        (on the device machine, from the repository root)
#
# 1. kernel_probe --attention: GPU checks of the decode attention kernel, its timings against
#    the jnp path at the 30B rollout shape. If a check fails, the rollout runs the jnp path.
# 2. bench_rollout: every arm at batch 128 / prompt 256, timed mid-generation, each decode
#    traced (where the device time goes), then the attention / MoE / rest split.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200_next}
mkdir -p "$OUT"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

timeout 110 python3 scripts/kernel_probe.py --attention --out "$OUT/attn" > "$OUT/attention.log" 2>&1
rc=$?
echo "attention rc $rc"; grep -E "PASS|FAIL|us  floor" "$OUT/attention.log" | cut -c1-160
impl=kernel
if [ $rc -ne 0 ] || grep -q FAIL "$OUT/attention.log" || ! grep -q PASS "$OUT/attention.log"; then
  impl=jnp
fi

XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 450 python3 scripts/bench_rollout.py --quick \
  --no-ragged --bf16-path mgpu --precisions nvfp4,bf16,fp8,nvfp4_rac --budget-s 380 \
  --decode-attention $impl --profile-steps 4 \
  --commit "$commit" --out "$OUT/rollout" > "$OUT/rollout.log" 2>&1
echo "rollout rc $? (decode attention: $impl)"; grep -E "^\||split|profile|kernels, busy" "$OUT/rollout.log" | cut -c1-200
