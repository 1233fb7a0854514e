#!/usr/bin/env bash
# Builds and runs the whole test suite. GPU tests skip (and say so) where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# Without a GPU the GPU tests skip, so one architecture is enough to check that the CUDA code
# compiles: sm_90 (and its sm_90a kernels), what the device runs, instead of CMakeLists.txt's four
# (most of CI's build time on 2 cores). With a GPU, or -DMEMTUNE_CUDA_ARCHS=... given, as asked.
args=("$@")
if ! printf '%s\n' "$@" | grep -q MEMTUNE_CUDA_ARCHS &&
   ! { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
  args+=(-DMEMTUNE_CUDA_ARCHS=90)
fi
bash scripts/build.sh ${args[@]+"${args[@]}"}
# One OpenMP thread per test: ctest runs tests side by side on the cores.
OMP_NUM_THREADS=1 ctest --test-dir build -j "$(nproc)" --output-on-failure
# Each fuzz target for 20 s (scripts/fuzz.sh; skipped, saying so, where clang's libFuzzer is
# missing; MEMTUNE_SKIP_FUZZ=1 skips it when iterating).
[ "${MEMTUNE_SKIP_FUZZ:-0}" = 1 ] || bash scripts/fuzz.sh
