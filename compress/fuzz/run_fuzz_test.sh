#!/bin/sh
# ctest driver for the decoder fuzzer: fresh seeds, then a bounded run. libFuzzer exits
# non-zero on any crash, leak, timeout or sanitizer report, which fails the test.
#   run_fuzz_test.sh FUZZER SEED_GENERATOR WORK_DIR RUNS MAX_SECONDS
set -eu
fuzzer="$1"; seeds="$2"; work="$3"; runs="$4"; max_time="$5"
rm -rf "$work"
mkdir -p "$work/seeds" "$work/corpus"
"$seeds" "$work/seeds"
exec "$fuzzer" -runs="$runs" -max_total_time="$max_time" -max_len=8192 -timeout=10 \
  -rss_limit_mb=2048 -print_final_stats=1 "$work/corpus" "$work/seeds"
