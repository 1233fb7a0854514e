#!/usr/bin/env bash
# Configures and builds into build/ (CUDA backend included when nvcc is on PATH or in
# /usr/local/cuda). Extra arguments go to cmake, e.g. -DMEMTUNE_CUDA_ARCHS=90.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j "$(nproc)"
