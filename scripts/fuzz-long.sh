#!/usr/bin/env bash
# Long fuzz runs (issue 26's >= 10M executions a target): every target in FUZZ_JOBS processes at
# once, each with its own seed and its own copy of the seed corpus (scripts/fuzz-seeds.sh), for
# FUZZ_RUNS executions in all a target (split across its processes) or FUZZ_TIMEOUT seconds,
# whichever comes first. Prints one line a target (processes, executions summed from libFuzzer's
# final stats, seconds, peak RSS, crashes) and exits non-zero when any process found a crash
# (its input under OUT_DIR/crashes/, the log beside it).
#   scripts/fuzz-long.sh FUZZ_BIN_DIR OUT_DIR
#     FUZZ_BIN_DIR  the fuzz binaries (build-fuzz/ of scripts/fuzz.sh, or a copy)
#   FUZZ_RUNS (10000000), FUZZ_JOBS (processes a target; default: the cores / the targets, >= 1),
#   FUZZ_TIMEOUT (3600 s a process), FUZZ_TARGETS (all five)
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/fuzz-seeds.sh
BIN=$(cd "$1" && pwd)
OUT_DIR=$2
TARGETS=${FUZZ_TARGETS:-$FUZZ_TARGETS_ALL}
RUNS=${FUZZ_RUNS:-10000000}
TIMEOUT=${FUZZ_TIMEOUT:-3600}
n_targets=$(echo $TARGETS | wc -w)
JOBS=${FUZZ_JOBS:-$(( $(nproc) / n_targets > 0 ? $(nproc) / n_targets : 1 ))}
mkdir -p "$OUT_DIR/crashes"
start=$(date +%s)
index=0
for target in $TARGETS; do
  index=$((index + 1))
  for j in $(seq 1 "$JOBS"); do
    corpus=$(corpus_for "$target" "$OUT_DIR/corpus-$j")
    "$BIN/$target" -runs=$(( (RUNS + JOBS - 1) / JOBS )) -max_total_time="$TIMEOUT" -seed=$((index * 1000 + j)) \
      -max_len=8192 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$OUT_DIR/crashes/$target-$j-" \
      "$corpus" > "$OUT_DIR/$target.$j.log" 2>&1 &
  done
done
status=0
wait || true
seconds=$(( $(date +%s) - start ))
printf '%-22s %9s %14s %8s %12s %s\n' target processes executions seconds "peak RSS MB" outcome
for target in $TARGETS; do
  total=0 rss=0 crashed=0
  for j in $(seq 1 "$JOBS"); do
    log="$OUT_DIR/$target.$j.log"
    units=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$')
    peak=$(grep -o 'stat::peak_rss_mb: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$')
    total=$((total + ${units:-0}))
    [ "${peak:-0}" -gt "$rss" ] && rss=${peak:-0}
    if grep -qE "ERROR: libFuzzer|ERROR: AddressSanitizer|runtime error|SUMMARY: " "$log"; then crashed=$((crashed + 1)); fi
  done
  outcome=clean
  if [ "$crashed" -gt 0 ]; then outcome="FAILED in $crashed process(es): see $OUT_DIR/$target.*.log"; status=1; fi
  printf '%-22s %9s %14s %8s %12s %s\n' "$target" "$JOBS" "$total" "$seconds" "$rss" "$outcome"
done
exit $status
