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
#       sanitizer-tests  compute-sanitizer memcheck and racecheck (SANITIZER_TOOLS) on the GPU tests of
#                  SANITIZER_FILTER (default: the Hopper forward's correctness tests), SANITIZER_TIMEOUT (150 s) each
#       ncu-attn   Nsight Compute (--set full, --clock-control none) on one launch of the Hopper
#                  backward's main pass and one of cuDNN's backward kernels a shape of NCU_SHAPES
#                  (default "b8_s2048_d128 b2_s8192_d128"), picked by the NVTX ranges of
#                  CudaHopperBackwardTest.TimingPrintHopperBackward; NCU_VARIANTS: the main pass's other
#                  variants too (e.g. "bulk_keys bulk_falling"); NCU_BASE="" leaves out the default main
#                  pass and cuDNN (default "hopper cudnn"); NCU_TIMEOUT (240 s) a run
#       ladder     the memory ladder, Llama-3.1-8B architecture (random weights), b2 x 2048
#       ladder-offload  the same ladder with --offload_activations (the checkpointing rungs keep
#                  their checkpointed layer inputs in pinned host memory), into ladder-offload/
#       peer       bench/peer_hf.py: transformers + PEFT (+ bitsandbytes) on the same rungs
#       sdpa       bench/attention_peer.py alone: PyTorch SDPA (flash, cuDNN) on the attention timing
#                  shapes (the peer part runs it too)
#       bench      the op benchmarks in BIN_DIR (bench_*), where built
#       fullstack  single 8B training runs at the ladder's shape: the full stack (auto and 1024-row
#                  token chunks, and with activation offload) and the flash rung with activation +
#                  embedding offload
#       longctx    Llama-3.1-8B QLoRA (full stack) at batch 1 x LONG_SEQ (default 131072) with
#                  --offload_activations --offload_embeddings under --vram 24GiB for LONG_STEPS
#                  (default 3) steps, device peak sampled by nvidia-smi, host memory from the
#                  plan and the process's max RSS; then `memtune fit --max-context` for 24 and 80 GiB
#                  (LONG_VRAM: another budget than 24GiB; LONG_FIT_BUDGETS: the fits' budgets; LONG_ATTN:
#                  the attention, default flash)
#       unsloth    bench/peer_unsloth.py (issue 21): the ladder's 16-bit LoRA (flash) and QLoRA rungs
#                  at its shape (configurations 3 and 1), random ids; writes the random-weight 8B folder
#                  first (UNSLOTH_MODEL_DIR, outside $WORK; reused by the other unsloth parts)
#       unsloth-data  Unsloth's benchmark shape (configuration 2): QLoRA, batch 2 x accumulation 4, r32,
#                  examples/sft-tasks.jsonl x DATA_REPEAT (30) through the Llama 3 tokenizer, padded to
#                  the longest row as Unsloth pads (UNSLOTH_DATA_PACKING=1: packed too)
#       unsloth-context  the longest trainable context at batch 1, QLoRA, under each cap of CONTEXT_CAPS
#                  (default "24 80" GiB; torch.cuda.set_per_process_memory_fraction), bisection over
#                  multiples of CONTEXT_UNIT in [CONTEXT_MIN, CONTEXT_MAX], each probe CONTEXT_STEPS
#                  (2) timed steps + 1 untimed; the longest probe that ran them all is the timed run
#       liger      bench/peer_hf.py --liger on the ladder's rungs (transformers + PEFT + bnb + Liger)
#       peer-data  bench/peer_hf.py, QLoRA full stack, 2 x 2048, accumulation 2, on sft-tasks.jsonl x
#                  DATA_REPEAT with the Llama 3 tokenizer, unpacked (padded to the longest row) and
#                  packed; then memtune on the same data in each data mode (memtune_peer_data below)
#                  (PEER_DATA_PACKED=0: the peer unpacked only; PEER_DATA_MEMTUNE=0: the peer only; PEER_ARGS
#                  come last, so e.g. "--lora-r 32 --lora-alpha 32 --accum 4" gives configuration 2)
#       memtune-data  the memtune half of peer-data alone (DATA_MODES picks the modes)
#       peer-context  bench/peer_hf.py --max-context (QLoRA rung at batch 1) under each cap of CONTEXT_CAPS
#       configs    memtune on issue 21's configurations 1-3 (CONFIGS: a comma list of the variants in
#                  the part's comment; CONFIG_STEPS 6, CONFIG_TIMEOUT 150 s a run)
#       fuzz       scripts/fuzz-long.sh on the host's cores, in the background beside the other parts
#                  (run it with the correctness parts, not beside timings): the fuzz binaries in
#                  FUZZ_BIN (default BIN_DIR/fuzz; prepare-devbin.sh with DEVBIN_FUZZ=1 puts them
#                  there, stripped), FUZZ_RUNS (10M) executions a target, FUZZ_JOBS processes a
#                  target (default: cores less 2, over the five targets), FUZZ_TIMEOUT (420 s)
#       edge       the --vram verdict at its edge: `memtune fit --max-context --vram EDGE_VRAM` (24GiB),
#                  then `memtune train` at the longest length it found with offload (EDGE_OFFLOAD=0:
#                  without), for EDGE_STEPS (2) steps under the same --vram; nvidia-smi's maximum
#                  against the budget
#       attn-step  the own flash kernel's versions in a training step: configuration 1 (QLoRA full stack,
#                  --attn_implementation flash, 2 x 2048, 6 steps) and 1 x 32768 (4 steps) once per
#                  value of MEMTUNE_FLASH_BACKWARD in ATTN_STEP_BACKWARDS (default "v2 hopper"),
#                  alternately, ATTN_STEP_ROUNDS (2) rounds at 2048 and one at 32768; then cuDNN
#                  (--attn_implementation cudnn) at 32768 as the reference
#   The unsloth, unsloth-data, unsloth-context, liger, peer-data and peer-context parts are
#   independent of each other and of the others: each installs the wheels in .whl/ it needs
#   (carry .whl; bench/install_peer_wheels.sh --prepare-bnb --prepare-unsloth --prepare-liger).
#   A device call has ~9 minutes: run them in separate calls (see bench/README.md for the lines).
#
# Environment: LADDER_MODEL (the ladder's and the peers' model preset, default llama-3.1-8b),
# LADDER_ARGS (extra memtune ladder options), PEER_ARGS (extra peer options),
# TEST_TIMEOUT (seconds, default 300); for the peer parts: UNSLOTH_STEPS (default 4), UNSLOTH_TIMEOUT
# (per part, 480), UNSLOTH_ARGS, UNSLOTH_MODEL_DIR (/tmp/peer-unsloth-model), LIGER_STEPS (3),
# LIGER_TIMEOUT (480), LIGER_ARGS, DATA_STEPS (6), DATA_REPEAT (30), DATA_TIMEOUT (per run, 240),
# GTEST_FILTER narrows the tests part (googletest reads it), e.g. 'CudaStepTest.*:CudaQuantTest.*';
# TOKENIZER (default BIN_DIR/tokenizer.json, which prepare-devbin copies unless DEVBIN_SLIM=1, else
# BIN_DIR/tokenizer.json.gz),
# CONTEXT_CAPS ("24 80"), CONTEXT_MIN (16384), CONTEXT_MAX (131072), CONTEXT_UNIT (8192),
# CONTEXT_TIMEOUT (per cap, 540), PROBE_TIMEOUT (per probe, 240), CONTEXT_STEPS (2; 0: one untimed
# step, a fits-or-not probe). The last lines printed are a
# summary per part.
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
# Binaries that prepare-devbin.sh gzipped (DEVBIN_GZIP=1) are unpacked beside their .gz.
for b in memtune memtune_gpu_tests; do
  if [ ! -f "$BIN_DIR/$b" ] && [ -f "$BIN_DIR/$b.gz" ]; then
    gunzip -c "$BIN_DIR/$b.gz" > "$BIN_DIR/$b" && chmod +x "$BIN_DIR/$b"
  fi
done
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

# fuzz: started first, waited for last; it uses the host's cores, the other parts the GPU.
FUZZ_PID=
if has_part fuzz; then
  stamp fuzz
  FUZZ_BIN=${FUZZ_BIN:-$BIN_DIR/fuzz}
  for f in "$FUZZ_BIN"/*.gz; do [ -f "$f" ] && gunzip -f "$f"; done
  chmod +x "$FUZZ_BIN"/fuzz_* 2>/dev/null
  FUZZ_JOBS=${FUZZ_JOBS:-$(( ($(nproc) - 2) / 5 > 0 ? ($(nproc) - 2) / 5 : 1 ))} FUZZ_TIMEOUT=${FUZZ_TIMEOUT:-420} \
    bash "$ROOT/scripts/fuzz-long.sh" "$FUZZ_BIN" "$WORK/fuzz" > "$WORK/fuzz.log" 2>&1 &
  FUZZ_PID=$!
fi

# The ladder's shape, shared with the peer so that both run the same configuration. LADDER_MODEL
# (default llama-3.1-8b) is a preset with a file in configs/models/ (qwen2.5-7b, mistral-7b-v0.3, ...).
LADDER_MODEL=${LADDER_MODEL:-llama-3.1-8b}
[ -f "$ROOT/configs/models/$LADDER_MODEL.json" ] || { echo "LADDER_MODEL: no configs/models/$LADDER_MODEL.json" >&2; exit 2; }
MODEL_ARGS="--model $LADDER_MODEL --batch 2 --accum ${LADDER_ACCUM:-2} --seq 2048 --lora_r 16 --lora_alpha 16 --lora_target_modules all-linear"
STEPS=${LADDER_STEPS:-3}

# ---- helpers of the peer parts (peer, unsloth*, liger, peer-data, peer-context) ----
PEER_WHEELS_DONE=0
install_peer_wheels_once() {
  [ "$PEER_WHEELS_DONE" = 1 ] && return 0
  set --
  source "$ROOT/bench/install_peer_wheels.sh" > "$WORK/peer_install.log" 2>&1 || true
  tail -3 "$WORK/peer_install.log"
  PEER_WHEELS_DONE=1
}
TOKENIZER=${TOKENIZER:-$BIN_DIR/tokenizer.json}
[ -f "$TOKENIZER" ] || [ ! -f "$BIN_DIR/tokenizer.json.gz" ] || TOKENIZER="$BIN_DIR/tokenizer.json.gz"
[ -f "$TOKENIZER" ] || TOKENIZER="$ROOT/../shared/data/llama3-tokenizer/tokenizer.json"
# A gzipped tokenizer.json (2.2 MiB instead of 8.7: `gzip -9 -k .devbin/tokenizer.json` and drop the
# plain one, to keep a call's carry under 64 MiB) is unpacked to /tmp first.
if [[ "$TOKENIZER" == *.gz ]] && [ -f "$TOKENIZER" ]; then
  mkdir -p /tmp/peer-tokenizer && gunzip -c "$TOKENIZER" > /tmp/peer-tokenizer/tokenizer.json \
    && TOKENIZER=/tmp/peer-tokenizer/tokenizer.json
fi
# peer_unsloth.py's model folder gets the real tokenizer where there is one, else a made-up one.
UNSLOTH_TOKENIZER=(); [ -f "$TOKENIZER" ] && UNSLOTH_TOKENIZER=(--tokenizer "$TOKENIZER")
DATA_REPEAT=${DATA_REPEAT:-30}
UNSLOTH_MODEL_DIR=${UNSLOTH_MODEL_DIR:-/tmp/peer-unsloth-model}   # 16 GB: never under $WORK (tarred)
export UNSLOTH_COMPILE_LOCATION=${UNSLOTH_COMPILE_LOCATION:-/tmp/peer-unsloth-compiled}
CONTEXT_CAPS=${CONTEXT_CAPS:-24 80}
CONTEXT_ARGS="--context-min ${CONTEXT_MIN:-16384} --context-max ${CONTEXT_MAX:-131072} --context-unit ${CONTEXT_UNIT:-8192} --probe-timeout ${PROBE_TIMEOUT:-240} --context-steps ${CONTEXT_STEPS:-2}"
# The ladder's shape and optimizer, as the peer part passes them.
PEER_SHAPE="--config $ROOT/configs/models/$LADDER_MODEL.json --lr 2e-4 --weight-decay 0 --max-grad-norm 1.0 --lora-r 16 --lora-alpha 16"
# One summary line per measured rung of a peer JSON: tokens/s (real and target where data), peaks.
peer_summary() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
path, label = sys.argv[1], sys.argv[2]
try:
    report = json.load(open(path))
except (OSError, ValueError) as exc:
    print(f"{label}: no result ({exc})"); sys.exit(0)
g = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"
for r in report.get("rungs", []):
    if r.get("error", "").startswith(("not run", "no Unsloth equivalent", "no equivalent")):
        continue
    if not r.get("measured"):
        print(f"{label} [{r['name']}]: not measured: {r.get('error')}"); continue
    extra = (f", real {r['real_tokens_per_second']:.0f}, targets {r['target_tokens_per_second']:.0f}"
             if r.get("data") else "")
    print(f"{label} [{r['name']}]: {r['tokens_per_second']:.0f} tok/s{extra}; device peak {g(r.get('device_peak_bytes'))}"
          f" (nvidia-smi {g(r.get('nvidia_smi_peak_bytes'))}, torch reserved {g(r.get('peak_reserved_bytes'))})")
mc = report.get("max_context")
if mc:
    probes = ", ".join(f"{p['seq']}:{'ok' if p['fits'] else (p.get('error') or 'no')}" for p in mc["probes"])
    run = mc.get("run") or {}
    print(f"{label} max context at {mc['cap_gib']:g} GiB: {mc.get('max_seq')} tokens"
          + (f", {run['tokens_per_second']:.0f} tok/s" if run.get("tokens_per_second") else "")
          + f"; probes {probes}")
print(f"{label}: {report.get('peer')}")
EOF
}

# One peer script: peer_run NAME TIMEOUT TAIL_BYTES COMMAND...: the log in $WORK/NAME.log (NAME may
# hold a folder), its exit code and last TAIL_BYTES bytes printed, a failure counted, and the JSON
# that the command wrote to $WORK/NAME.json summarised.
peer_run() {
  local name=$1 limit=$2 tail_bytes=$3; shift 3
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "$name exit code: $rc (124: timed out)"
  [ $rc -ne 0 ] && status=1
  [ "$tail_bytes" -gt 0 ] && tail -c "$tail_bytes" "$WORK/$name.log"
  peer_summary "$WORK/$name.json" "$(basename "$name")"
  return 0
}

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

# The kernels that the tiny model's head_dim never reaches (the Hopper forward serves head_dim 64
# and 128): their correctness GPU tests (SANITIZER_FILTER) under memcheck and racecheck.
if has_part sanitizer-tests; then
  stamp sanitizer-tests
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
    timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$BIN_DIR/memtune_gpu_tests" --gtest_filter="${SANITIZER_FILTER:-CudaHopperAttentionTest.*-*Timing*}" \
      > "$WORK/sanitizer-tests-$tool.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool [${SANITIZER_FILTER:-CudaHopperAttentionTest.*-*Timing*}]: exit $rc" \
         "(124: timed out); $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$WORK/sanitizer-tests-$tool.log" | tail -1);" \
         "$(grep -E '\[  PASSED  \]|\[  FAILED  \]' "$WORK/sanitizer-tests-$tool.log" | tr '\n' ' ')"
    [ $rc -ne 0 ] && { status=1; grep -m8 -E "Invalid|Error|race|hazard" "$WORK/sanitizer-tests-$tool.log"; }
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

# PyTorch SDPA's attention (flash and cuDNN backends) on the GPU tests' timing shapes.
time_sdpa() {
  timeout 120 python3 "$ROOT/bench/attention_peer.py" > "$WORK/attention_peer.log" 2>&1
  echo "attention_peer.py exit code: $?"; cat "$WORK/attention_peer.log"
}

if has_part sdpa && ! has_part peer; then
  stamp sdpa
  time_sdpa
fi

if has_part peer; then
  stamp peer
  # Sourced: where pip refuses a system install it installs to a folder and exports PYTHONPATH.
  # (with no positional arguments: the installer reads its own)
  install_peer_wheels_once
  time_sdpa
  # shellcheck disable=SC2086
  peer_run peer "${PEER_TIMEOUT:-540}" 4000 python3 "$ROOT/bench/peer_hf.py" $PEER_SHAPE --batch 2 \
    --accum "${LADDER_ACCUM:-2}" --seq 2048 --steps "$STEPS" --out "$WORK/peer.json" ${PEER_ARGS:-}
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
  for budget in ${LONG_FIT_BUDGETS:-24GiB 80GiB}; do
    "$BIN_DIR/memtune" fit --model llama-3.1-8b --vram "$budget" --max-context --json > "$L/fit-$budget.json" 2>&1
    echo "fit --max-context --vram $budget:"; cat "$L/fit-$budget.json"
  done
  LONG_SEQ=${LONG_SEQ:-131072}
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$L/smi.log" 2>&1 &
  SAMPLER=$!
  TIMER=(); [ -x /usr/bin/time ] && TIMER=(/usr/bin/time -v)  # max RSS, where installed
  "${TIMER[@]}" timeout "${LONG_TIMEOUT:-480}" "$BIN_DIR/memtune" train --device cuda --model llama-3.1-8b \
    --load_in_4bit --bf16 --gradient_checkpointing --attn_implementation "${LONG_ATTN:-flash}" --loss_implementation chunked \
    --offload_activations --offload_embeddings --batch 1 --accum 1 --seq "$LONG_SEQ" \
    --max_steps "${LONG_STEPS:-3}" --vram "${LONG_VRAM:-24GiB}" --metrics "$L/metrics.jsonl" --out "$L/out" > "$L/train.log" 2>&1
  rc=$?
  kill $SAMPLER 2>/dev/null; wait $SAMPLER 2>/dev/null
  echo "longctx train seq $LONG_SEQ exit $rc; device peak (nvidia-smi max of $(wc -l < "$L/smi.log") samples): $(sort -n "$L/smi.log" | tail -1) MiB; idle before: $(head -1 "$L/smi.log") MiB"
  [ $rc -ne 0 ] && status=1
  grep -E "peak|host|step +[0-9]+|tokens/s|error|Maximum resident" "$L/train.log" | tail -20
  rm -rf "$L/out"
fi

# One timed `memtune train` on the 8B architecture: timed_train DIR NAME TIMEOUT ARGS...; nvidia-smi
# sampled every 100 ms into DIR/NAME.smi, --metrics into DIR/NAME.jsonl, the log in DIR/NAME.log;
# prints tokens/s and the device peak (bench/data_modes.py over the steps after the first two).
timed_train() {
  local dir=$1 name=$2 limit=$3; shift 3
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$dir/$name.smi" 2>&1 &
  local sampler=$!
  # Llama 3.1 8B unless the variant names its model.
  local model=(--model llama-3.1-8b)
  [[ " $* " == *" --model "* ]] && model=()
  timeout "$limit" "$BIN_DIR/memtune" train --device cuda "${model[@]}" "$@" --quiet \
    --metrics "$dir/$name.jsonl" --out "$dir/out" > "$dir/$name.log" 2>&1
  local rc=$?
  kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
  echo "memtune $name exit $rc: $(python3 "$ROOT/bench/data_modes.py" "$dir/$name.jsonl" "$dir/$name.smi" 2>&1)"
  grep -h "device memory in use\|flash kernel for these packed rows" "$dir/$name.log" | head -3
  [ $rc -ne 0 ] && { status=1; tail -5 "$dir/$name.log"; }
  rm -rf "$dir/out"
  return 0
}

# memtune on issue 21's configurations, one `memtune train` each (tokens/s and device peak as in
# memtune_peer_data: bench/data_modes.py over the steps after the first two, nvidia-smi sampled):
#   qlora, qlora-offload   configuration 1: the QLoRA full stack (ckpt, fused attention, chunked
#                          loss, host embeddings) at the ladder's shape; + the checkpointed layer
#                          inputs in pinned host memory (as Unsloth's "unsloth" checkpointing)
#   lora16, lora16-offload configuration 3: 16-bit LoRA (bf16, ckpt, fused attention, chunked loss,
#                          host embeddings); + activation offload
#   qlora-unstacked, lora16-unstacked  configurations 1 and 3 with --stacked_lora false (one LoRA A
#                          GEMM per projection, not one for q/k/v and one for gate/up), profiled: the
#                          A/B against qlora and lora16
#   data-unpacked, data-packed  configuration 2: QLoRA, batch 2 x accumulation 4, r32 a32, on
#                          sft-tasks.jsonl x DATA_REPEAT through the Llama 3 tokenizer
#   data-merged            configuration 2 unpacked with --merge_micro_batches (the default since the
#                          A/B of 2026-12-06); data-unpacked runs with it off
#   qlora-offload-opt, lora16-offload-opt, data-merged-opt  the same with --offload_optimizer too
#                          (AdamW's moments in pinned host memory): the leanest run of each
#   lora16-stream6, lora16-stream8  lora16-offload-opt with 6 or 8 of the 32 frozen layers streamed
#                          from pinned host memory (--stream_layers), configuration 3's memory target
#   qlora70b-24g           Llama 3.1 70B QLoRA at 1 x 2048 under --vram 24GiB with what `fit` chose
#                          for it (both offloads, 41 of the 80 layers streamed): the verdict on a GPU
if has_part configs; then
  stamp configs
  C="$WORK/configs"; mkdir -p "$C"
  cdata="$C/sft-tasks-x$DATA_REPEAT.jsonl"
  : > "$cdata"; for i in $(seq "$DATA_REPEAT"); do cat "$ROOT/examples/sft-tasks.jsonl" >> "$cdata"; done
  QLORA="--load_in_4bit --bf16 --gradient_checkpointing --attn_implementation auto --loss_implementation chunked --offload_embeddings"
  LORA16="--bf16 --gradient_checkpointing --attn_implementation auto --loss_implementation chunked --offload_embeddings"
  SHAPE1="--batch 2 --accum ${LADDER_ACCUM:-2} --seq 2048 --lora_r 16 --lora_alpha 16"
  SHAPE2="--batch 2 --accum 4 --seq 2048 --lora_r 32 --lora_alpha 32 --tokenizer $TOKENIZER --data $cdata"
  # The two plain variants also time every op of their last step (--profile; left out of tokens/s).
  for variant in "qlora|$QLORA $SHAPE1 --profile" "qlora-offload|$QLORA --offload_activations $SHAPE1" \
                 "lora16|$LORA16 $SHAPE1 --profile" "lora16-offload|$LORA16 --offload_activations $SHAPE1" \
                 "data-unpacked|$QLORA $SHAPE2 --merge_micro_batches false" "data-packed|$QLORA $SHAPE2 --packing" \
                 "data-merged|$QLORA $SHAPE2 --merge_micro_batches true" \
                 "qlora-offload-opt|$QLORA --offload_activations --offload_optimizer $SHAPE1" \
                 "lora16-offload-opt|$LORA16 --offload_activations --offload_optimizer $SHAPE1" \
                 "lora16-stream6|$LORA16 --offload_activations --offload_optimizer --stream_layers 6 $SHAPE1" \
                 "lora16-stream8|$LORA16 --offload_activations --offload_optimizer --stream_layers 8 $SHAPE1" \
                 "qlora70b-24g|--model llama-3.1-70b $QLORA --offload_activations --stream_layers 41 --vram 24GiB --batch 1 --accum 1 --seq 2048" \
                 "data-merged-opt|$QLORA $SHAPE2 --merge_micro_batches true --offload_optimizer" \
                 "qlora-unstacked|$QLORA $SHAPE1 --stacked_lora false --profile" \
                 "lora16-unstacked|$LORA16 $SHAPE1 --stacked_lora false --profile"; do
    name=${variant%%|*}; args=${variant#*|}
    case ",${CONFIGS:-qlora,qlora-offload,lora16,lora16-offload,data-unpacked,data-packed,data-merged,qlora-unstacked,lora16-unstacked}," in *",$name,"*) ;; *) continue;; esac
    # shellcheck disable=SC2086
    timed_train "$C" "$name" "${CONFIG_TIMEOUT:-150}" $args --max_steps "${CONFIG_STEPS:-6}"
  done
  rm -f "$cdata"
fi

# Where the Hopper backward's time goes (issue 23): hardware counters of one launch of its main
# pass and of cuDNN's backward at the same shape, from the timing test's NVTX range for that shape.
# "No kernels were profiled" in a log means the range or the kernel name did not match.
if has_part ncu-attn; then
  stamp ncu-attn
  # NCU_VARIANTS: the Hopper main pass's variants besides the default, by the timing test's NVTX
  # range suffixes (e.g. "bulk_keys bulk_rising bulk_falling").
  for shape in ${NCU_SHAPES:-b8_s2048_d128 b2_s8192_d128}; do
    whiches=""
    for base in ${NCU_BASE-hopper cudnn}; do
      case $base in
        hopper) whiches="$whiches hopper|regex:flash_backward_hopper" ;;
        cudnn) whiches="$whiches cudnn|regex:(sdpa|fmha|bprop|dgrad)" ;;
      esac
    done
    for variant in ${NCU_VARIANTS:-}; do whiches="$whiches hopper_$variant|regex:flash_backward_hopper"; done
    for which in $whiches; do
      name=${which%%|*}; kernels=${which#*|}
      range=hopper_bwd_$shape; [ "${name#hopper_}" != "$name" ] && range=${range}_${name#hopper_}
      timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --set full --nvtx --nvtx-include "$range/" \
        -k "$kernels" --launch-count 1 "$BIN_DIR/memtune_gpu_tests" \
        --gtest_filter=CudaHopperBackwardTest.TimingPrintHopperBackward > "$WORK/ncu-$name-$shape.txt" 2>&1
      rc=$?
      echo "ncu $name $shape: exit $rc (124: timed out); the profiled kernel and its headline metrics:"
      grep -m1 -E '^  [A-Za-z_].*\(.*\)x\(' "$WORK/ncu-$name-$shape.txt" | cut -c1-160
      # The first of each (Speed Of Light, memory, scheduler and warp-state sections of --set full).
      for metric in 'Duration' 'Compute \(SM\) Throughput' 'Memory Throughput' 'L1/TEX Cache Throughput' \
                    'L2 Cache Throughput' 'DRAM Throughput' 'L2 Hit Rate' 'Mem Busy' 'Issue Slots Busy' 'No Eligible' \
                    'Warp Cycles Per Issued Instruction' 'Registers Per Thread' 'Achieved Occupancy'; do
        grep -m1 -E "^ +$metric " "$WORK/ncu-$name-$shape.txt" | tr -s ' '
      done
      grep -m3 -E "No kernels were profiled|==ERROR==" "$WORK/ncu-$name-$shape.txt"
    done
  done
fi

# The own flash kernel's versions in a step (see the part list above): the same run under each
# MEMTUNE_FLASH_BACKWARD value, alternated so that the run-to-run spread shows beside the gain.
if has_part attn-step; then
  stamp attn-step
  A="$WORK/attn-step"; mkdir -p "$A"
  QLORA_FLASH="--load_in_4bit --bf16 --gradient_checkpointing --loss_implementation chunked --offload_embeddings"
  # One run a backward version: attn_step_runs NAME SUFFIX TIMEOUT TRAIN_ARGS...; the run of entry E
  # is NAME-E-SUFFIX. An entry is a MEMTUNE_FLASH_BACKWARD value (the default order), or
  # VALUE:ORDER with a MEMTUNE_FLASH_BACKWARD_ORDER (keys, rising, falling).
  attn_step_runs() {
    local name=$1 suffix=$2 limit=$3 entry backward
    shift 3
    for entry in ${ATTN_STEP_BACKWARDS:-v2 hopper}; do
      backward=${entry%%:*}
      unset MEMTUNE_FLASH_BACKWARD_ORDER  # an empty value would abort: unset is the default order
      [ "$entry" != "$backward" ] && export MEMTUNE_FLASH_BACKWARD_ORDER=${entry#*:}
      # shellcheck disable=SC2086
      MEMTUNE_FLASH_BACKWARD=$backward \
        timed_train "$A" "$name-${entry/:/-}$suffix" "$limit" $QLORA_FLASH --attn_implementation flash "$@"
    done
    unset MEMTUNE_FLASH_BACKWARD_ORDER
  }
  for round in $(seq "${ATTN_STEP_ROUNDS:-2}"); do
    attn_step_runs c1 "-$round" 150 --batch 2 --accum 2 --seq 2048 --lora_r 16 --lora_alpha 16 --max_steps 6
  done
  attn_step_runs s32k "" 200 --batch 1 --accum 1 --seq 32768 --lora_r 16 --lora_alpha 16 --max_steps 4
  if [ "${ATTN_STEP_CUDNN:-1}" = 1 ]; then
    timed_train "$A" "s32k-cudnn" 200 $QLORA_FLASH --attn_implementation cudnn \
      --batch 1 --accum 1 --seq 32768 --lora_r 16 --lora_alpha 16 --max_steps 4
  fi
fi

# The --vram verdict at its edge: the longest context `fit --max-context` accepts under EDGE_VRAM
# (with offload, fused attention as auto picks it, host embeddings), then trained there under the
# same --vram; the device's maximum (nvidia-smi, every 100 ms) must stay inside the budget.
if has_part edge; then
  stamp edge
  E="$WORK/edge"; mkdir -p "$E"
  EDGE_VRAM=${EDGE_VRAM:-24GiB}
  EDGE_FLAGS="--attn_implementation auto --offload_embeddings"
  "$BIN_DIR/memtune" fit --model llama-3.1-8b --vram "$EDGE_VRAM" --max-context --json $EDGE_FLAGS > "$E/fit.json" 2> "$E/fit.log"
  cat "$E/fit.json"
  # EDGE_OFFLOAD=0: the longest length without activation offload, trained without it (under a
  # large budget the offloaded length is bounded by host memory and takes minutes a step).
  EDGE_KEY=with_offload; EDGE_TRAIN_OFFLOAD=--offload_activations
  [ "${EDGE_OFFLOAD:-1}" = 0 ] && { EDGE_KEY=without_offload; EDGE_TRAIN_OFFLOAD=; }
  edge_seq=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]]['seq'])" "$E/fit.json" "$EDGE_KEY" 2>/dev/null)
  if [ -n "$edge_seq" ] && [ "$edge_seq" -gt 0 ]; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$E/smi.log" 2>&1 &
    sampler=$!
    timeout "${EDGE_TIMEOUT:-300}" "$BIN_DIR/memtune" train --device cuda --model llama-3.1-8b --load_in_4bit --bf16 \
      --gradient_checkpointing --loss_implementation chunked --mlp_chunk_tokens 1024 $EDGE_TRAIN_OFFLOAD $EDGE_FLAGS \
      --batch 1 --accum 1 --seq "$edge_seq" --max_steps "${EDGE_STEPS:-2}" --vram "$EDGE_VRAM" \
      --metrics "$E/metrics.jsonl" > "$E/train.log" 2>&1
    rc=$?
    kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
    peak=$(sort -n "$E/smi.log" | tail -1)
    budget_mib=$(python3 -c "import sys; v=sys.argv[1]; print(int(float(v[:-3]) * (1024 if v.endswith('GiB') else 1)))" "$EDGE_VRAM")
    echo "edge: train at seq $edge_seq under --vram $EDGE_VRAM exit $rc; nvidia-smi max $peak MiB of $budget_mib MiB" \
         "($([ -n "$peak" ] && [ "$peak" -le "$budget_mib" ] && echo inside || echo OVER))"
    grep -E "device memory in use|tokens/s|error" "$E/train.log" | tail -4
    [ $rc -ne 0 ] && status=1
  else
    echo "edge: fit found no length"; cat "$E/fit.log"; status=1
  fi
fi

# ---- the peers of issue 21 / issue 22: Unsloth, Liger, real data, longest context ----
if has_part unsloth; then
  stamp unsloth
  install_peer_wheels_once
  # Configurations 3 (16-bit LoRA: the flash rung) and 1 (the QLoRA rung), random ids.
  # shellcheck disable=SC2086
  peer_run unsloth "${UNSLOTH_TIMEOUT:-480}" 2500 python3 "$ROOT/bench/peer_unsloth.py" $PEER_SHAPE --batch 2 \
    --accum "${LADDER_ACCUM:-2}" --seq 2048 --steps "${UNSLOTH_STEPS:-4}" --only flash,qlora \
    --model-dir "$UNSLOTH_MODEL_DIR" "${UNSLOTH_TOKENIZER[@]}" --out "$WORK/unsloth.json" ${UNSLOTH_ARGS:-}
fi

if has_part unsloth-data; then
  stamp unsloth-data
  install_peer_wheels_once
  packs=("")
  [ "${UNSLOTH_DATA_PACKING:-0}" = 1 ] && packs+=("--packing")
  for pk in "${packs[@]}"; do
    name=unsloth-data${pk:+-packed}
    # shellcheck disable=SC2086
    peer_run "$name" "${UNSLOTH_TIMEOUT:-480}" 1500 python3 "$ROOT/bench/peer_unsloth.py" \
      --config "$ROOT/configs/models/llama-3.1-8b.json" --lr 2e-4 --weight-decay 0 --lora-r 32 --lora-alpha 32 \
      --batch 2 --accum 4 --seq 2048 --steps "${UNSLOTH_STEPS:-4}" --only qlora --data "$ROOT/examples/sft-tasks.jsonl" \
      --repeat "$DATA_REPEAT" --tokenizer "$TOKENIZER" $pk --model-dir "$UNSLOTH_MODEL_DIR" \
      --out "$WORK/$name.json" ${UNSLOTH_ARGS:-}
  done
fi

if has_part unsloth-context; then
  stamp unsloth-context
  install_peer_wheels_once
  for cap in $CONTEXT_CAPS; do
    # shellcheck disable=SC2086
    peer_run "unsloth-context-$cap" "${CONTEXT_TIMEOUT:-540}" 1500 python3 "$ROOT/bench/peer_unsloth.py" $PEER_SHAPE \
      --only qlora --max-context --cap-gib "$cap" $CONTEXT_ARGS --model-dir "$UNSLOTH_MODEL_DIR" \
      "${UNSLOTH_TOKENIZER[@]}" --out "$WORK/unsloth-context-$cap.json" ${UNSLOTH_ARGS:-}
  done
fi

if has_part liger; then
  stamp liger
  install_peer_wheels_once
  # shellcheck disable=SC2086
  peer_run peer-liger "${LIGER_TIMEOUT:-480}" 3000 python3 "$ROOT/bench/peer_hf.py" $PEER_SHAPE --liger --batch 2 \
    --accum "${LADDER_ACCUM:-2}" --seq 2048 --steps "${LIGER_STEPS:-3}" --out "$WORK/peer-liger.json" ${LIGER_ARGS:-}
fi

# memtune on the peer-data part's data: the QLoRA full stack (host embeddings) on sft-tasks.jsonl x
# DATA_REPEAT through the Llama 3 tokenizer, in every data mode, and on synthetic rows of one
# 2048-token sample each (no --data). bench/data_modes.py summarises each run's --metrics from the
# step records after the first two (cuDNN builds its graphs in the first steps): tokens of
# samples per second, trained targets per second, the padding share, and the device peak.
memtune_peer_data() {
  local D="$WORK/peer-data" data="$WORK/peer-data/sft-tasks-x$DATA_REPEAT.jsonl" i name args
  mkdir -p "$D"
  : > "$data"; for i in $(seq "$DATA_REPEAT"); do cat "$ROOT/examples/sft-tasks.jsonl" >> "$data"; done
  for variant in "memtune-synthetic|" "memtune-max_length|--data $data --padding max_length" \
                 "memtune-unpacked|--data $data" "memtune-grouped|--data $data --group_by_length" \
                 "memtune-padding_free|--data $data --padding_free" "memtune-packed|--data $data --packing"; do
    name=${variant%%|*}; args=${variant#*|}
    # DATA_MODES: a comma list of the modes to run (default all: synthetic,max_length,unpacked,...)
    [ -n "${DATA_MODES:-}" ] && case ",$DATA_MODES," in *",${name#memtune-},"*) ;; *) continue;; esac
    # shellcheck disable=SC2086
    timed_train "$D" "$name" "${DATA_TIMEOUT:-240}" --load_in_4bit --bf16 --gradient_checkpointing \
      --attn_implementation auto --loss_implementation chunked --offload_embeddings --batch 2 --accum 2 --seq 2048 \
      --lora_r 16 --lora_alpha 16 --max_steps "${DATA_STEPS:-6}" --tokenizer "$TOKENIZER" $args
  done
  rm -f "$data"
}

if has_part peer-data; then
  stamp peer-data
  install_peer_wheels_once
  if [ ! -f "$TOKENIZER" ]; then
    echo "peer-data: no Llama 3 tokenizer.json at $TOKENIZER (prepare-devbin copies it unless DEVBIN_SLIM=1): skipped"
    status=1
  else
    mkdir -p "$WORK/peer-data"
    packs=("")
    [ "${PEER_DATA_PACKED:-1}" = 1 ] && packs+=("--packing")
    for pk in "${packs[@]}"; do
      name=peer-data${pk:+-packed}
      # shellcheck disable=SC2086
      peer_run "peer-data/$name" "${DATA_TIMEOUT:-240}" 0 python3 "$ROOT/bench/peer_hf.py" $PEER_SHAPE --only qlora \
        --batch 2 --accum 2 --seq 2048 --steps "${DATA_STEPS:-6}" --data "$ROOT/examples/sft-tasks.jsonl" \
        --repeat "$DATA_REPEAT" --tokenizer "$TOKENIZER" $pk --out "$WORK/peer-data/$name.json" ${PEER_ARGS:-}
    done
    [ "${PEER_DATA_MEMTUNE:-1}" = 1 ] && memtune_peer_data
  fi
fi

# memtune-data: memtune alone on the peer-data part's data, in the modes of DATA_MODES (the peer's
# figures of an earlier call stand beside it).
if has_part memtune-data; then
  stamp memtune-data
  if [ -f "$TOKENIZER" ]; then memtune_peer_data; else echo "memtune-data: no tokenizer at $TOKENIZER"; status=1; fi
fi

if has_part peer-context; then
  stamp peer-context
  install_peer_wheels_once
  for cap in $CONTEXT_CAPS; do
    # shellcheck disable=SC2086
    peer_run "peer-context-$cap" "${CONTEXT_TIMEOUT:-540}" 0 python3 "$ROOT/bench/peer_hf.py" $PEER_SHAPE \
      --max-context --cap-gib "$cap" $CONTEXT_ARGS --out "$WORK/peer-context-$cap.json" ${PEER_ARGS:-}
  done
fi

# Every peer JSON of this call beside the ladder, where there is one (memtune report, several --peer).
if [ -f "$WORK/ladder/ladder.json" ]; then
  peers=()
  for f in "$WORK/peer.json" "$WORK/peer-liger.json" "$WORK/unsloth.json"; do [ -f "$f" ] && peers+=(--peer "$f"); done
  if [ ${#peers[@]} -gt 2 ]; then
    "$BIN_DIR/memtune" report --ladder "$WORK/ladder/ladder.json" "${peers[@]}" --out "$WORK/ladder-peers" \
      > "$WORK/report-peers.log" 2>&1 && tail -c 4000 "$WORK/report-peers.log"
  fi
fi

if [ -n "$FUZZ_PID" ]; then
  wait "$FUZZ_PID" || status=1
  stamp "fuzz finished"; cat "$WORK/fuzz.log"
  rm -rf "$WORK"/fuzz/corpus-*   # the grown corpora are large; the logs and any crash input stay
fi

stamp done
tar -czf "$OUT/results.tar.gz" -C "$WORK" . && ls -la "$OUT"
exit "$status"
