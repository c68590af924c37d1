#!/usr/bin/env bash
# Idempotent set-up of a fresh machine for torch_mpmd: system packages,
# pinned Python packages, and the build (torch_mpmd._C plus the GTest suite
# in build/cmake). Safe to run again: each step skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
APT_PACKAGES=(libgtest-dev libfmt-dev ninja-build ccache)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "[setup] installing system packages: ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
need_pip=0
"$PYTHON" - <<'PY' || need_pip=1
import importlib.metadata as md, sys
want = {"torch": "2.13.0", "pytest": None, "pytest-xdist": "3.8.0", "matplotlib": None, "cmake": None, "numpy": None,
        "transformers": "5.24.0", "torchft": "0.2.0"}
for name, version in want.items():
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if version and not have.startswith(version):
        sys.exit(1)
import cmake  # noqa: F401  (PyPI cmake >= 3.27 reads Torch's CMake config)
PY
if ((need_pip)); then
  echo "[setup] installing Python packages"
  # pytest-xdist: the suite runs in one pytest process per core (up to 2),
  # a test file at a time each (scripts/test.sh).
  # transformers: the capture tests split Hugging Face models built from
  # small configs (no download). torchft: replicas that survive each other
  # (torch_mpmd/parallel/quorum.py); its wheel holds the Lighthouse.
  "$PYTHON" -m pip install -q "torch==2.13.0" "cmake>=3.27,<4" pytest "pytest-xdist==3.8.0" \
    matplotlib numpy "transformers==5.24.0" \
    "torchft==0.2.0"
fi

# Incremental: CMake rebuilds only what changed in build/cmake
# (MPMD_BUILD_TARGETS: only those targets, setup.py). ccache in its depend
# mode: a miss (every unit on a new machine) skips the extra preprocessor
# pass that its default mode runs to look the unit up.
export CCACHE_DEPEND="${CCACHE_DEPEND:-1}"
echo "[setup] building torch_mpmd"
MPMD_BUILD_JOBS="${MPMD_BUILD_JOBS:-2}" "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 \
  | grep -v "Running pip as the 'root' user" || true
"$PYTHON" -c "import torch_mpmd._C" || { echo "[setup] build failed" >&2; exit 1; }
