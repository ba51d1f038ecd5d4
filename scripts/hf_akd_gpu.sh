#!/usr/bin/env bash
# Real sizes on the GPU: one AKD job of cdcca (distill/bench/akd_bench.cc) against the
# transformers + peft loop of the same losses (scripts/hf_akd_reference.py), same GPU, same
# inputs, one after the other in this run. On the GPU machine (device tool), with .gpu-deps/
# from scripts/gpu_deps.sh carried:
#   scripts/hf_akd_gpu.sh build        builds akd_bench, round_bench, decode_bench,
#                                      fused_attention_check, fp8_product_check and
#                                      elementwise_check (core-only, PyTorch's LibTorch)
#   scripts/hf_akd_gpu.sh tiny  DIR    the whole comparison on a tiny random pair (seconds)
#   scripts/hf_akd_gpu.sh full  DIR    LLaVA-1.5-13B-shaped bf16 teacher, 7B-shaped student
#                                      (cdcca: int4 mirror; reference: bf16), LoRA q/v r8,
#                                      batch 16, 200 steps, 64 uplinked samples
#   scripts/hf_akd_gpu.sh round DIR    one whole round in process at the same shapes
#                                      (sim/bench/round_bench.cc): an int4 device answers 32
#                                      frames, UTS, int8 uplink, the job (batch 8, 40 steps),
#                                      DWC at 2 bits/param, apply on both sides, digests
#   scripts/hf_akd_gpu.sh round-tiny DIR  the same on the tiny random pair (seconds)
# DIR receives the folders, inputs.safetensors, cdcca.json, reference.json (one JSON line
# each, peak memory per process from nvidia-smi added as "peak_process_gpu_bytes") and logs.
set -euo pipefail
mode=${1:?build, tiny or full}
export PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/.gpu-deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
bench=build-gpu/distill/akd_bench
decode_bench=build-gpu/model/decode_bench
round_bench=build-gpu/sim/round_bench

if [ "$mode" = build ]; then
  start=$(date +%s)
  export CDCCA_GPU_TARGETS="akd_bench round_bench decode_bench fused_attention_check fp8_product_check elementwise_check"
  (source scripts/gpu_build.sh) >build-gpu-akd.log 2>&1 || true
  grep -E "error|Error" build-gpu-akd.log | head -20 || true
  echo "build: $(($(date +%s) - start)) s"
  test -x "$bench" && test -x "$round_bench"
  exit 0
fi

dir=${2:?DIR}
mkdir -p "$dir"
if [ "$mode" = tiny ] || [ "$mode" = round-tiny ]; then
  shapes=(--teacher tiny-teacher --student tiny-student --samples 8 --prompt_tokens 12)
  job=(--max_steps 20 --batch_size 4 --max_answer_tokens 8 --lora_rank 8 --lora_alpha 16)
  round=(--frames 8 --max_steps 20 --batch_size 4 --teacher_max_answer_tokens 8
    --max_answer_tokens 8 --bits_per_param 8)
else
  shapes=(--teacher llava-1.5-13b --student llava-1.5-7b --samples 64 --prompt_tokens 40)
  job=(--max_steps "${CDCCA_AKD_STEPS:-200}" --batch_size "${CDCCA_AKD_BATCH:-16}" --max_answer_tokens 32 --lora_rank 8 --lora_alpha 16)
  round=(--frames 32 --max_steps 40 --batch_size 8 --teacher_max_answer_tokens 32
    --max_answer_tokens 16)
fi
[ -f "$dir/inputs.safetensors" ] || python3 scripts/hf_akd_reference.py make --out "$dir" "${shapes[@]}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# Runs "$@" while nvidia-smi samples the GPU's used memory every 100 ms; appends the peak (the
# process alone: the GPU is idle before) to the program's JSON line in $out.
measure() {
  local out=$1
  shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$out.mem" &
  local smi=$!
  local rc=0
  "$@" >"$out.stdout" 2>"$out.log" || rc=$?
  kill $smi || true
  tail -5 "$out.log"
  python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
lines = [l for l in open(out + ".stdout").read().splitlines() if l.startswith("{")]
mem = [int(x) for x in open(out + ".mem").read().split() if x.strip().isdigit()]
row = json.loads(lines[-1]) if lines else {"error": "no result"}
row["peak_process_gpu_bytes"] = max(mem, default=0) * 1024 * 1024
json.dump(row, open(out, "w"), indent=1)
print(json.dumps(row))
PY
  return $rc
}

if [ "$mode" = round ] || [ "$mode" = round-tiny ]; then
  measure "$dir/round.json" "$round_bench" --teacher "$dir/teacher" --student_base "$dir/student" \
    --inputs "$dir/inputs.safetensors" --teacher_precision bf16 --student_precision int4 \
    --uts_keep_fraction 0.5 --uts_token_ratio 0.5 --uplink_precision int8 "${round[@]}"
  exit $?
fi

# The student's weight pack (model/hub/weight_pack.h: its int4 weights stored once, as `cdcca
# pack` writes it), so that the job's load reads them packed instead of quantizing 7B floats.
# CDCCA_AKD_SIDE=cdcca or reference runs one side only (two device calls where one call's time
# limit is shorter than both together; the folders and inputs in DIR are reused).
# CDCCA_AKD_STEPS=N trains N steps instead of full's 200, CDCCA_AKD_BATCH=B batches B instead
# of 16 (where the GPU holds less than the H200). CDCCA_AKD_JOBS=K runs cdcca's side as a
# fleet's round: K devices' jobs over the one student, at most CDCCA_AKD_TOGETHER (default 4)
# together (akd_bench --jobs, --max_jobs_together; cdcca.json then holds device_jobs_per_hour),
# and the reference's side as a competent peft user runs them: the pair loaded once, the jobs
# one after another, each from the pretrained adapters with its own optimizer.
# CDCCA_AKD_FP8=off runs cdcca's side with its frozen base's products in bf16 (akd_bench
# --fp8_base=off; native, the default, multiplies in FP8 on a GPU that runs it, an H100 or H200).
# CDCCA_AKD_PHASE_STEPS=N (default 10) times the last N steps of each side phase by phase
# ("phases_ms_per_step"; both sides synchronize the same way). CDCCA_AKD_PREPARE_BATCH=P
# (default 0: twice the batch size) is how many samples both teachers label in one batch while a
# job prepares (1: one at a time, as both did before).
# CDCCA_AKD_TRACE=1 traces both sides' jobs (akd_bench --trace, hf_akd_reference.py --trace) into
# DIR/{cdcca,reference}.trace.json and splits the last 5 steps' kernel time by kind
# (scripts/trace_split.py: DIR/{cdcca,reference}_split.json). Tracing slows the job: its other
# figures are not the job's.
side=${CDCCA_AKD_SIDE:-both}
cdcca_only=()
reference_only=()
[ -n "${CDCCA_AKD_FP8:-}" ] && cdcca_only+=(--fp8_base="$CDCCA_AKD_FP8")
if [ "${CDCCA_AKD_TRACE:-0}" = 1 ]; then
  cdcca_only+=(--trace "$dir/cdcca.trace.json")
  reference_only+=(--trace "$dir/reference.trace.json")
fi
# Splits DIR/$1.trace.json where one was written.
split_trace() {
  [ -f "$dir/$1.trace.json" ] || return 0
  python3 scripts/trace_split.py "$dir/$1.trace.json" --json "$dir/$1_split.json" || true
}
job+=(--phase_steps "${CDCCA_AKD_PHASE_STEPS:-10}" --prepare_batch "${CDCCA_AKD_PREPARE_BATCH:-0}")
if [ "$side" != reference ]; then
  if [ -x "$decode_bench" ] && [ ! -d "$dir/student/cdcca-packed" ]; then
    "$decode_bench" --model "$dir/student" --precision int4 --device cuda --weight_pack write \
      --load_only | tee "$dir/pack.json"
  fi
  measure "$dir/cdcca.json" "$bench" --teacher "$dir/teacher" --student_base "$dir/student" \
    --inputs "$dir/inputs.safetensors" --teacher_precision bf16 --student_precision int4 \
    "${job[@]}" "${cdcca_only[@]}" --jobs "${CDCCA_AKD_JOBS:-1}" \
    --max_jobs_together "${CDCCA_AKD_TOGETHER:-4}" ||
    true
  split_trace cdcca
fi
if [ "$side" != cdcca ]; then
  measure "$dir/reference.json" python3 scripts/hf_akd_reference.py run --teacher "$dir/teacher" \
    --student_base "$dir/student" --inputs "$dir/inputs.safetensors" "${job[@]}" \
    --jobs "${CDCCA_AKD_JOBS:-1}" "${reference_only[@]}" || true
  split_trace reference
fi
