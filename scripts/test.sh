#!/usr/bin/env bash
# Builds and runs the whole test suite. GPU tests skip (and say so) where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
# One OpenMP thread per test: ctest runs tests side by side on the cores.
OMP_NUM_THREADS=1 ctest --test-dir build -j "$(nproc)" --output-on-failure
