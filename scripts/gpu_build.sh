#!/usr/bin/env bash
# Builds the core (CDCCA_CORE_ONLY) `cdcca` into build-gpu/ on the GPU machine, against
# PyTorch's bundled LibTorch and .gpu-deps/ from scripts/gpu_deps.sh (carried). Sourced by
# gpu_pretrain.sh and gpu_schedules.sh; leaves LD_LIBRARY_PATH and CDCCA_FASHION_MNIST_DIR
# set for running it. CDCCA_GPU_TARGETS names other targets (scripts/hf_bench_gpu.sh: decode_bench).
set -euo pipefail
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
targets=${CDCCA_GPU_TARGETS:-cdcca}
# shellcheck disable=SC2086  # a list of targets
cmake --build build-gpu -j"$(nproc)" --target $targets 2>&1 | grep -E "error|Error|Linking" || true
case " $targets " in *" cdcca "*) test -x build-gpu/sim/cdcca ;; esac
export LD_LIBRARY_PATH=$deps/lib/$arch:${LD_LIBRARY_PATH:-}
export CDCCA_FASHION_MNIST_DIR=$deps/fashion-mnist
