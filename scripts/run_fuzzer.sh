#!/bin/sh
# ctest driver for one libFuzzer target (see cmake/CdccaFuzz.cmake): a fresh seed corpus,
# then a bounded run. libFuzzer exits non-zero on any crash, leak, timeout, sanitizer
# report, or single allocation above MALLOC_LIMIT_MB, which fails the test; the reproducer
# stays in WORK_DIR (crash-*, leak-*, oom-*, timeout-*).
#   run_fuzzer.sh FUZZER WORK_DIR SECONDS MAX_LEN MALLOC_LIMIT_MB [--gen GENERATOR]...
#                 [--seed FILE]...
# CDCCA_FUZZ_SECONDS overrides SECONDS, for a longer run of this script by hand.
set -eu
fuzzer="$1"; work="$2"; seconds="${CDCCA_FUZZ_SECONDS:-$3}"; max_len="$4"; malloc_mb="$5"
shift 5
rm -rf "$work"
mkdir -p "$work/seeds" "$work/corpus"
while [ $# -gt 0 ]; do
  case "$1" in
    --gen) "$2" "$work/seeds"; shift 2 ;;
    # Numbered: seed files from different folders may share a name (config.json).
    --seed) seeds=$((${seeds:-0} + 1)); cp "$2" "$work/seeds/${seeds}_$(basename "$2")"; shift 2 ;;
    *) echo "run_fuzzer.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
exec "$fuzzer" -max_total_time="$seconds" -max_len="$max_len" -timeout=10 -artifact_prefix="$work/" \
  -rss_limit_mb=2048 -malloc_limit_mb="$malloc_mb" -print_final_stats=1 \
  "$work/corpus" "$work/seeds"
