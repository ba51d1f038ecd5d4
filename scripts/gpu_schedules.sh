#!/usr/bin/env bash
# Pretrains several schedules of one family config side by side on the GPU machine (one
# process each) and prints each one's source-test accuracy: how to choose a schedule that
# fits a CPU budget without spending that budget once per candidate. Usage:
#   scripts/gpu_schedules.sh CONFIG OUT_DIR SECONDS SPEC...
# SPEC = NAME:VISION_STEPS/TEACHER_STEPS/STUDENT_STEPS[:KEY=VALUE,...], where KEY is a
# dotted path into the config, e.g.
#   t3200:1000/3200/3500 qa2:1000/3400/3500:student.qa_layers=2,pretrain.seed=2
# Each variant's config is CONFIG with those fields replaced (OUT_DIR/NAME.json);
# re-running resumes unfinished variants. The variants share the machine's cores (--torch_threads
# nproc / variants each). CDCCA_SHARED_VISION=1 trains the vision stage once (the first
# variant's config, all cores) and copies it into every variant that has none yet: only for
# variants whose vision fields and pretrain.seed are the same.
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=$1 out=$2 budget=$3
shift 3
source scripts/gpu_build.sh
mkdir -p "$out"
threads=$(($(nproc) / $#))
[ "$threads" -ge 1 ] || threads=1
for spec in "$@"; do
  IFS=: read -r name steps overrides <<<"$spec"
  IFS=/ read -r vs ts ss <<<"$steps"
  IFS=, read -r -a pairs <<<"${overrides:-}"
  scripts/override_config.py "$cfg" "$out/$name.json" pretrain.vision.steps="$vs" \
    pretrain.teacher.steps="$ts" pretrain.student.steps="$ss" ${pairs[@]+"${pairs[@]}"}
done
if [ "${CDCCA_SHARED_VISION:-0}" = 1 ]; then
  first=${1%%:*}
  IFS=: read -r _ steps _ <<<"$1"
  vision_dir=$out/shared-vision
  if [ ! -f "$vision_dir/stages/vision.safetensors" ]; then
    # Stops after the vision stage (a resumable stop: exit status 1).
    timeout "$budget" build-gpu/sim/cdcca pretrain --config "$out/$first.json" --out "$vision_dir" \
      --stop_after "${steps%%/*}" --torch_threads "$(nproc)" >"$out/shared-vision.log" 2>&1 || true
  fi
  test -f "$vision_dir/stages/vision.safetensors" || { tail -5 "$out/shared-vision.log"; exit 1; }
  for spec in "$@"; do
    name=${spec%%:*}
    [ -f "$out/$name/pretrain_record.json" ] && continue
    mkdir -p "$out/$name/stages"
    cp "$vision_dir/stages/vision.safetensors" "$out/$name/stages/"
    python3 -c 'import json, sys
json.dump({"vision": json.load(open(sys.argv[1]))["vision"]}, open(sys.argv[2], "w"))' \
      "$vision_dir/pretrain_record.json" "$out/$name/pretrain_record.json"
  done
fi
pids=()
for spec in "$@"; do
  name=${spec%%:*}
  timeout "$budget" build-gpu/sim/cdcca pretrain --config "$out/$name.json" --out "$out/$name" \
    --torch_threads "$threads" >"$out/$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || true; done
printf '%-12s %-18s %s\n' variant "teacher / student" "source-test DA (s)"
for spec in "$@"; do
  name=${spec%%:*}
  rec=$out/$name/pretrain_record.json
  if [ -f "$rec" ]; then
    python3 - "$rec" "$name" "$spec" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
t, s = r.get("teacher", {}), r.get("student", {})
print(f"{sys.argv[2]:<12} {sys.argv[3]:<40} teacher {t.get('source_test_da', '-')} "
      f"({t.get('source_test_by_type', '')}) student {s.get('source_test_da', '-')} "
      f"({s.get('source_test_by_type', '')})")
PY
  else
    echo "$name: unfinished (see $out/$name.log)"
  fi
done
