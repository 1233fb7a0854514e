# Sourced by scripts/fuzz.sh and scripts/fuzz-long.sh: the seed corpus of each fuzz target, made
# from files memtune reads in real use (one kind of input a target). Run from the repository root.
#   corpus_for TARGET CORPUS_ROOT   copies the target's seeds into CORPUS_ROOT/<kind>, prints that folder
FUZZ_TARGETS_ALL="fuzz_safetensors fuzz_model_config fuzz_adapter_config fuzz_tokenizer fuzz_dataset fuzz_run_config"
fuzz_seeds() {
  local dir="$1/$2"; shift 2
  mkdir -p "$dir"
  for f in "$@"; do [ -f "$f" ] && cp "$f" "$dir/$(echo "$f" | tr '/' '_')"; done
  echo "$dir"
}
corpus_for() {
  case "$1" in
    fuzz_safetensors) fuzz_seeds "$2" safetensors tests/fixtures/golden/*/adapter/adapter_model.safetensors tests/fixtures/safetensors/* ;;
    fuzz_model_config) fuzz_seeds "$2" model_config configs/models/*.json tests/fixtures/golden/*/config*.json tests/fixtures/families/*.json ;;
    fuzz_adapter_config) fuzz_seeds "$2" adapter_config tests/fixtures/golden/*/adapter/adapter_config.json ;;
    fuzz_tokenizer) fuzz_seeds "$2" tokenizer tests/fixtures/tokenizer/tiny_tokenizer.json ;;
    fuzz_dataset) fuzz_seeds "$2" dataset tests/fixtures/tokenizer/tiny_corpus.jsonl tests/fixtures/tokenizer/chat.jsonl ;;
    fuzz_run_config) fuzz_seeds "$2" run_config configs/runs/*.yaml examples/*.yaml ;;
  esac
}
