#!/usr/bin/env bash
# BENCHMARKS.md, "Warm restarts": a launch on empty caches (cold), the same
# launch again (warm: Inductor's cache and the capture store filled by the
# cold one), and again with the capture store off (Inductor's cache only).
# 2 ranks, one step, compiled (Inductor) stage programs. Per model, the
# wall time of the whole torchrun, then each rank's phases
# (scripts/bench_warm_restart.py). The example GPT is timed as the README
# runs it (examples/train_gpt.py --compile --steps 1) and by the phase script.
#   bash scripts/bench_warm_restart.sh [gpt llama]
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/bench_warm_inductor MPMD_CAPTURE_CACHE=/tmp/bench_warm_captures
launch() {  # label, then the script and its arguments
  local label=$1; shift
  local s; s=$(date +%s.%N)
  BENCH_T0=$s python3 -m torch.distributed.run --standalone --nproc-per-node 2 "$@" \
    > /tmp/bench_warm_last.log 2>&1
  local rc=$?
  echo "$label: $(echo "$(date +%s.%N) - $s" | bc) s (rc=$rc)"
  grep '^\[{' /tmp/bench_warm_last.log || true
}
for model in ${@:-gpt llama}; do
  if [ "$model" = gpt ]; then
    example=(examples/train_gpt.py --compile --steps 1 --sample-chars 0 --eval-every 1000
             --out-dir /tmp/bench_warm_out)
    rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$MPMD_CAPTURE_CACHE"
    launch "example gpt cold" "${example[@]}"
    launch "example gpt warm" "${example[@]}"
    MPMD_CAPTURE_CACHE=0 launch "example gpt warm, capture store off" "${example[@]}"
  fi
  rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$MPMD_CAPTURE_CACHE"
  launch "$model cold" scripts/bench_warm_restart.py --model "$model"
  launch "$model warm" scripts/bench_warm_restart.py --model "$model"
  MPMD_CAPTURE_CACHE=0 launch "$model warm, capture store off" \
    scripts/bench_warm_restart.py --model "$model"
done
