#!/usr/bin/env bash
# README's main job: set up what is missing, then run the example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" examples/show_schedules.py "$@"
