#!/usr/bin/env bash
# Builds the core (CDCCA_CORE_ONLY) on the GPU machine and runs `cdcca pretrain` there; the
# same command as on a workstation, only the device differs. Needs .gpu-deps/ from
# scripts/gpu_deps.sh (carried). Usage:
#   distill/model/gpu_pretrain.sh CONFIG OUT_DIR SECONDS [model-eval scenes]
# Re-running resumes the pretraining where the last run stopped (same OUT_DIR).
set -euo pipefail
cd "$(dirname "$0")/../.."
cfg=${1:-configs/models/small.json}
out=${2:-runs/small}
budget=${3:-540}
eval_scenes=${4:-0}
deps=$PWD/.gpu-deps
arch=x86_64-linux-gnu
tp=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
if [ ! -f build-gpu/CMakeCache.txt ]; then
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCDCCA_CORE_ONLY=ON \
    -DCDCCA_BUILD_TESTS=OFF -DCDCCA_BUILD_BENCHMARKS=OFF -DCDCCA_DEPS_PREFIX="$deps" \
    -DCMAKE_PREFIX_PATH="$deps;$tp" -Dabsl_DIR="$deps/lib/$arch/cmake/absl" \
    -Dzstd_DIR="$deps/lib/$arch/cmake/zstd" -Dnlohmann_json_DIR="$deps/share/cmake/nlohmann_json" \
    -DZLIB_INCLUDE_DIR="$deps/include" -DZLIB_LIBRARY="$deps/lib/$arch/libz.a" >build-gpu.log 2>&1 ||
    { tail -40 build-gpu.log; exit 1; }
fi
cmake --build build-gpu -j"$(nproc)" --target cdcca 2>&1 | grep -E "error|Error|Linking" || true
test -x build-gpu/sim/cdcca
export LD_LIBRARY_PATH=$deps/lib/$arch:${LD_LIBRARY_PATH:-}
export CDCCA_FASHION_MNIST_DIR=$deps/fashion-mnist
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true
status=0
timeout "$budget" build-gpu/sim/cdcca pretrain --config "$cfg" --out "$out" || status=$?
if [ "$status" -eq 0 ] && [ "$eval_scenes" -gt 0 ]; then
  build-gpu/sim/cdcca model-eval --checkpoint "$out" --scenes "$eval_scenes" --table "$out/accuracy.md"
fi
exit "$status"
