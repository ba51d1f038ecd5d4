#!/usr/bin/env bash
# Builds the core (CDCCA_CORE_ONLY) on the GPU machine and runs `cdcca adapt-eval` there,
# once per argument set; the same command as on a workstation, only the device differs.
# Needs .gpu-deps/ from scripts/gpu_deps.sh (carried). Usage:
#   distill/adapt_gpu.sh OUT_DIR "FLAGS OF RUN 1" "FLAGS OF RUN 2" ...
# Run i writes OUT_DIR/run<i>.md, .json and .log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}
shift
mkdir -p "$out"
deps=$PWD/.gpu-deps
arch=x86_64-linux-gnu
tp=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
if [ ! -f build-gpu/CMakeCache.txt ]; then
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCDCCA_CORE_ONLY=ON \
    -DCDCCA_BUILD_TESTS=OFF -DCDCCA_BUILD_BENCHMARKS=OFF -DCDCCA_DEPS_PREFIX="$deps" \
    -DCMAKE_PREFIX_PATH="$deps;$tp" -Dabsl_DIR="$deps/lib/$arch/cmake/absl" \
    -Dzstd_DIR="$deps/lib/$arch/cmake/zstd" -Dnlohmann_json_DIR="$deps/share/cmake/nlohmann_json" \
    -DZLIB_INCLUDE_DIR="$deps/include" -DZLIB_LIBRARY="$deps/lib/$arch/libz.a" >"$out/build.log" 2>&1 ||
    { tail -40 "$out/build.log"; exit 1; }
fi
cmake --build build-gpu -j"$(nproc)" --target cdcca >>"$out/build.log" 2>&1 ||
  { grep -E "error" "$out/build.log" | head -30; exit 1; }
export LD_LIBRARY_PATH=$deps/lib/$arch:${LD_LIBRARY_PATH:-}
export CDCCA_FASHION_MNIST_DIR=$deps/fashion-mnist
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true
i=0
for flags in "$@"; do
  i=$((i + 1))
  echo "== run$i: cdcca adapt-eval $flags"
  # shellcheck disable=SC2086
  build-gpu/sim/cdcca adapt-eval $flags --out "$out/run$i" 2>&1 | tee "$out/run$i.log" | grep -v "^\[adapt-eval\] all\|^\[adapt-eval\] uts\|^\[adapt-eval\] random" || true
done
