#!/usr/bin/env bash
# The test command of README.md: set up what is missing, then run the C++
# suite (ctest over GTest) and the Python suite (pytest). Non-zero on any
# failure.
set -euo pipefail
cd "$(dirname "$0")/.."

# The Python modules first: pytest needs them, the C++ suite does not.
MPMD_BUILD_TARGETS="_C _runtime" bash scripts/setup.sh

PYTHON="${PYTHON:-python3}"
status=0
# The C++ suite is built (its unit, the benchmarks) and run beside pytest,
# at a lower priority: pytest leaves a tenth of the two cores idle (ranks
# waiting on each other, its last file alone), which the C++ suite's 16 s
# of CPU fill, off the command's critical path (BENCHMARKS.md, "The C++
# suite beside pytest").
cpp_log="$(mktemp "${TMPDIR:-/tmp}/mpmd_ctest.XXXXXX")"
echo "[test] C++ suite (ctest), built and run beside pytest; its output follows pytest's"
( nice -n 10 cmake --build build/cmake -j 1 &&
  nice -n 10 ctest --test-dir build/cmake --output-on-failure -j 2 ) >"$cpp_log" 2>&1 &
cpp_pid=$!
# Two pytest processes (one per core, at most 2; MPMD_TEST_WORKERS overrides),
# each taking whole test files (a file's grid of cases runs once, in one
# process): on two cores one process left 0.6 of a core idle, waiting on
# ranks (BENCHMARKS.md, "The test command in two processes").
workers="${MPMD_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 1 ))}"
echo "[test] Python suite (pytest, $workers processes)"
"$PYTHON" -m pytest -q --durations=25 -n "$workers" --dist loadfile \
  --no-loadscope-reorder tests || status=1
echo "[test] C++ suite (ctest)"
wait "$cpp_pid" || status=1
cat "$cpp_log"
rm -f "$cpp_log"
exit $status
