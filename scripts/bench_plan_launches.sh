#!/usr/bin/env bash
# BENCHMARKS.md, "plan='auto' decided by trials": three launches of
# scripts/bench_plan_auto.py, each with a fresh profile cache (it makes its
# own), on 2 gloo ranks x 1 thread: the plan each chose, planning time, and
# its measured step against the default and the grid's best in that launch.
#   bash scripts/bench_plan_launches.sh [--vocab 12288 --grid ...]  (default: the wide-head model)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
args=("$@")
((${#args[@]})) || args=(--vocab 12288 --grid)
for launch in 1 2 3; do
  echo "== launch $launch: ${args[*]}"
  "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node 2 \
    scripts/bench_plan_auto.py "${args[@]}" 2>&1 \
    | grep -E "^(planning|chosen|plan predicted|plan / best|default 1f1b|plan  )" || true
done
