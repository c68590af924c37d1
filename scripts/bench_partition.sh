#!/usr/bin/env bash
# Builds (Release) and runs the partitioner benchmark; see
# scripts/bench_partition.cpp for the arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DMPMD_BUILD_PYTHON=OFF >/dev/null
cmake --build build/bench --target mpmd_bench_partition >/dev/null
./build/bench/mpmd_bench_partition "$@"
