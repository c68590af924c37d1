#!/usr/bin/env bash
# BENCHMARKS.md, "plan='auto' decided by trials": three launches per zoo
# model (scripts/bench_plan_auto_zoo.py), each with a fresh profile cache.
# Launch 1 measures the whole grid beside the plan and the default;
# launches 2 and 3 the 6 entries launch 1 measured fastest.
#   bash scripts/bench_plan_auto_zoo.sh [model ...]     (default: every model)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
models=("$@")
((${#models[@]})) || models=(wide_head deep_narrow mixed_widths moe hf_llama tiny)
out="${MPMD_BENCH_OUT:-/tmp/mpmd_auto_zoo}"
mkdir -p "$out"
run() {
  "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node 2 \
    scripts/bench_plan_auto_zoo.py "$@" 2>&1 | grep -E "^\[" || true
}
for model in "${models[@]}"; do
  run --model "$model" --json "$out/$model.1.json"
  for launch in 2 3; do
    run --model "$model" --keep 6 --from-json "$out/$model.1.json" --json "$out/$model.$launch.json"
  done
done
