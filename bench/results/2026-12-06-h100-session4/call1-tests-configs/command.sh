# Call 1: GPU tests + sanitizer at 765c5a9, configs incl. --merge_micro_batches; fuzz_dataset niced on the spare cores.
export WORK=/tmp/mt-wA TOKENIZER=/tmp/peer-tokenizer/tokenizer.json; mkdir -p $WORK /tmp/peer-tokenizer; gunzip -c .devbin/tokenizer.json.gz > $TOKENIZER; export LD_LIBRARY_PATH=$PWD/.devbin
for f in .devbin/fuzz/*.gz; do gunzip -f $f; done; chmod +x .devbin/fuzz/fuzz_*
FUZZ_TARGETS=fuzz_dataset FUZZ_JOBS=14 FUZZ_TIMEOUT=530 nice -n 19 bash scripts/fuzz-long.sh .devbin/fuzz $WORK/fz-d > $WORK/fuzz-dataset.log 2>&1 & P1=$!
TEST_TIMEOUT=300 CONFIGS=data-unpacked,data-merged,qlora CONFIG_STEPS=6 CONFIG_TIMEOUT=60 timeout 535 bash scripts/device-check.sh .devbin tests,sanitizer,configs 2>&1 | tee $OUT/summary.log | tail -c 6000
wait $P1; cat $WORK/fuzz-dataset.log | tee -a $OUT/summary.log; rm -rf $WORK/fz-*/corpus-*; tar -czf $OUT/results.tar.gz -C $WORK .
