#!/usr/bin/env bash
# `cdcca adapt-eval` on a family read as a Hugging Face pair (the path a downloaded checkpoint
# takes), one run per (shift, seed), then a summary of the reports. By default the
# `--teacher_all_arms` matrix on five image shifts at seeds 3, 5 and 7 and the tables of
# docs/RESULTS.md "A teacher that sees what it labels" (scripts/teacher_all_summary.py).
# Usage:
#   scripts/teacher_all_matrix.sh OUT_DIR [FAMILY_DIR]      (FAMILY_DIR: models/small)
# Environment: CDCCA_BIN (build/sim/cdcca), CDCCA_JOBS (runs at a time, 2: about 4 minutes a
# `small` run on 2 cores), CDCCA_ADAPT_FLAGS (more adapt-eval flags, e.g. --device cuda
# or --lora_projector), CDCCA_MATRIX_ARMS (the arm and learner flags; default the teacher-all
# matrix's), CDCCA_MATRIX_SHIFTS ("snow:4 contrast:5 fog:4 rain:4 motion_blur:5"),
# CDCCA_MATRIX_SEEDS ("3 5 7"), CDCCA_MATRIX_SUMMARY (scripts/teacher_all_summary.py).
# scripts/feature_term_matrix.sh sets them for the feature-term matrix.
# A run whose report exists is skipped, so a stopped matrix resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}
family=${2:-models/small}
bin=${CDCCA_BIN:-build/sim/cdcca}
jobs=${CDCCA_JOBS:-2}
arms=${CDCCA_MATRIX_ARMS:---token_scores vis --teacher_all_arms --learners pl,akd+l_kl=0.5}
shifts=${CDCCA_MATRIX_SHIFTS:-snow:4 contrast:5 fog:4 rain:4 motion_blur:5}
seeds=${CDCCA_MATRIX_SEEDS:-3 5 7}
summary=${CDCCA_MATRIX_SUMMARY:-scripts/teacher_all_summary.py}
mkdir -p "$out"
run() {  # name shift severity seed
  [ -f "$out/$1.json" ] && return 0
  # shellcheck disable=SC2086  # lists of flags
  OMP_NUM_THREADS=1 "$bin" adapt-eval --teacher "$family/teacher" \
    --student_base "$family" --student_precision int8 --shift "$2" --severity "$3" --seed "$4" \
    --stream_scenes 1000 --test_scenes 400 $arms --distill_config configs/distill/akd.json \
    ${CDCCA_ADAPT_FLAGS:-} --out "$out/$1" >"$out/$1.log" 2>&1 ||
    echo "$1 failed: see $out/$1.log" >&2
}
i=0
for shift in $shifts; do
  for seed in $seeds; do
    run "${shift%:*}${shift#*:}_s$seed" "${shift%:*}" "${shift#*:}" "$seed" &
    i=$((i + 1))
    if [ $((i % jobs)) -eq 0 ]; then wait; fi
  done
done
wait
python3 "$summary" "$out"
