#!/usr/bin/env bash
# BENCHMARKS.md, "Captures kept for the process, programs through Inductor's
# cache": wall time of the example GPT with --compile for one step, 2 ranks,
# on an empty Inductor cache (cold) and again (warm), with this tree's stage
# programs and with those of a59570a (Inductor's FX graph cache bypassed).
#   bash scripts/bench_warm_start.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1
run() { local s=$(date +%s.%N); python3 -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt.py --compile --steps 1 --sample-chars 0 --eval-every 1000 --out-dir /tmp/warm_out > /tmp/warm_last.log 2>&1; echo "$1 $(echo "$(date +%s.%N) - $s" | bc) rc=$?"; }
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_warm_new; rm -rf $TORCHINDUCTOR_CACHE_DIR
run new-cold; run new-warm
cp torch_mpmd/programs/stage_programs.py /tmp/sp_keep.py
git show a59570a:torch_mpmd/programs/stage_programs.py > torch_mpmd/programs/stage_programs.py
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_warm_old; rm -rf $TORCHINDUCTOR_CACHE_DIR
run old-cold; run old-warm
cp /tmp/sp_keep.py torch_mpmd/programs/stage_programs.py
git status --short
