#!/usr/bin/env bash
# The test command of README.md: set up what is missing, then run the C++
# suite (ctest over GTest) and the Python suite (pytest). Non-zero on any
# failure.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

PYTHON="${PYTHON:-python3}"
status=0
echo "[test] C++ suite (ctest)"
ctest --test-dir build/cmake --output-on-failure -j 2 || status=1
# Two pytest processes (one per core, at most 2; MPMD_TEST_WORKERS overrides),
# each taking whole test files (a file's grid of cases runs once, in one
# process): on two cores one process left 0.6 of a core idle, waiting on
# ranks (BENCHMARKS.md, "The test command in two processes").
workers="${MPMD_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 1 ))}"
echo "[test] Python suite (pytest, $workers processes)"
"$PYTHON" -m pytest -q --durations=25 -n "$workers" --dist loadfile \
  --no-loadscope-reorder tests || status=1
exit $status
