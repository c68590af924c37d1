#!/usr/bin/env bash
# BENCHMARKS.md, "Captures kept for the process" and "Joint traces kept for
# the process": plan="auto"'s planning time (profile, search, trials) on the
# deep narrow zoo model with a memo off and on, alternating launches. MEMO
# names the memo's switch: MPMD_CAPTURE_MEMO (the default) or
# MPMD_EXPORT_MEMO. Needs a first launch's json of
# scripts/bench_plan_auto_zoo.py (grid measured once, or any json whose
# "grid" lists the entries to measure beside the plan):
#   [MEMO=MPMD_EXPORT_MEMO] bash scripts/bench_capture_memo.sh [path/to/deep_narrow.1.json]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
first="${1:-/tmp/mpmd_auto_zoo/deep_narrow.1.json}"
for launch in 1 2; do
  for memo in 0 1; do
    echo "== ${MEMO:-MPMD_CAPTURE_MEMO}=$memo launch $launch"
    env "${MEMO:-MPMD_CAPTURE_MEMO}=$memo" "${PYTHON:-python3}" -m torch.distributed.run --standalone \
      --nproc-per-node 2 scripts/bench_plan_auto_zoo.py --model deep_narrow --keep 1 \
      --from-json "$first" 2>&1 | grep -E "^\[" | grep -v finalist || true
  done
done
