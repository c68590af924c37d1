#!/usr/bin/env bash
# README's main job: set up what is missing, then train the character-level
# GPT of examples/train_gpt.py pipelined over 2 ranks (CPU, gloo).
# Extra arguments go to the example, e.g.:
#   bash scripts/run_example.sh --schedule zbv --steps 100
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

NPROC="${NPROC:-2}"
# One thread per rank (the ranks share the cores); torchrun would set this
# too, with a warning.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# torchrun, or the same launcher through the interpreter when torchrun is not
# on PATH or PYTHON names a particular interpreter.
if [[ -z "${PYTHON:-}" ]] && command -v torchrun >/dev/null 2>&1; then
  launcher=(torchrun)
else
  launcher=("${PYTHON:-python3}" -m torch.distributed.run)
fi
exec "${launcher[@]}" --standalone --nproc-per-node "$NPROC" examples/train_gpt.py "$@"
