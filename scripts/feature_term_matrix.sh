#!/usr/bin/env bash
# The feature term alone, offline: one job per learner from the same student on the same
# uplink (every frame with all its tokens, the teacher's labels from them), PL, PKD, CWD and
# AKD (CD-CCA's learner) with configs/distill/akd.json's CE, logit KL 0.5, steps and rate, so
# they differ only in the feature term; six image shifts at seeds 3, 5 and 7; then
# scripts/feature_term_summary.py. docs/RESULTS.md "The feature term alone".
# Usage: scripts/feature_term_matrix.sh OUT_DIR [FAMILY_DIR]   (environment as
# scripts/teacher_all_matrix.sh, e.g. CDCCA_ADAPT_FLAGS=--lora_projector, and
# CDCCA_FEATURE_OVERRIDES: appended to the three feature learners' specs, e.g.
# "+l_query=1+l_repr=1" for ten times akd.json's feature weights)
set -euo pipefail
cd "$(dirname "$0")/.."
f=${CDCCA_FEATURE_OVERRIDES:-}
export CDCCA_MATRIX_ARMS="--token_scores= --random_arm=false --learners pl+l_kl=0.5,pkd+l_kl=0.5$f,cwd+l_kl=0.5$f,akd+l_kl=0.5$f"
export CDCCA_MATRIX_SHIFTS=${CDCCA_MATRIX_SHIFTS:-fog:4 snow:4 contrast:5 rain:4 motion_blur:5 jpeg:5}
export CDCCA_MATRIX_SUMMARY=scripts/feature_term_summary.py
exec scripts/teacher_all_matrix.sh "$@"
