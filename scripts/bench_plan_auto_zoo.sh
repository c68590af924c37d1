#!/usr/bin/env bash
# BENCHMARKS.md, "plan='auto' decided by trials": three launches per zoo
# model (scripts/bench_plan_auto_zoo.py), each with a fresh profile cache.
# Launch 1 measures the whole grid beside the plan and the default;
# launches 2 and 3 the 6 entries launch 1 measured fastest.
#   bash scripts/bench_plan_auto_zoo.sh [model ...]     (default: every model)
# MPMD_BENCH_FIRST=DIR: every launch measures the 6 entries that DIR's
# <model>.1.json (an earlier run's first launch) measured fastest.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
models=("$@")
((${#models[@]})) || models=(wide_head deep_narrow mixed_widths moe hf_llama tiny)
out="${MPMD_BENCH_OUT:-/tmp/mpmd_auto_zoo}"
mkdir -p "$out"
run() {  # each launch with an empty capture store, as with an empty profile cache
  local captures
  captures="$(mktemp -d)"
  MPMD_CAPTURE_CACHE="$captures" "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node 2 \
    scripts/bench_plan_auto_zoo.py "$@" 2>&1 | grep -E "^\[" || true
  rm -rf "$captures"
}
for model in "${models[@]}"; do
  if [[ -n "${MPMD_BENCH_FIRST:-}" ]]; then
    first="$MPMD_BENCH_FIRST/$model.1.json"
  else
    first="$out/$model.1.json"
    run --model "$model" --json "$first"
  fi
  for launch in $([[ -n "${MPMD_BENCH_FIRST:-}" ]] && echo 1) 2 3; do
    run --model "$model" --keep 6 --from-json "$first" --json "$out/$model.$launch.json"
  done
done
