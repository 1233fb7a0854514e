#!/usr/bin/env bash
# Builds for the device (sm_90 only, to keep the carry small) and gathers what a device call
# carries into .devbin/: memtune, memtune_gpu_tests, the bench binaries, a libgomp (the device's
# distro may lack it), the Llama 3 tokenizer.json and COMMIT, the commit the binaries were built from ("-dirty" when the
# tree had uncommitted changes). Then: run scripts/device-check.sh .devbin on the device.
# DEVBIN_SLIM=1 leaves out the bench binaries and the tokenizer (see below).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
# The cuDNN frontend headers (build-deps/, not in git): without them the device binaries lack the
# cuDNN attention backend and its tests skip, so a device build refuses to go on without it
# (ALLOW_NO_CUDNN=1 to build anyway).
bash scripts/fetch-cudnn-frontend.sh
mkdir -p build
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMTUNE_CUDA_ARCHS=90 > build/configure.log
if ! grep -q "cuDNN attention ON" build/configure.log && [ "${ALLOW_NO_CUDNN:-0}" != 1 ]; then
  grep "cuDNN attention" build/configure.log >&2
  echo "prepare-devbin: cuDNN attention is OFF in this build (set ALLOW_NO_CUDNN=1 to go on without it)" >&2
  exit 1
fi
cmake --build build -j "$(nproc)"
rm -rf .devbin && mkdir -p .devbin
cp build/memtune build/memtune_gpu_tests .devbin/
cp "$(g++ -print-file-name=libgomp.so.1)" .devbin/
TOKENIZER_JSON=${TOKENIZER_JSON:-../shared/data/llama3-tokenizer/tokenizer.json}
# DEVBIN_SLIM=1: only what the tests, sanitizer, ladder, peer, fullstack and longctx parts use, so
# that .devbin and the peer's wheels stay within the 64 MiB a device call carries.
if [ "${DEVBIN_SLIM:-0}" != 1 ]; then
  for b in build/bench_*; do [ -x "$b" ] && cp "$b" .devbin/; done
  # The Llama 3 tokenizer for scripts/device-qlora-flow.sh (the shared data folder does not travel).
  [ -f "$TOKENIZER_JSON" ] && cp "$TOKENIZER_JSON" .devbin/
fi
# DEVBIN_GZIP=1: memtune and memtune_gpu_tests stripped and gzipped (36 MB -> ~11 MB) and the
# tokenizer gzipped, so that .devbin, the tests and the peers' wheels fit one call's 64 MiB together;
# device-check.sh unpacks them. Also the tokenizer files under DEVBIN_SLIM.
if [ "${DEVBIN_GZIP:-0}" = 1 ]; then
  for b in memtune memtune_gpu_tests; do strip ".devbin/$b" && gzip -9 -f ".devbin/$b"; done
  if [ -f "$TOKENIZER_JSON" ]; then
    rm -f .devbin/tokenizer.json
    gzip -9 -c "$TOKENIZER_JSON" > .devbin/tokenizer.json.gz
    cp "$(dirname "$TOKENIZER_JSON")/tokenizer_config.json" .devbin/ 2>/dev/null || true
  fi
fi
# DEVBIN_FUZZ=1: the libFuzzer targets (scripts/fuzz.sh builds them into build-fuzz/), stripped of
# their debug info and gzipped (~1.4 MB each), for device-check's fuzz part on the device's cores.
if [ "${DEVBIN_FUZZ:-0}" = 1 ]; then
  FUZZ_SECONDS=1 bash scripts/fuzz.sh > build/fuzz-build.log 2>&1 || { tail -20 build/fuzz-build.log; exit 1; }
  mkdir -p .devbin/fuzz
  # clang's OpenMP runtime, which the fuzz binaries link and the device lacks (found in BIN_DIR
  # through device-check's LD_LIBRARY_PATH).
  cp "$(clang -print-file-name=libomp.so.5 2>/dev/null || true)" .devbin/ 2>/dev/null \
    || cp /usr/lib/llvm-*/lib/libomp.so.5 .devbin/ 2>/dev/null || echo "prepare-devbin: no libomp.so.5 found" >&2
  for t in build-fuzz/fuzz_*; do
    [ -x "$t" ] && [ -f "$t" ] && strip -g -o ".devbin/fuzz/$(basename "$t")" "$t" && gzip -9 -f ".devbin/fuzz/$(basename "$t")"
  done
fi
git describe --always --dirty > .devbin/COMMIT
du -sh .devbin; cat .devbin/COMMIT
