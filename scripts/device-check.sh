#!/usr/bin/env bash
# Runs the GPU checks on a machine with a CUDA device and writes the logs under $OUT.
#   scripts/device-check.sh [BIN_DIR]    (BIN_DIR: the folder holding memtune_gpu_tests,
#                                         default build-cuda)
# Any shared libraries placed beside the binaries (e.g. a libgomp for a machine without one)
# are found through LD_LIBRARY_PATH. The last lines printed are a summary; the full gtest log
# and XML are in $OUT.
set -u
BIN_DIR=${1:-build-cuda}
OUT=${OUT:-/tmp/memtune-device-check}
TEST_TIMEOUT=${TEST_TIMEOUT:-200}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$(cd "$BIN_DIR" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
  > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

status=0
if [ -x "$BIN_DIR/memtune_gpu_tests" ]; then
  timeout "$TEST_TIMEOUT" "$BIN_DIR/memtune_gpu_tests" --gtest_output=xml:"$OUT/gpu_tests.xml" \
    > "$OUT/gpu_tests.log" 2>&1
  status=$?
  echo "memtune_gpu_tests exit code: $status (124: timed out after ${TEST_TIMEOUT}s)"
  # Failures first (with their messages), then timings and the summary.
  grep -E "Failure|error|Expected|Which is|relative norm|non-finite|FAILED" "$OUT/gpu_tests.log" \
    | head -c 5000
  echo "----"
  grep -E "TIMING|flash fwd|eager fwd|flash [0-9]|^\s+b[0-9]+ s[0-9]+|\[       OK \]|\[  FAILED  \]|\[  PASSED  \]|SKIPPED" \
    "$OUT/gpu_tests.log" | tail -c 6000
else
  echo "no $BIN_DIR/memtune_gpu_tests"
  status=1
fi
exit "$status"
