#!/usr/bin/env bash
# Makes the inputs of scripts/peft_check.py: for each tiny Hugging Face fixture family, one
# `cdcca adapt` round (teacher and student the same folder, the student's adapters trained
# on the fixture images), its PEFT export, and the adapted student's greedy answers
# (`cdcca generate --json --adapter_state`) on two images. Runs here (the full build); the
# check itself runs where transformers and peft are (the GPU machine):
#   scripts/peft_check.sh [OUT]              (default build/peft_check)
#   python3 scripts/peft_check.py OUT        (prints and writes OUT/report.json)
# CDCCA_ADAPT_FLAGS adds adapt flags for the trainable set, e.g. "--lora_projector" (LoRA on
# the projector into the LM too; with --lora_qformer the LLaVA fixtures are skipped).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/build/peft_check}"
cdcca="${CDCCA_BIN:-$root/build/sim/cdcca}"
fixtures="$root/tests/fixtures/hf"
rm -rf "$out"
mkdir -p "$out"
read -r -a adapt_flags <<<"${CDCCA_ADAPT_FLAGS:-}"
for fam in llava_clip_llama llava_siglip_qwen2 blip2_llama instructblip_llama; do
  if [[ "$fam" == llava* && " ${adapt_flags[*]} " == *" --lora_qformer "* ]]; then continue; fi
  case "$fam" in
    llava*) prompt=$'USER: <image>\nWhat is shown? ASSISTANT:' ;;
    *) prompt="Question: what color is the shirt? Answer:" ;;
  esac
  d="$out/$fam"
  mkdir -p "$d"
  "$cdcca" adapt --teacher "$fixtures/models/$fam" --student_base "$fixtures/models/$fam" \
    --student_precision fp32 --images "$fixtures/images" --prompt "$prompt" --max_steps 30 \
    --batch_size 4 --lr 1e-2 --max_answer_tokens 6 "${adapt_flags[@]}" --out "$d/state" \
    2>"$d/hf_adapt.log" >/dev/null
  "$cdcca" export-adapter --state "$d/state" --out "$d/peft" >/dev/null
  for img in gradient_97x61.png noise_123x77.png; do
    for arm in adapted base; do
      extra=()
      [ "$arm" = adapted ] && extra=(--adapter_state "$d/state")
      "$cdcca" generate --json --model "$fixtures/models/$fam" --image "$fixtures/images/$img" \
        --prompt "$prompt" --max_new_tokens 8 "${extra[@]}" >"$d/${arm}_${img%.png}.json"
    done
  done
  printf '%s\n' "$prompt" >"$d/prompt.txt"
  echo "$fam: $(tail -n 1 "$d/hf_adapt.log" | cut -c1-160)"
done
