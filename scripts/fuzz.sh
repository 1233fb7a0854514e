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
TARGETS=${FUZZ_TARGETS:-"fuzz_safetensors fuzz_model_config fuzz_adapter_config fuzz_tokenizer fuzz_dataset"}
CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMTUNE_CUDA=OFF -DMEMTUNE_FUZZ=ON \
  -DMEMTUNE_TEST_ONLY=io -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g" >/dev/null
# shellcheck disable=SC2086
ninja -C "$BUILD" -j "$(nproc)" $TARGETS

# Seeds: files memtune reads in real use, one per kind of input.
seeds() {
  local dir="$BUILD/corpus/$1"; shift
  mkdir -p "$dir"
  for f in "$@"; do [ -f "$f" ] && cp "$f" "$dir/$(echo "$f" | tr '/' '_')"; done
  echo "$dir"
}
corpus_for() {
  case "$1" in
    fuzz_safetensors) seeds safetensors tests/fixtures/golden/*/adapter/adapter_model.safetensors tests/fixtures/safetensors/* ;;
    fuzz_model_config) seeds model_config configs/models/*.json tests/fixtures/golden/*/config*.json ;;
    fuzz_adapter_config) seeds adapter_config tests/fixtures/golden/*/adapter/adapter_config.json ;;
    fuzz_tokenizer) seeds tokenizer tests/fixtures/tokenizer/tiny_tokenizer.json ;;
    fuzz_dataset) seeds dataset tests/fixtures/tokenizer/tiny_corpus.jsonl tests/fixtures/tokenizer/chat.jsonl ;;
  esac
}
mkdir -p "$BUILD/crashes"
status=0
for target in $TARGETS; do
  corpus=$(corpus_for "$target")
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
