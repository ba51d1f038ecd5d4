#!/usr/bin/env bash
# `cdcca adapt-eval --teacher_all_arms` on a family read as a Hugging Face pair (the path a
# downloaded checkpoint takes), on five image shifts at seeds 3, 5 and 7, then the tables of
# docs/RESULTS.md "A teacher that sees what it labels" (scripts/teacher_all_summary.py).
# Usage:
#   scripts/teacher_all_matrix.sh OUT_DIR [FAMILY_DIR]      (FAMILY_DIR: models/small)
# Environment: CDCCA_BIN (build/sim/cdcca), CDCCA_JOBS (runs at a time, 2: about 4 minutes a
# `small` run on 2 cores), CDCCA_ADAPT_FLAGS (more adapt-eval flags, e.g. --cpu).
# A run whose report exists is skipped, so a stopped matrix resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}
family=${2:-models/small}
bin=${CDCCA_BIN:-build/sim/cdcca}
jobs=${CDCCA_JOBS:-2}
mkdir -p "$out"
run() {  # name shift severity seed
  [ -f "$out/$1.json" ] && return 0
  # shellcheck disable=SC2086  # a list of flags
  OMP_NUM_THREADS=1 "$bin" adapt-eval --teacher "$family/teacher" \
    --student_base "$family" --precision int8 --shift "$2" --severity "$3" --seed "$4" \
    --stream_scenes 1000 --test_scenes 400 --token_scores vis --teacher_all_arms \
    --learners pl,akd+l_kl=0.5 --distill_config configs/distill/akd.json \
    ${CDCCA_ADAPT_FLAGS:-} --out "$out/$1" >"$out/$1.log" 2>&1 ||
    echo "$1 failed: see $out/$1.log" >&2
}
i=0
for shift in snow:4 contrast:5 fog:4 rain:4 motion_blur:5; do
  for seed in 3 5 7; do
    run "${shift%:*}${shift#*:}_s$seed" "${shift%:*}" "${shift#*:}" "$seed" &
    i=$((i + 1))
    if [ $((i % jobs)) -eq 0 ]; then wait; fi
  done
done
wait
python3 scripts/teacher_all_summary.py "$out"
