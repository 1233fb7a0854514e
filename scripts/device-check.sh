#!/usr/bin/env bash
# The GPU checks and benchmarks, run on a machine with a CUDA device; logs go under $OUT.
#
#   scripts/device-check.sh [BIN_DIR] [PARTS]
#     BIN_DIR  the folder holding memtune and memtune_gpu_tests (default build); shared
#              libraries placed beside them (e.g. a libgomp for a machine without one) are
#              found through LD_LIBRARY_PATH
#     PARTS    comma list, default tests,sanitizer,ladder,peer:
#       tests      memtune_gpu_tests (every kernel and whole steps against the CPU backend)
#       sanitizer  compute-sanitizer memcheck and racecheck on a short training run
#       ladder     the memory ladder, Llama-3.1-8B architecture (random weights), b2 x 2048
#       ladder-offload  the same ladder with --offload_activations (the checkpointing rungs keep
#                  their checkpointed layer inputs in pinned host memory), into ladder-offload/
#       peer       bench/peer_hf.py: transformers + PEFT (+ bitsandbytes) on the same rungs
#       bench      the op benchmarks in BIN_DIR (bench_*), where built
#       fullstack  single 8B training runs at the ladder's shape: the full stack (auto and 1024-row
#                  token chunks, and with activation offload) and the flash rung with activation +
#                  embedding offload
#       longctx    Llama-3.1-8B QLoRA (full stack) at batch 1 x LONG_SEQ (default 131072) with
#                  --offload_activations --offload_embeddings under --vram 24GiB for LONG_STEPS
#                  (default 3) steps, device peak sampled by nvidia-smi, host memory from the
#                  plan and the process's max RSS; then `memtune fit --max-context` for 24 and 80 GiB
#
# Environment: LADDER_ARGS (extra memtune ladder options), PEER_ARGS (extra peer options),
# TEST_TIMEOUT (seconds, default 300). The last lines printed are a summary per part.
set -u
BIN_DIR=${1:-build}
PARTS=${2:-tests,sanitizer,ladder,peer}
OUT=${OUT:-/tmp/memtune-device-check}
# Logs are written to WORK and bundled into $OUT/results.tar.gz at the end (the device tool
# brings back only a few files); the summary printed here is the quick view.
WORK=${WORK:-/tmp/memtune-device-work}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN_DIR=$(cd "$BIN_DIR" && pwd)
mkdir -p "$OUT" "$WORK"
export LD_LIBRARY_PATH="$BIN_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH=/usr/local/cuda/bin:$PATH
has_part() { [[ ",$PARTS," == *",$1,"* ]]; }
status=0
stamp() { echo "== $1 ($(date -u +%H:%M:%S))"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
  > "$WORK/device.txt" 2>&1
cat "$WORK/device.txt"
# The commit the binaries were built from (scripts/prepare-devbin.sh writes it beside them).
if [ -f "$BIN_DIR/COMMIT" ]; then export MEMTUNE_COMMIT=$(cat "$BIN_DIR/COMMIT"); fi
echo "${MEMTUNE_COMMIT:-unknown}" > "$WORK/commit.txt"; echo "binaries from commit ${MEMTUNE_COMMIT:-unknown}"

# The ladder's shape, shared with the peer so that both run the same configuration.
MODEL_ARGS="--model llama-3.1-8b --batch 2 --accum ${LADDER_ACCUM:-2} --seq 2048 --lora_r 16 --lora_alpha 16 --lora_target_modules all-linear"
STEPS=${LADDER_STEPS:-3}

if has_part tests; then
  stamp tests
  timeout "$TEST_TIMEOUT" "$BIN_DIR/memtune_gpu_tests" --gtest_output=xml:"$WORK/gpu_tests.xml" \
    > "$WORK/gpu_tests.log" 2>&1
  rc=$?
  echo "memtune_gpu_tests exit code: $rc (124: timed out after ${TEST_TIMEOUT}s)"
  [ $rc -ne 0 ] && status=1
  # Failures first (with their messages), then timings and the summary.
  grep -E "Failure|error|Expected|Which is|relative norm|non-finite|FAILED|grew" "$WORK/gpu_tests.log" \
    | head -c 6000
  echo "----"
  grep -E "TIMING|PLAN|GB/s|flash fwd|eager fwd|flash [0-9]|^\s+b[0-9]+ s[0-9]+|\[  FAILED  \]|\[  PASSED  \]|tests ran|SKIPPED" \
    "$WORK/gpu_tests.log" | tail -c 5000
fi

if has_part sanitizer; then
  stamp sanitizer
  # A short run touching every kernel family: eager and flash attention, checkpointing, the
  # chunked loss, QLoRA dequantization and the optimizer, and the offload copies (activations on
  # the side stream, embeddings read from host memory), on the tiny model.
  for tool in memcheck racecheck; do
    for variant in "--bf16 --attn_implementation eager" \
                   "--bf16 --attn_implementation flash --gradient_checkpointing --loss_implementation chunked --load_in_4bit" \
                   "--bf16 --attn_implementation flash --gradient_checkpointing --offload_activations --offload_embeddings"; do
      timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 \
        "$BIN_DIR/memtune" train --model tiny --device cuda --seq 64 --batch 2 --accum 2 \
        --max_steps 2 --quiet --overwrite_output_dir --out "$WORK/sanitizer-out" $variant \
        >> "$WORK/sanitizer-$tool.log" 2>&1
      rc=$?
      echo "compute-sanitizer $tool [$variant]: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$WORK/sanitizer-$tool.log" | tail -1)"
      [ $rc -ne 0 ] && { status=1; grep -m5 -E "Invalid|Error|race" "$WORK/sanitizer-$tool.log"; }
    done
  done
fi

if has_part ladder; then
  stamp ladder
  timeout "${LADDER_TIMEOUT:-420}" "$BIN_DIR/memtune" ladder $MODEL_ARGS --vram 24GiB --device cuda \
    --steps-per-rung "$STEPS" --out "$WORK/ladder" ${LADDER_ARGS:-} > "$WORK/ladder.log" 2>&1
  rc=$?
  echo "memtune ladder exit code: $rc"
  [ $rc -ne 0 ] && status=1
  tail -c 5000 "$WORK/ladder.log"
fi

if has_part ladder-offload; then
  stamp ladder-offload
  timeout "${LADDER_TIMEOUT:-420}" "$BIN_DIR/memtune" ladder $MODEL_ARGS --vram 24GiB --device cuda \
    --steps-per-rung "$STEPS" --out "$WORK/ladder-offload" ${LADDER_ARGS:-} --offload_activations \
    > "$WORK/ladder-offload.log" 2>&1
  rc=$?
  echo "memtune ladder --offload_activations exit code: $rc"
  [ $rc -ne 0 ] && status=1
  tail -c 3000 "$WORK/ladder-offload.log"
fi

if has_part peer; then
  stamp peer
  # Sourced: where pip refuses a system install it installs to a folder and exports PYTHONPATH.
  # (with no positional arguments: the installer reads its own)
  set --
  source "$ROOT/bench/install_peer_wheels.sh" > "$WORK/peer_install.log" 2>&1 || true
  timeout 120 python3 "$ROOT/bench/attention_peer.py" > "$WORK/attention_peer.log" 2>&1
  echo "attention_peer.py exit code: $?"; cat "$WORK/attention_peer.log"
  tail -3 "$WORK/peer_install.log"
  timeout "${PEER_TIMEOUT:-540}" python3 "$ROOT/bench/peer_hf.py" --config "$ROOT/configs/models/llama-3.1-8b.json" \
    --batch 2 --accum "${LADDER_ACCUM:-2}" --seq 2048 --steps "$STEPS" --lr 2e-4 --weight-decay 0 --max-grad-norm 1.0 --lora-r 16 --lora-alpha 16 \
    --out "$WORK/peer.json" \
    ${PEER_ARGS:-} > "$WORK/peer.log" 2>&1
  rc=$?
  echo "peer_hf.py exit code: $rc"
  [ $rc -ne 0 ] && status=1
  tail -c 4000 "$WORK/peer.log"
  for ladder in ladder ladder-offload; do
    if [ -f "$WORK/$ladder/ladder.json" ] && [ -f "$WORK/peer.json" ]; then
      "$BIN_DIR/memtune" report --ladder "$WORK/$ladder/ladder.json" --peer "$WORK/peer.json" \
        --out "$WORK/$ladder" > "$WORK/report-$ladder.log" 2>&1 && tail -c 4000 "$WORK/report-$ladder.log"
    fi
  done
fi

if has_part bench; then
  stamp bench
  for b in "$BIN_DIR"/bench_*; do
    [ -x "$b" ] || continue
    args=()
    [ "$(basename "$b")" = bench_tokenizer ] && args=(--tokenizer "$BIN_DIR/tokenizer.json" --corpus "$ROOT/tests/fixtures/tokenizer/corpus.jsonl")
    [ "$(basename "$b")" = bench_gemm ] && args=(--json)
    timeout 120 "$b" "${args[@]}" > "$WORK/$(basename "$b").log" 2>&1
    echo "$(basename "$b") exit $?"; tail -30 "$WORK/$(basename "$b").log"
  done
fi
if has_part fullstack; then
  stamp fullstack
  # Single runs at the ladder's shape (b2 x acc2 x 2048, 8B, random weights), 6 steps each; tokens/s
  # = mean of steps 2..6 from --metrics, device peak = nvidia-smi maximum sampled every 100 ms.
  #   full-stack-*   QLoRA + checkpointing + fused attention (auto: cuDNN) + chunked loss + host
  #                  embeddings, token chunks auto or 1024 rows, or auto with the checkpointed
  #                  layer inputs offloaded to the host
  #   flash-rung-offload  the ladder's flash rung (bf16, checkpointing, fused attention, full loss)
  #                  with host embeddings and the checkpointed layer inputs offloaded to the host
  F="$WORK/fullstack"; mkdir -p "$F"
  COMMON="--device cuda --model llama-3.1-8b --batch 2 --accum ${LADDER_ACCUM:-2} --seq 2048 --lora_r 16 --lora_alpha 16 --max_steps 6 --quiet"
  STACK="--load_in_4bit --bf16 --gradient_checkpointing --attn_implementation auto --loss_implementation chunked --offload_embeddings"
  for variant in "full-stack-auto|$STACK" "full-stack-1024|$STACK --mlp_chunk_tokens 1024" \
                 "full-stack-offload|$STACK --offload_activations" \
                 "flash-rung-offload|--bf16 --gradient_checkpointing --attn_implementation auto --offload_embeddings --offload_activations"; do
    name=${variant%%|*}; args=${variant#*|}
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$F/$name.smi" 2>&1 &
    SAMPLER=$!
    timeout 180 "$BIN_DIR/memtune" train $COMMON $args --metrics "$F/$name.jsonl" --out "$F/out" > "$F/$name.log" 2>&1
    rc=$?
    kill $SAMPLER 2>/dev/null; wait $SAMPLER 2>/dev/null
    [ $rc -ne 0 ] && status=1
    tps=$(python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if '\"event\":\"step\"' in l]; t=[x['tokens_per_second'] for x in r[1:]]; print(round(sum(t)/len(t)) if t else 'n/a')" "$F/$name.jsonl" 2>/dev/null)
    echo "$name exit $rc: tokens/s (steps 2..6) $tps, device peak $(sort -n "$F/$name.smi" | tail -1) MiB"
    rm -rf "$F/out"
  done
fi

if has_part longctx; then
  stamp longctx
  L="$WORK/longctx"; mkdir -p "$L"
  for budget in 24GiB 80GiB; do
    "$BIN_DIR/memtune" fit --model llama-3.1-8b --vram "$budget" --max-context --json > "$L/fit-$budget.json" 2>&1
    echo "fit --max-context --vram $budget:"; cat "$L/fit-$budget.json"
  done
  LONG_SEQ=${LONG_SEQ:-131072}
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$L/smi.log" 2>&1 &
  SAMPLER=$!
  TIMER=(); [ -x /usr/bin/time ] && TIMER=(/usr/bin/time -v)  # max RSS, where installed
  "${TIMER[@]}" timeout "${LONG_TIMEOUT:-480}" "$BIN_DIR/memtune" train --device cuda --model llama-3.1-8b \
    --load_in_4bit --bf16 --gradient_checkpointing --attn_implementation flash --loss_implementation chunked \
    --offload_activations --offload_embeddings --batch 1 --accum 1 --seq "$LONG_SEQ" \
    --max_steps "${LONG_STEPS:-3}" --vram 24GiB --metrics "$L/metrics.jsonl" --out "$L/out" > "$L/train.log" 2>&1
  rc=$?
  kill $SAMPLER 2>/dev/null; wait $SAMPLER 2>/dev/null
  echo "longctx train seq $LONG_SEQ exit $rc; device peak (nvidia-smi max of $(wc -l < "$L/smi.log") samples): $(sort -n "$L/smi.log" | tail -1) MiB; idle before: $(head -1 "$L/smi.log") MiB"
  [ $rc -ne 0 ] && status=1
  grep -E "peak|host|step +[0-9]+|tokens/s|error|Maximum resident" "$L/train.log" | tail -20
  rm -rf "$L/out"
fi

stamp done
tar -czf "$OUT/results.tar.gz" -C "$WORK" . && ls -la "$OUT"
exit "$status"
