#!/usr/bin/env bash
# The open H200 measurements of issues 4 and 5 in one device call (~9 minutes), in order of
# value. Every step has its own time limit, so a slow step cannot starve the later ones; logs and
# JSON land under $OUT (at most 8 files come back: keep this list short).
#
#   run: bash scripts/h200_next.sh        (on the device machine, from the repository root)
#
# 1. kernel_probe --launch-bound: is a Mosaic call bound by its launch (host) or by streaming?
# 2. kernel_probe --final: GPU checks (FP8, grouped NVFP4 +-RAC), dense decode (ours vs XLA
#    BF16/FP8), grouped decode after the while-loop fix (ours vs ragged_dot_mgpu).
# 3. bench_rollout: the FP8 arm and BF16 in one run, then the attention / MoE / rest split.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200_next}
mkdir -p "$OUT"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

timeout 120 python3 scripts/kernel_probe.py --launch-bound --out "$OUT/lb" > "$OUT/launch_bound.log" 2>&1
echo "launch-bound rc $?"; grep -E "TB/s|us/call" "$OUT/launch_bound.log"

timeout 200 python3 scripts/kernel_probe.py --final --out "$OUT/final" > "$OUT/final.log" 2>&1
echo "final rc $?"; grep -E "PASS|FAIL|us  floor" "$OUT/final.log" | cut -c1-150

XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 230 python3 scripts/bench_rollout.py --quick \
  --no-ragged --bf16-path mgpu --precisions fp8,bf16 --budget-s 170 \
  --commit "$commit" --out "$OUT/rollout" > "$OUT/rollout.log" 2>&1
echo "rollout rc $?"; grep -E "^\||split" "$OUT/rollout.log"
