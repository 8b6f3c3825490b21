#!/usr/bin/env bash
# Issue 7 on a multi-GPU kind (nvidia-h100-x2/x4/x8 or nvidia-h200-x2/x4/x8), one call:
#
#   run (device machine, repo root): COMMIT=<sha> bash scripts/multigpu_next.sh [STEPS]
#
# NVLink multicast stays off (the device README: it can take the host's GPUs down for others);
# the variables are set again here in case the environment lacks them.
#
# Steps (default: all three, ~10 minutes on 8 GPUs; each has its own time limit):
#   multi   configs/multigpu_small.yaml on every GPU: 4 prompts x 16 samples per GPU per step,
#           30 RL steps after 300 SFT steps; metrics.jsonl has the step split (time/rollout_s,
#           time/train_s, time/sync_s), rollout/tokens_per_s and mem/peak_gib_* (per GPU)
#   single  the same per-GPU batch on one GPU (CUDA_VISIBLE_DEVICES=0, 4 prompts per step):
#           the scaling baseline
#   seed1   the same global batch as `multi` on one GPU (32 prompts per step): the loss curve
#           to compare with `multi` on the same seed
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/multigpu_next}
mkdir -p "$OUT"
if [ -z "${COMMIT:-}" ]; then
  echo "COMMIT=<sha> is required (the commit that runs; git HEAD on the device can be stale)"
  exit 2
fi
N=$(python3 -c "import jax; print(jax.device_count())")
echo "commit $COMMIT, $N devices: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c)"
train() {  # train TAG SECONDS ARGS...
  local tag=$1 limit=$2; shift 2
  timeout -k 15 "$limit" python3 -m quads_jax.train --config configs/multigpu_small.yaml \
    console=false tensorboard=false run_dir="$OUT/$tag" "$@" > "$OUT/$tag.log" 2>&1
  echo "$tag rc $?"
  python3 - "$OUT/$tag/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
rl = [r for r in rows if r.get("phase") == "rl"][1:]  # the first step compiles
keys = ("time/step_s", "time/rollout_s", "time/train_s", "time/sync_s", "rollout/tokens_per_s",
        "mem/peak_gib_max", "mem/peak_gib_min", "train/loss", "reward/mean")
print({k: round(statistics.median(r[k] for r in rl), 4) for k in keys if rl and k in rl[0]})
print("losses", [round(r["train/loss"], 5) for r in rl][:12])
PY
}
for step in "${@:-multi single seed1}"; do
  for s in $step; do
    case $s in
      multi) train multi 360 rollout.prompts_per_step=$((4 * N)) ;;
      single) CUDA_VISIBLE_DEVICES=0 train single 240 rollout.prompts_per_step=4 \
        mesh.fsdp=1 mesh.expert=1 ;;
      seed1) CUDA_VISIBLE_DEVICES=0 train seed1 300 rollout.prompts_per_step=$((4 * N)) \
        mesh.fsdp=1 mesh.expert=1 ;;
      *) echo "unknown step $s" ;;
    esac
  done
done
