#!/usr/bin/env bash
# Retrains only the student of a finished `cdcca pretrain` output, once per variant, on the
# CPU: the encoder and teacher are copied from FAMILY_DIR, so a variant costs only the student
# stage (about 5 minutes on 2 cores for `small`). Usage:
#   scripts/student_variants.sh CONFIG FAMILY_DIR OUT_DIR SPEC...
# SPEC = NAME[:KEY=VALUE,...], overrides of CONFIG as in gpu_schedules.sh (student.*,
# pretrain.seed, pretrain.student.*); the encoder and teacher fields must stay those FAMILY_DIR
# was trained with. Variants run one after another; the last lines give each one's student
# source-test DA. $CDCCA names the binary (default build/sim/cdcca).
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=$1 family=$2 out=$3
shift 3
cdcca=${CDCCA:-build/sim/cdcca}
mkdir -p "$out"
for spec in "$@"; do
  IFS=: read -r name overrides <<<"$spec"
  IFS=, read -r -a pairs <<<"${overrides:-}"
  dir=$out/$name
  rm -rf "$dir"
  mkdir -p "$dir/stages"
  cp -r "$family/stages/vision.safetensors" "$family/stages/teacher" "$dir/stages/"
  python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); r.pop("student", None)
json.dump(r, open(sys.argv[2], "w"), indent=1)' "$family/pretrain_record.json" "$dir/pretrain_record.json"
  scripts/override_config.py "$cfg" "$out/$name.json" ${pairs[@]+"${pairs[@]}"}
  "$cdcca" pretrain --config "$out/$name.json" --out "$dir" --cpu >"$out/$name.log" 2>&1
done
for spec in "$@"; do
  name=${spec%%:*}
  python3 -c 'import json, sys
s = json.load(open(sys.argv[1]))["student"]
print("{:<40} student {} ({}) {:.0f} s".format(sys.argv[2], s["source_test_da"],
      s["source_test_by_type"], s["seconds"]))' \
    "$out/$name/pretrain_record.json" "$spec"
done
