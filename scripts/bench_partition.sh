#!/usr/bin/env bash
# Partitioner benchmarks.
#   bash scripts/bench_partition.sh [nodes ...]       time the C++ partitioner on
#                                                    synthetic graphs (Release build;
#                                                    see scripts/bench_partition.cpp)
#   bash scripts/bench_partition.sh traffic [args]   bytes_cost=0 against the default
#                                                    on 2 ranks: bytes crossing the
#                                                    cuts and step time side by side
#                                                    (scripts/bench_partition_traffic.py)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "traffic" ]]; then
  shift
  export OMP_NUM_THREADS=1
  exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node 2 \
    scripts/bench_partition_traffic.py "$@"
fi
cmake -S . -B build/bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DMPMD_BUILD_PYTHON=OFF >/dev/null
cmake --build build/bench --target mpmd_bench_partition >/dev/null
./build/bench/mpmd_bench_partition "$@"
