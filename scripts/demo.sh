#!/usr/bin/env bash
# The main job: on a fresh Debian 12 machine, installs what is missing, builds the harness,
# makes sure the `small` models exist (the committed checkpoints in models/small, or
# `cdcca pretrain` when they are missing), and runs the quickstart experiment: one device,
# fog then fog + text shift, 3 rounds, CD-CCA against the un-adapted student and TENT.
# Prints the accuracy table and where the report (markdown, JSON, CSV, HTML plots) is.
#
#   scripts/demo.sh           the full quickstart (configs/experiments/quickstart.json)
#   scripts/demo.sh --tiny    the same, shrunk: 64 frames and 48 evaluation scenes per round,
#                             20 training steps per job
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tiny=()
for arg in "$@"; do
  case "$arg" in
    --tiny) tiny=(--tiny) ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "demo.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
start=$(date +%s)
"$root/scripts/setup.sh"
CDCCA_TARGETS="cdcca cdcca-sim" "$root/scripts/build.sh"
build="${CDCCA_BUILD_DIR:-$root/build}"
cd "$root"

models="$root/models/small"
if [ ! -f "$models/model.safetensors" ] || [ ! -f "$models/teacher/model.safetensors" ] ||
   [ ! -f "$models/config.json" ]; then
  echo "== pretraining the small models into $models (once; resumable)"
  "$build/sim/cdcca" pretrain --config "$root/configs/models/small.json" --out "$models"
fi

name=quickstart
[ ${#tiny[@]} -gt 0 ] && name=quickstart-tiny
echo "== running configs/experiments/quickstart.json ${tiny[*]}"
"$build/sim/cdcca-sim" --experiment "$root/configs/experiments/quickstart.json" \
  --out "$root/runs/$name" "${tiny[@]}"
echo "== demo finished in $(( $(date +%s) - start )) s"
