#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/*.cpp) with clang, ASan and UBSan, and runs each for
# FUZZ_SECONDS (default 20) from a seed corpus of the repository's own files. Exits non-zero
# when a target finds a crash (its input is left in build-fuzz/crashes/). Skips, saying so,
# where clang or its fuzzer runtime is missing.
#   FUZZ_SECONDS=600 bash scripts/fuzz.sh              # longer runs
#   FUZZ_TARGETS="fuzz_dataset" bash scripts/fuzz.sh   # some targets only
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang++ >/dev/null || ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' |
     clang++ -x c++ -fsanitize=fuzzer - -o /tmp/memtune_fuzz_probe 2>/dev/null; then
  echo "fuzz: skipped (no clang++ with libFuzzer; Debian: apt-get install clang libclang-rt-dev)"
  exit 0
fi
BUILD=${FUZZ_BUILD:-build-fuzz}
SECONDS_EACH=${FUZZ_SECONDS:-20}
. scripts/fuzz-seeds.sh
TARGETS=${FUZZ_TARGETS:-$FUZZ_TARGETS_ALL}
CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMTUNE_CUDA=OFF -DMEMTUNE_FUZZ=ON \
  -DMEMTUNE_TEST_ONLY=io -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g" >/dev/null
# shellcheck disable=SC2086
ninja -C "$BUILD" -j "$(nproc)" $TARGETS

mkdir -p "$BUILD/crashes"
status=0
for target in $TARGETS; do
  corpus=$(corpus_for "$target" "$BUILD/corpus")
  log="$BUILD/$target.log"
  if "$BUILD/$target" -max_total_time="$SECONDS_EACH" -max_len=8192 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$BUILD/crashes/$target-" "$corpus" > "$log" 2>&1; then
    echo "fuzz: $target clean: $(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$') executions in ${SECONDS_EACH} s"
  else
    status=1
    echo "fuzz: $target FAILED (input in $BUILD/crashes/):"
    grep -E "ERROR|SUMMARY|runtime error|abort" "$log" | head -10
  fi
done
exit $status
