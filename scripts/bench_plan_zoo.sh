#!/usr/bin/env bash
# The planner's predictions against measured steps on every zoo model
# (scripts/bench_plan_zoo.py; issue 31, item 2): one launch of 2 gloo ranks,
# 1 thread each, per model. Extra arguments go to every launch (e.g. --steps 7).
# Each model's launch writes its measurements to ${ZOO_OUT:-/tmp}/zoo_<model>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
for model in wide_head deep_narrow mixed_widths moe hf_llama tiny; do
  OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 scripts/bench_plan_zoo.py \
    --model "$model" --json "${ZOO_OUT:-/tmp}/zoo_${model}.json" "$@"
done
