#!/usr/bin/env bash
# BENCHMARKS.md: scripts/bench_predict.py over 2 ranks (gloo, 1 thread each).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node 2 \
  scripts/bench_predict.py "$@"
