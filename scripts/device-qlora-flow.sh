#!/usr/bin/env bash
# QLoRA against bitsandbytes, and the fine-tuning flow at Llama-3.1-8B size, on a CUDA machine.
# Logs go under $OUT (bundled into $OUT/qlora-flow.tar.gz); the last lines are a summary.
#
#   scripts/device-qlora-flow.sh [BIN_DIR] [PARTS]
#     BIN_DIR  memtune and its libraries (scripts/prepare-devbin.sh: .devbin, which also holds the
#              Llama 3 tokenizer.json)
#     PARTS    comma list, default bnb,flow8b:
#       bnb     tools/bnb_reference.py writes a random model with Llama-3.1-8B widths (2 layers,
#               real-sized projections) dense and, through transformers + bitsandbytes, as 4-bit
#               folders (nf4 + double quant, fp4). Then: memtune quantize of the dense folder is
#               compared byte for byte with bitsandbytes' folders; memtune logits (GPU) of
#               bitsandbytes' folder against transformers + bitsandbytes; a short memtune QLoRA
#               train on that folder, and its adapter through PEFT against memtune logits.
#       chunks  tokens/s and device peak of the full stack for several MLP / loss chunk sizes
#       flow8b  Llama-3.1-8B architecture (random weights) QLoRA with the full memory stack on
#               examples/sft-tasks.jsonl with the Llama 3 tokenizer: train with eval, generate
#               with the adapter (chat template), and the exported PEFT folder.
# BNB_CODES_ONLY=1: the bnb part stops after the code comparison.
# Needs bitsandbytes (bench/install_peer_wheels.sh installs the carried wheel), torch,
# transformers and peft.
set -u
BIN_DIR=${1:-.devbin}
PARTS=${2:-bnb,flow8b}
OUT=${OUT:-/tmp/memtune-qlora-flow}
WORK=${WORK:-/tmp/memtune-qlora-work}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN_DIR=$(cd "$BIN_DIR" && pwd)
MEMTUNE="$BIN_DIR/memtune"
TOKENIZER=${TOKENIZER:-$BIN_DIR/tokenizer.json}
mkdir -p "$OUT" "$WORK"
export LD_LIBRARY_PATH="$BIN_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
has_part() { [[ ",$PARTS," == *",$1,"* ]]; }
stamp() { echo "== $1 ($(date -u +%H:%M:%S))"; }
summary=()
# check NAME COMMAND...: runs it, logs to WORK/NAME.log, records pass/fail in the summary.
check() {
  local name=$1; shift
  "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  summary+=("$name: exit $rc | $(grep -v '^\s*$' "$WORK/$name.log" | grep -v -i 'warn\|it/s\]' | tail -1 | cut -c1-220)")
  return $rc
}
IDS=128000,791,4062,14198,39935,35308,927,279,16053,5679,13,220,1627,489,220,845,284

set --
source "$ROOT/bench/install_peer_wheels.sh" > "$WORK/peer_install.log" 2>&1 || true

if has_part bnb; then
  stamp bnb
  REF="$WORK/bnbref"
  check bnb_make python3 "$ROOT/tools/bnb_reference.py" make --config "$ROOT/configs/models/llama-3.1-8b.json" \
    --layers 2 --out "$REF"
  check quantize_nf4 "$MEMTUNE" quantize --model "$REF/dense" --out "$WORK/mt-nf4-dq" --bnb_4bit_compute_dtype bf16
  check quantize_fp4 "$MEMTUNE" quantize --model "$REF/dense" --out "$WORK/mt-fp4" --bnb_4bit_quant_type fp4 \
    --bnb_4bit_use_double_quant false --bnb_4bit_compute_dtype bf16
  check codes_nf4 python3 "$ROOT/tools/bnb_reference.py" compare "$REF/bnb-nf4-dq" "$WORK/mt-nf4-dq" --dense "$REF/dense"
  check codes_fp4 python3 "$ROOT/tools/bnb_reference.py" compare "$REF/bnb-fp4" "$WORK/mt-fp4" --dense "$REF/dense"
  grep -v -i "kernels-community\|warn" "$WORK/codes_nf4.log" | head -12
  grep -v -i "kernels-community\|warn" "$WORK/codes_fp4.log" | head -30
  [ "${BNB_CODES_ONLY:-0}" = 1 ] || for variant in bnb-nf4-dq bnb-fp4; do
    check "hf_logits_$variant" python3 "$ROOT/tools/bnb_reference.py" logits "$REF/$variant" --input-ids "$IDS" \
      --out "$WORK/hf-$variant.safetensors"
    check "mt_logits_$variant" "$MEMTUNE" logits --device cuda --dtype bf16 --model "$REF/$variant" \
      --input-ids "$IDS" --out "$WORK/mt-$variant.safetensors"
    check "logits_$variant" python3 "$ROOT/tools/bnb_reference.py" compare-logits \
      "$WORK/mt-$variant.safetensors" "$WORK/hf-$variant.safetensors"
  done
  # QLoRA on bitsandbytes' checkpoint, then its adapter through PEFT on that checkpoint.
  [ "${BNB_CODES_ONLY:-0}" = 1 ] || {
  check train_on_bnb "$MEMTUNE" train --device cuda --model "$REF/bnb-nf4-dq" --tokenizer "$TOKENIZER" \
    --data "$ROOT/examples/sft-tasks.jsonl" --load_in_4bit --bf16 --gradient_checkpointing \
    --attn_implementation flash --loss_implementation chunked --batch 2 --seq 512 --max_steps 10 \
    --learning_rate 1e-3 --quiet --out "$WORK/train-bnb"
  check peft_logits python3 "$ROOT/tools/bnb_reference.py" logits "$REF/bnb-nf4-dq" --adapter "$WORK/train-bnb/adapter" \
    --input-ids "$IDS" --out "$WORK/peft.safetensors"
  check mt_adapter_logits "$MEMTUNE" logits --device cuda --dtype bf16 --model "$REF/bnb-nf4-dq" \
    --adapter "$WORK/train-bnb/adapter" --input-ids "$IDS" --out "$WORK/mt-adapter.safetensors"
  check logits_adapter python3 "$ROOT/tools/bnb_reference.py" compare-logits \
    "$WORK/mt-adapter.safetensors" "$WORK/peft.safetensors"
  # The adapter must have moved the logits, or the comparison above proves little.
  check adapter_changed python3 "$ROOT/tools/bnb_reference.py" compare-logits --max-rel 1e9 \
    "$WORK/mt-adapter.safetensors" "$WORK/mt-bnb-nf4-dq.safetensors"
  }
  rm -rf "$REF/dense"  # 3 GB; the 4-bit folders stay for the logs' sizes
fi

if has_part flow8b; then
  stamp flow8b
  F="$WORK/flow8b"
  mkdir -p "$F"
  # The device's memory in use as nvidia-smi shows it (CUDA context included), sampled every
  # 100 ms while the training runs: its maximum is the run's device peak.
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$F/nvidia_smi_mib.log" 2>&1 &
  SAMPLER=$!
  check train_8b "$MEMTUNE" train --device cuda --model llama-3.1-8b --tokenizer "$TOKENIZER" \
    --data "$ROOT/examples/sft-tasks.jsonl" --eval_split 0.1 --eval_steps 10 \
    --load_in_4bit --bf16 --gradient_checkpointing --attn_implementation flash --loss_implementation chunked \
    --packing --batch 2 --accum 2 --seq 2048 --max_steps ${FLOW_STEPS:-30} --learning_rate 1e-3 --vram 24GiB \
    --metrics "$F/metrics.jsonl" --out "$F/out"
  kill $SAMPLER 2>/dev/null
  summary+=("train_8b device peak (nvidia-smi memory.used, max of $(wc -l < "$F/nvidia_smi_mib.log") samples): $(sort -n "$F/nvidia_smi_mib.log" | tail -1) MiB; idle before: $(head -1 "$F/nvidia_smi_mib.log") MiB")
  grep -E "eval|step +[0-9]+ |peak|adapter|plan" "$WORK/train_8b.log" | tail -25
  check generate_8b "$MEMTUNE" generate --device cuda --model llama-3.1-8b --load_in_4bit --adapter "$F/out/adapter" \
    --tokenizer "$TOKENIZER" --chat --prompt "Compute the sum of 480 and 35." --max_new_tokens 64 --json
  check generate_8b_timed bash -c "time '$MEMTUNE' generate --device cuda --model llama-3.1-8b --load_in_4bit \
    --adapter '$F/out/adapter' --tokenizer '$TOKENIZER' --prompt 'The capital of France is' --max_new_tokens 256 \
    --temperature 0.7 --top_p 0.9 --seed 1"
  ls -la "$F/out/adapter" > "$WORK/adapter_listing.log" 2>&1; cat "$F/out/adapter/adapter_config.json" >> "$WORK/adapter_listing.log"
  rm -rf "$F"/out/checkpoint-*
fi

if has_part chunks; then
  stamp chunks
  # The token-chunk sizes of the full memory stack (QLoRA, checkpointing, flash, bf16, chunked
  # loss) at Llama-3.1-8B b2 x 2048, accumulation 2, on synthetic tokens: tokens/s (steps 2..N)
  # and the device peak (nvidia-smi, context included) of each.
  C="$WORK/chunks"; mkdir -p "$C"
  for variant in ${CHUNK_VARIANTS:-"1024 256" "0 256" "2048 512" "1024 256 --offload_embeddings"}; do
    set -- $variant
    name="mlp$1-loss$2${3:+-host-embeddings}"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$C/$name.smi" 2>&1 &
    SAMPLER=$!
    "$MEMTUNE" train --device cuda --model llama-3.1-8b --load_in_4bit --bf16 --gradient_checkpointing \
      --attn_implementation flash --loss_implementation chunked --batch 2 --accum 2 --seq 2048 \
      --mlp_chunk_tokens "$1" --loss_chunk_tokens "$2" ${3:-} --max_steps ${CHUNK_STEPS:-6} --quiet \
      --metrics "$C/$name.jsonl" --out "$C/$name-out" > "$C/$name.log" 2>&1
    rc=$?
    kill $SAMPLER 2>/dev/null; wait $SAMPLER 2>/dev/null
    rm -rf "$C/$name-out"
    summary+=("chunks $name: exit $rc | $(python3 -c "
import json,sys
rows=[json.loads(l) for l in open('$C/$name.jsonl')]
rows=[r for r in rows if 'tokens_per_second' in r]
tps=[r['tokens_per_second'] for r in rows[1:]] or [0]
print(f'tokens/s {sum(tps)/len(tps):.0f} (steps 2..{len(rows)}), plan {rows[-1][\"planned_peak_bytes\"]/2**20:.0f} MiB' if rows else 'no metrics')
" 2>&1) | device peak $(sort -n "$C/$name.smi" | tail -1) MiB")
  done
fi

stamp done
for line in "${summary[@]}"; do echo "$line"; done
tar -czf "$OUT/qlora-flow.tar.gz" --exclude='*.safetensors' -C "$WORK" . && ls -la "$OUT"
