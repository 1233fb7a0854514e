# Call B: issue 25's ladder on LADDER_MODEL beside bench/peer_hf.py (transformers + PEFT + bnb); fuzz_dataset
# (issue 26's 10M) niced to 19 on the host's cores beside it (the GPU runs keep their normal priority).
export WORK=/tmp/mt-w-$LADDER_MODEL TOKENIZER=/tmp/peer-tokenizer/tokenizer.json; mkdir -p $WORK /tmp/peer-tokenizer; gunzip -c .devbin/tokenizer.json.gz > $TOKENIZER; export LD_LIBRARY_PATH=$PWD/.devbin
if [ -n "${WITH_FUZZ:-}" ]; then
  gunzip -f .devbin/fuzz/fuzz_dataset.gz; chmod +x .devbin/fuzz/fuzz_*
  FUZZ_TARGETS=fuzz_dataset FUZZ_JOBS=14 FUZZ_TIMEOUT=${FUZZ_TIMEOUT:-575} nice -n 19 bash scripts/fuzz-long.sh .devbin/fuzz $WORK/fz-d > $WORK/fuzz-dataset.log 2>&1 & P1=$!
fi
LADDER_TIMEOUT=240 PEER_TIMEOUT=330 timeout 578 bash scripts/device-check.sh .devbin ladder,peer 2>&1 | tee $OUT/summary.log | tail -c 7000
if [ -n "${WITH_FUZZ:-}" ]; then wait $P1; cat $WORK/fuzz-dataset.log | tee -a $OUT/summary.log; rm -rf $WORK/fz-*/corpus-*; fi
tar -czf $OUT/results.tar.gz -C $WORK . 2>/dev/null
