#!/usr/bin/env bash
# The uplink per streamed frame of one method in a cdcca-sim run, as a share of a raw 1080p
# RGB frame and of the frame the model actually takes in (results.json's raw_frame_bytes:
# the student's RGB input, 64x64x3 = 12,288 B for the `small` family). The same figures as
# report.md's Transmission columns "vs 1080p frames" and "vs model-input frames".
#   scripts/uplink_share.sh runs/quickstart [cd-cca]
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 RUN_DIR [METHOD (default cd-cca)]" >&2
  exit 2
fi
dir="$1"
method="${2:-cd-cca}"
for f in results.csv results.json; do
  [ -f "$dir/$f" ] || { echo "$0: no $dir/$f (a cdcca-sim --out folder)" >&2; exit 1; }
done
# Every method runs the same model, so the first raw_frame_bytes is the input size.
raw="$(grep -m1 -o '"raw_frame_bytes": *[0-9]*' "$dir/results.json" | grep -o '[0-9]*$')"
[ -n "$raw" ] && [ "$raw" -gt 0 ] || { echo "$0: no raw_frame_bytes in $dir/results.json" >&2; exit 1; }
# results.csv: method,device,round,...,frames (8),...,uplink_payload_bytes (11); round 0
# is the evaluation before any stream.
awk -F, -v m="$method" -v raw="$raw" '
  NR > 1 && $1 == m && $3 != 0 { up += $11; frames += $8 }
  END {
    if (frames == 0) { print "no streamed frames for method " m > "/dev/stderr"; exit 1 }
    per = up / frames
    printf "%s: %.0f B uplinked per streamed frame = %.4f %% of a raw 1080p RGB frame (6,220,800 B), %.2f %% of the model input frame (%d B)\n", m, per, 100 * per / (1920 * 1080 * 3), 100 * per / raw, raw
  }' "$dir/results.csv"
