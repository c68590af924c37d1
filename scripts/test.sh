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
echo "[test] Python suite (pytest)"
"$PYTHON" -m pytest -q --durations=25 tests || status=1
exit $status
