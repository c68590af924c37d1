#!/usr/bin/env bash
# Pipelined step time vs one process, and live activations per rank
# (BENCHMARKS.md, "Pipelined training"). Extra arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node 2 \
  scripts/bench_pipeline.py "$@"
