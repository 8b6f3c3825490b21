#!/usr/bin/env bash
# The open H200 measurements of issues 4 and 5 in one device call (~9 minutes). Every step has
# its own time limit, so a slow step cannot starve the later ones; logs and JSON land under
# $OUT (at most 8 files come back: keep this list short).
#
#   run: bash scripts/h200_next.sh        (on the device machine, from the repository root)
#
# 1. kernel_probe --launch-bound: wall-clock per call next to the traced device duration of the
#    Mosaic kernel, with variants (fewer CTAs, one pipeline stage, split-K) that tell where the
#    ~45 us fixed per-call cost lives.
# 2. kernel_probe --trace-grouped: every kernel of a decode-step grouped call, +-RAC: what the
#    XLA side around the kernel costs (RAC's +34 % is mostly there).
# 3. bench_rollout: the rows still missing (bf16 at batch 256, fp8 and nvfp4_rac at 32 / 256).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200_next}
mkdir -p "$OUT"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

timeout 150 python3 scripts/kernel_probe.py --launch-bound --out "$OUT/lb" > "$OUT/launch_bound.log" 2>&1
echo "launch-bound rc $?"; grep -E "us/call|TB/s" "$OUT/launch_bound.log" | cut -c1-170

timeout 90 python3 scripts/kernel_probe.py --trace-grouped --out "$OUT/tg" > "$OUT/trace_grouped.log" 2>&1
echo "trace-grouped rc $?"; grep -A8 "== traced" "$OUT/trace_grouped.log" | cut -c1-150

XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 300 python3 scripts/bench_rollout.py \
  --batches 32,256 --prompts 256 --decode-steps 16 --reps 2 --prefill-reps 1 \
  --precisions bf16,fp8,nvfp4_rac --no-split --no-ragged --bf16-path mgpu --budget-s 240 \
  --commit "$commit" --out "$OUT/rollout" > "$OUT/rollout.log" 2>&1
echo "rollout rc $?"; grep -E "^\|" "$OUT/rollout.log"
