#!/usr/bin/env bash
# Builds the core (CDCCA_CORE_ONLY) on the GPU machine and runs `cdcca pretrain` there; the
# same command as on a workstation, only the device differs. Needs .gpu-deps/ from
# scripts/gpu_deps.sh (carried). Usage:
#   scripts/gpu_pretrain.sh CONFIG OUT_DIR SECONDS [model-eval scenes]
# Re-running resumes the pretraining where the last run stopped (same OUT_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=${1:-configs/models/small.json}
out=${2:-runs/small}
budget=${3:-540}
eval_scenes=${4:-0}
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true
status=0
timeout "$budget" build-gpu/sim/cdcca pretrain --config "$cfg" --out "$out" || status=$?
if [ "$status" -eq 0 ] && [ "$eval_scenes" -gt 0 ]; then
  build-gpu/sim/cdcca model-eval --checkpoint_dir "$out" --scenes "$eval_scenes" --table "$out/accuracy.md"
fi
exit "$status"
