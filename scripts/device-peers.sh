#!/usr/bin/env bash
# The device calls of issues 21 and 22 (memtune beside Unsloth, Liger and transformers + PEFT on
# configurations 1-4, and the data table), three calls of ~9 minutes on one machine held warm
# between them. A call's logs go to $OUT: summary-<n>-<parts>.log and results-<n>.tar.gz per
# device-check run.
#
#   scripts/device-peers.sh CALL [BIN_DIR]
#     a   the GPU step tests (TEST_FILTER, default CudaStepTest.Offload*), memtune on configurations 1-3
#         (CONFIGS below), the data table of issue 22 (memtune's data modes and the transformers +
#         PEFT data peer), Liger and transformers + PEFT on configurations 1 and 3, then both on
#         configuration 2 (r32, accumulation 4, unpacked); with BASE_BIN_DIR set (a folder holding an
#         older memtune or memtune.gz and its libgomp), that binary's qlora and lora16 as an A/B
#     b   Unsloth: configuration 4 (the longest context at batch 1 under a 24 GiB cap, bisection over
#         CONTEXT_MIN..CONTEXT_MAX), then configurations 1 and 3 and its benchmark shape
#         (configuration 2); the model folder is written once for all of them
#     c   configuration 4: memtune's (the --vram verdict at its edge, EDGE_VRAM, default 24GiB: the
#         longest context `fit` accepts, trained 2 steps), then transformers + PEFT's and Liger's under
#         a 24 GiB cap
#     d   configuration 4 under the large cap (BIG_CAP, default 80 GiB): memtune's edge (1 step),
#         transformers + PEFT's and Liger's longest context
#     e   configuration 4 under the large cap for Unsloth
#     f   configuration 4 under the large cap, the half that needs a card of more than 80 GiB:
#         memtune's edge without activation offload (1 step), then Unsloth at that length (1 step)
#     g   configuration 4 under the large cap for transformers + PEFT and Liger
#     h   configurations 1 and 3 for all four tools in one call, and Unsloth's configuration 2
#     i   configuration 2 for transformers + PEFT and Liger
#     k   issue 23: the attention GPU tests, compute-sanitizer on the Hopper kernels', PyTorch SDPA
#     l   configuration 4 under the large cap past memtune's no-offload edge (LONG_SEQ): memtune with
#         activation offload (L_PART=memtune) or Unsloth's one-step probe (L_PART=unsloth)
#     m   issue 23: the own flash kernel's backward versions (v2, hopper) in training steps (configuration 1
#         and 1 x 32768, alternately), cuDNN at 32768 beside them, after the Hopper backward's GPU tests
#     n   issue 23: the Hopper backward's ways of adding dQ (2-float reductions, bulk
#         reduce-adds): its GPU tests, each in training steps (as m), compute-sanitizer on its
#         packed-row test, Nsight Compute (ncu-attn)
#     o   issue 23: the Hopper backward's block and item orders (keys, rising, falling) with dQ by
#         bulk reduce-adds: its GPU tests, each order in training steps, racecheck on its packed rows,
#         Nsight Compute on each order's main pass and cuDNN's backward
#     s   the seventh session's call: the GPU tests of --stream_layers, the Hopper forward and the
#         backward test fixed then (TEST_FILTER), configuration 3 with 0, 6 and 8 frozen layers
#         streamed (lora16-offload-opt, lora16-stream6, lora16-stream8) and 70B QLoRA under
#         --vram 24GiB (qlora70b-24g); with BASE_BIN_DIR, that build's Hopper attention timings
#         after them (a kernel change's A/B on the same machine)
#     s2  call s's second half: compute-sanitizer on the Hopper kernels' correctness tests, then
#         Unsloth's configuration 3 (16-bit LoRA)
#     ab  a kernel change's call: the whole GPU test suite (TEST_FILTER, default all) and compute-sanitizer
#         (AB_PARTS, default tests,sanitizer), then memtune's
#         configurations 1 and 3 (AB_CONFIGS) with BIN_DIR and with BASE_BIN_DIR (required)
#         alternately, AB_ROUNDS rounds (default 2), so that the run-to-run spread shows beside the gain
#   BIN_DIR  prepare-devbin.sh's folder (default .devbin); carry it and .whl.
# Each call reuses nothing of another: each can run on a fresh machine.
set -u
CALL=${1:?usage: scripts/device-peers.sh a|b|c|d|e|f|g|h|k|l|m|ab [BIN_DIR]}
BIN_DIR=${2:-.devbin}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/memtune-device-check}
mkdir -p "$OUT"
# The Llama 3 tokenizer, unpacked once for every part that reads it.
TOKDIR=/tmp/peer-tokenizer
mkdir -p "$TOKDIR"
if [ -f "$BIN_DIR/tokenizer.json.gz" ]; then gunzip -c "$BIN_DIR/tokenizer.json.gz" > "$TOKDIR/tokenizer.json"
elif [ -f "$BIN_DIR/tokenizer.json" ]; then cp "$BIN_DIR/tokenizer.json" "$TOKDIR/"; fi
[ -f "$BIN_DIR/tokenizer_config.json" ] && cp "$BIN_DIR/tokenizer_config.json" "$TOKDIR/"
export TOKENIZER=$TOKDIR/tokenizer.json
nvidia-smi > "$OUT/device.txt" 2>&1
ls /usr/lib/x86_64-linux-gnu/libcudnn.so.9* >> "$OUT/device.txt" 2>&1
cat "$BIN_DIR/COMMIT" > "$OUT/commit.txt" 2>/dev/null
n=0
# One device-check run: its own WORK, its summary and its tarball under $OUT.
check() {
  local bin=$1 parts=$2
  n=$((n + 1))
  echo "== $(date -u +%T) device-check $bin $parts" | tee -a "$OUT/dates.txt"
  last_work=/tmp/mt-peers-$CALL-$n  # the run's WORK, for a later run of the call that reads its files
  rm -rf "$last_work"  # a warm machine keeps /tmp: no earlier call's files in this tarball
  WORK=$last_work bash "$ROOT/scripts/device-check.sh" "$bin" "$parts" 2>&1 | tee "$OUT/summary-$n-${parts//,/_}.log" | tail -c 5000
  [ -f "$OUT/results.tar.gz" ] && mv "$OUT/results.tar.gz" "$OUT/results-$n.tar.gz"
}
# memtune's variants of configurations 1-3 (device-check's configs part).
MEMTUNE_CONFIGS=qlora,qlora-offload,qlora-offload-opt,lora16,lora16-offload-opt,data-merged,data-merged-opt,data-packed
# transformers + PEFT and Liger on configurations 1 and 3 (the ladder's flash and QLoRA rungs).
hf_and_liger_configs_1_3() {
  LIGER_STEPS=3 LIGER_ARGS="--only flash,qlora" LIGER_TIMEOUT=120 LADDER_STEPS=3 PEER_ARGS="--only flash,qlora" \
    PEER_TIMEOUT=120 check "$BIN_DIR" liger,peer
}
# Both on configuration 2 (r32, batch 2 x accumulation 4, sft-tasks.jsonl, unpacked; PEER_ARGS come
# last and win).
hf_and_liger_config_2() {
  local c2="--lora-r 32 --lora-alpha 32 --accum 4 --steps 4"
  PEER_DATA_MEMTUNE=0 PEER_DATA_PACKED=0 DATA_TIMEOUT=100 PEER_ARGS="$c2" check "$BIN_DIR" peer-data
  PEER_DATA_MEMTUNE=0 PEER_DATA_PACKED=0 DATA_TIMEOUT=100 PEER_ARGS="$c2 --liger" check "$BIN_DIR" peer-data
}
# Unsloth's one step at one length under the large cap (fits or not; a step there takes minutes):
# unsloth_at_length SEQ CONTEXT_TIMEOUT PROBE_TIMEOUT.
unsloth_at_length() {
  CONTEXT_CAPS=$BIG_CAP CONTEXT_MIN=$1 CONTEXT_MAX=$1 CONTEXT_UNIT=$1 CONTEXT_STEPS=0 \
    CONTEXT_TIMEOUT=$2 PROBE_TIMEOUT=$3 check "$BIN_DIR" unsloth-context
}
case "$CALL" in
  a)
    GTEST_FILTER=${TEST_FILTER:-CudaStepTest.Offload*} TEST_TIMEOUT=${TEST_TIMEOUT:-60} CONFIG_STEPS=6 \
      CONFIGS=${CONFIGS:-$MEMTUNE_CONFIGS} check "$BIN_DIR" tests,configs
    [ -n "${BASE_BIN_DIR:-}" ] && CONFIGS=qlora,lora16 CONFIG_STEPS=6 check "$BASE_BIN_DIR" configs
    DATA_MODES=synthetic,unpacked,grouped,padding_free,packed DATA_STEPS=6 DATA_TIMEOUT=90 check "$BIN_DIR" peer-data
    hf_and_liger_configs_1_3
    hf_and_liger_config_2
    ;;
  b)
    # The longest context first (nothing else measures it); the model folder it writes is reused.
    CONTEXT_CAPS=24 CONTEXT_MIN=${CONTEXT_MIN:-73728} CONTEXT_MAX=${CONTEXT_MAX:-90112} CONTEXT_UNIT=8192 \
      CONTEXT_TIMEOUT=${CONTEXT_TIMEOUT:-300} PROBE_TIMEOUT=120 check "$BIN_DIR" unsloth-context
    # PEER_PROFILE=1: one more step of each rung under torch.profiler (its kernels by GPU time).
    PEER_PROFILE=1 UNSLOTH_STEPS=4 UNSLOTH_TIMEOUT=${UNSLOTH_TIMEOUT:-220} check "$BIN_DIR" unsloth,unsloth-data
    ;;
  c)
    # memtune's configuration 4 first: the longest context that `fit` accepts under 24 GiB, trained.
    EDGE_VRAM=${EDGE_VRAM:-24GiB} EDGE_STEPS=2 EDGE_TIMEOUT=${EDGE_TIMEOUT:-270} check "$BIN_DIR" edge
    CONTEXT_CAPS=24 CONTEXT_MIN=8192 CONTEXT_MAX=40960 CONTEXT_UNIT=8192 CONTEXT_TIMEOUT=150 PROBE_TIMEOUT=50 \
      check "$BIN_DIR" peer-context
    CONTEXT_CAPS=24 CONTEXT_MIN=16384 CONTEXT_MAX=98304 CONTEXT_UNIT=8192 CONTEXT_TIMEOUT=150 PROBE_TIMEOUT=50 \
      PEER_ARGS="--liger" check "$BIN_DIR" peer-context
    ;;
  d)
    # Configuration 4 under the large cap (BIG_CAP GiB, default 80; an H100 80GB holds 79.2 GiB, so
    # 79 there): memtune's edge without activation offload (one step: ~240k tokens; with offload
    # the length is bounded by host memory and a step takes minutes), then transformers + PEFT's
    # and Liger's longest context.
    BIG_CAP=${BIG_CAP:-80}
    EDGE_VRAM=${BIG_CAP}GiB EDGE_OFFLOAD=0 EDGE_STEPS=1 EDGE_TIMEOUT=${EDGE_TIMEOUT:-300} check "$BIN_DIR" edge
    CONTEXT_CAPS=$BIG_CAP CONTEXT_MIN=16384 CONTEXT_MAX=81920 CONTEXT_UNIT=16384 CONTEXT_TIMEOUT=120 PROBE_TIMEOUT=50 \
      check "$BIN_DIR" peer-context
    CONTEXT_CAPS=$BIG_CAP CONTEXT_MIN=65536 CONTEXT_MAX=196608 CONTEXT_UNIT=16384 CONTEXT_TIMEOUT=150 PROBE_TIMEOUT=70 \
      PEER_ARGS="--liger" check "$BIN_DIR" peer-context
    ;;
  e)
    # Unsloth's longest context under the large cap.
    BIG_CAP=${BIG_CAP:-80}
    CONTEXT_CAPS=$BIG_CAP CONTEXT_MIN=${CONTEXT_MIN:-131072} CONTEXT_MAX=${CONTEXT_MAX:-262144} CONTEXT_UNIT=16384 \
      CONTEXT_TIMEOUT=${CONTEXT_TIMEOUT:-540} PROBE_TIMEOUT=150 check "$BIN_DIR" unsloth-context
    ;;
  f)
    # Configuration 4 under the large cap, the half that needs a card of more than 80 GiB: memtune's
    # edge without activation offload (`fit --max-context`, one step: ~243k tokens take ~2.5 min a
    # step), then Unsloth at that same length (UNSLOTH_EDGE_SEQ; one step, fits or not: a step
    # there takes minutes, so a bisection of Unsloth's own longest does not fit in a call).
    BIG_CAP=${BIG_CAP:-80}
    EDGE_VRAM=${BIG_CAP}GiB EDGE_OFFLOAD=0 EDGE_STEPS=1 EDGE_TIMEOUT=${EDGE_TIMEOUT:-260} check "$BIN_DIR" edge
    seq=${UNSLOTH_EDGE_SEQ:-$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['without_offload']['seq'])" \
      "$last_work/edge/fit.json" 2>/dev/null)}
    [ -n "$seq" ] && unsloth_at_length "$seq" "${CONTEXT_TIMEOUT:-420}" "${PROBE_TIMEOUT:-400}"
    ;;
  g)
    # Configuration 4 under the large cap for transformers + PEFT and Liger (windows from the 24 GiB
    # run's memory a token; each probe 1 timed step + 1 untimed).
    BIG_CAP=${BIG_CAP:-80}
    CONTEXT_CAPS=$BIG_CAP CONTEXT_MIN=32768 CONTEXT_MAX=65536 CONTEXT_UNIT=16384 CONTEXT_STEPS=1 CONTEXT_TIMEOUT=150 \
      PROBE_TIMEOUT=70 check "$BIN_DIR" peer-context
    CONTEXT_CAPS=$BIG_CAP CONTEXT_MIN=131072 CONTEXT_MAX=163840 CONTEXT_UNIT=16384 CONTEXT_STEPS=1 CONTEXT_TIMEOUT=330 \
      PROBE_TIMEOUT=250 PEER_ARGS="--liger" check "$BIN_DIR" peer-context
    ;;
  k)
    # Issue 23's call: the attention GPU tests (own kernels, the Hopper forward and backward, cuDNN;
    # their timing lines are the table's memtune columns), compute-sanitizer on the Hopper kernels'
    # correctness tests, and PyTorch SDPA (flash, cuDNN) on the same shapes.
    GTEST_FILTER=${TEST_FILTER:-'CudaHopperAttentionTest.*:CudaHopperBackwardTest.*:CudaAttentionTest.*:CudnnAttentionTest.*:CudnnRaggedTest.*:CudaAttentionPickTest.*:CudaStepTest.WholeStepsAtTensorCoreHeadDimsMatchTheCpu'} \
      TEST_TIMEOUT=${TEST_TIMEOUT:-240} check "$BIN_DIR" tests,sdpa
    # The sanitizer last and in its own run: its two tools take minutes (the packed-row backward test
    # runs every dQ way and order), and a call cut at 600 s keeps the table above.
    SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-150} \
      SANITIZER_FILTER=${SANITIZER_FILTER:-'CudaHopperAttentionTest.ForwardMatchesCpuAndFeedsTheBackward:CudaHopperAttentionTest.PackedRowsMatchCpu:CudaHopperBackwardTest.PackedRowsMatchCpu'} \
      check "$BIN_DIR" sanitizer-tests
    ;;
  s)
    GTEST_FILTER=${TEST_FILTER:-'CudaStepTest.StreamedLayers*:CudaHopperAttentionTest.*:CudaHopperBackwardTest.BackendBackwardMatchesV2AtOddShapes'} \
      TEST_TIMEOUT=${TEST_TIMEOUT:-150} CONFIGS=${CONFIGS:-lora16-offload-opt,lora16-stream6,lora16-stream8,qlora70b-24g} \
      CONFIG_STEPS=6 CONFIG_TIMEOUT=${CONFIG_TIMEOUT:-200} check "$BIN_DIR" tests,configs
    # With BASE_BIN_DIR (an older memtune_gpu_tests.gz and its libgomp): its attention timings, the
    # A/B of a kernel change on the same machine.
    [ -n "${BASE_BIN_DIR:-}" ] && GTEST_FILTER=${BASE_TEST_FILTER:-'CudaHopperBackwardTest.TimingPrintHopperBackward:CudaHopperAttentionTest.TimingPrintHopperForward'} \
      TEST_TIMEOUT=120 check "$BASE_BIN_DIR" tests
    ;;
  s2)
    # The second half of call s (which with it ran past 600 s): compute-sanitizer on the Hopper
    # kernels' correctness tests (both forward kernels), then Unsloth's configuration 3.
    SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-150} \
      SANITIZER_FILTER=${SANITIZER_FILTER:-'CudaHopperAttentionTest.ForwardMatchesCpuAndFeedsTheBackward:CudaHopperAttentionTest.PackedRowsMatchCpu:CudaHopperBackwardTest.PackedRowsMatchCpu'} \
      check "$BIN_DIR" sanitizer-tests
    UNSLOTH_ARGS="--only flash" UNSLOTH_STEPS=4 UNSLOTH_TIMEOUT=${UNSLOTH_TIMEOUT:-240} check "$BIN_DIR" unsloth
    ;;
  h)
    # Configurations 1 and 3 for all four tools in one call: memtune's variants, Unsloth (1, 3 and its
    # benchmark shape 2), transformers + PEFT and Liger on 1 and 3. Their configuration 2 is call i:
    # on an H100 (2026-12-07) Unsloth's part took 345 s (a 57 s build and 44 s of compilation before
    # its first step), and a 220 s limit cut its QLoRA rung; with the peers' configuration 2 after
    # it, the call ran past 600 s.
    CONFIGS=${CONFIGS:-$MEMTUNE_CONFIGS} CONFIG_STEPS=6 check "$BIN_DIR" configs
    UNSLOTH_STEPS=4 UNSLOTH_TIMEOUT=${UNSLOTH_TIMEOUT:-300} check "$BIN_DIR" unsloth,unsloth-data
    hf_and_liger_configs_1_3
    ;;
  i)
    # Configuration 2 (r32, batch 2 x accumulation 4, sft-tasks.jsonl, unpacked) for transformers +
    # PEFT and Liger: the half of the old call h that followed Unsloth (memtune's configuration 2,
    # data-merged and data-packed, runs in call h's configs part).
    hf_and_liger_config_2
    ;;
  l)
    # Configuration 4 under the large cap past memtune's no-offload edge: memtune with activation
    # offload trained LONG_SEQ tokens (default 327,680; one step, minutes) under --vram BIG_CAP GiB
    # (L_PART=memtune), or Unsloth's one-step probe at the same length (L_PART=unsloth): one call each.
    BIG_CAP=${BIG_CAP:-80}; LONG_SEQ=${LONG_SEQ:-327680}
    if [ "${L_PART:-memtune}" = memtune ]; then
      LONG_SEQ=$LONG_SEQ LONG_VRAM=${BIG_CAP}GiB LONG_FIT_BUDGETS=${BIG_CAP}GiB LONG_STEPS=1 LONG_ATTN=auto \
        LONG_TIMEOUT=${LONG_TIMEOUT:-540} check "$BIN_DIR" longctx
    else
      unsloth_at_length "$LONG_SEQ" "${CONTEXT_TIMEOUT:-560}" "${PROBE_TIMEOUT:-540}"
    fi
    ;;
  m)
    # Issue 23: whether the Hopper backward is right and faster in a step before it becomes the
    # default: its GPU tests first (a wrong kernel's timings mean nothing), then device-check's attn-step.
    GTEST_FILTER=${TEST_FILTER:-'CudaHopperBackwardTest.*-*Timing*'} TEST_TIMEOUT=${TEST_TIMEOUT:-120} \
      check "$BIN_DIR" tests,attn-step
    ;;
  n)
    # Issue 23: the Hopper backward's ways of adding dQ (MEMTUNE_FLASH_BACKWARD=hopper-pairs, and
    # hopper in the keys_first order: bulk reduce-adds; a 4-float way measured here was removed):
    # its GPU tests (each way against the CPU, v2 and the others; the timing print with each), each
    # in training steps (configuration 1 twice, 1 x 32768, cuDNN beside), compute-sanitizer on the
    # packed-row test (each way), then Nsight Compute on the main pass and cuDNN's backward.
    # With them the tests of what 43712a6 and 226dff5 reshaped without a GPU: the Hopper forward's
    # tensor maps, the cuDNN sequence-table upload on packed rows, the attention pick's probe.
    GTEST_FILTER=${TEST_FILTER:-'CudaHopperBackwardTest.*:CudaHopperAttentionTest.*:CudnnRaggedTest.*:CudaAttentionPickTest.*'} \
      TEST_TIMEOUT=${TEST_TIMEOUT:-200} check "$BIN_DIR" tests
    ATTN_STEP_BACKWARDS=${ATTN_STEP_BACKWARDS:-'hopper-pairs hopper:keys'} check "$BIN_DIR" attn-step
    SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-120} SANITIZER_FILTER=${SANITIZER_FILTER:-'CudaHopperBackwardTest.PackedRowsMatchCpu'} \
      check "$BIN_DIR" sanitizer-tests
    check "$BIN_DIR" ncu-attn
    ;;
  o)
    # Issue 23: the Hopper backward's block and item orders (MEMTUNE_FLASH_BACKWARD_ORDER: keys,
    # rising, falling) with dQ by bulk reduce-adds: its GPU tests (every order against v2, the
    # timing print with each), each order in training steps (configuration 1 and 1 x 32768), then
    # racecheck on the packed-row test (the bulk way at head_dim 64 had reported hazards).
    GTEST_FILTER=${TEST_FILTER:-'CudaHopperBackwardTest.*'} TEST_TIMEOUT=${TEST_TIMEOUT:-150} check "$BIN_DIR" tests
    ATTN_STEP_ROUNDS=1 ATTN_STEP_CUDNN=0 \
      ATTN_STEP_BACKWARDS=${ATTN_STEP_BACKWARDS:-'hopper:keys hopper:rising hopper:falling'} \
      check "$BIN_DIR" attn-step
    SANITIZER_TOOLS=racecheck SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-150} \
      SANITIZER_FILTER=${SANITIZER_FILTER:-'CudaHopperBackwardTest.PackedRowsMatchCpu'} check "$BIN_DIR" sanitizer-tests
    # Nsight Compute on each order's main pass (L2 hit rate, DRAM throughput; the default main pass's
    # and cuDNN's are in bench/results/2026-12-07-h100-session5 call2-n; NCU_BASE="hopper cudnn" adds them).
    NCU_BASE=${NCU_BASE-} NCU_VARIANTS=${NCU_VARIANTS:-'bulk_keys bulk_rising bulk_falling'} \
      NCU_TIMEOUT=${NCU_TIMEOUT:-60} check "$BIN_DIR" ncu-attn
    ;;
  ab)
    : "${BASE_BIN_DIR:?device-peers ab: set BASE_BIN_DIR to the binaries to compare against}"
    AB_PARTS=${AB_PARTS:-tests,sanitizer}  # "-": only the A/B (the tests ran in a call before)
    [ "$AB_PARTS" != - ] && GTEST_FILTER=${TEST_FILTER:-*} TEST_TIMEOUT=${TEST_TIMEOUT:-400} check "$BIN_DIR" "$AB_PARTS"
    for round in $(seq "${AB_ROUNDS:-2}"); do
      CONFIGS=${AB_CONFIGS:-qlora,lora16} CONFIG_STEPS=6 check "$BIN_DIR" configs
      CONFIGS=${AB_CONFIGS:-qlora,lora16} CONFIG_STEPS=6 check "$BASE_BIN_DIR" configs
    done
    ;;
  *) echo "device-peers: unknown call $CALL (a, b, c, d, e, f, g, h, i, k, l, m, n, o or ab)" >&2; exit 2 ;;
esac
echo "== $(date -u +%T) done" | tee -a "$OUT/dates.txt"
