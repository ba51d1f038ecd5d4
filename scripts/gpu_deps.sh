#!/usr/bin/env bash
# Fills .gpu-deps/ (git-ignored) with what the GPU machine lacks to build the core
# (CDCCA_CORE_ONLY=ON) and run `cdcca pretrain`: Abseil, zstd, zlib and nlohmann_json
# headers, libraries and CMake package files, laid out like /usr so the package files'
# relative paths hold, plus the Fashion-MNIST files. On the GPU machine:
#   cmake -S . -B build-gpu -DCDCCA_CORE_ONLY=ON -DCDCCA_BUILD_TESTS=OFF \
#     -DCDCCA_BUILD_BENCHMARKS=OFF -DCDCCA_DEPS_PREFIX=$PWD/.gpu-deps \
#     -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')"
#   export LD_LIBRARY_PATH=$PWD/.gpu-deps/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH
#   export CDCCA_FASHION_MNIST_DIR=$PWD/.gpu-deps/fashion-mnist
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dst="$root/.gpu-deps"
arch=x86_64-linux-gnu
rm -rf "$dst"
mkdir -p "$dst/include" "$dst/lib/$arch/cmake" "$dst/share/cmake"
cp -r /usr/include/absl /usr/include/nlohmann "$dst/include/"
cp /usr/include/zstd*.h /usr/include/zlib.h /usr/include/zconf.h "$dst/include/"
# Shared and static: absl's package file imports the .so files, the top level links zstd
# statically when CDCCA_DEPS_PREFIX is set.
cp -P /usr/lib/$arch/libabsl_*.so* /usr/lib/$arch/libabsl_*.a "$dst/lib/$arch/"
cp -P /usr/lib/$arch/libzstd.* /usr/lib/$arch/libz.* "$dst/lib/$arch/"
cp -r /usr/lib/$arch/cmake/absl /usr/lib/$arch/cmake/zstd "$dst/lib/$arch/cmake/"
cp -r /usr/share/cmake/nlohmann_json "$dst/share/cmake/"
# Package files that name /usr explicitly would escape the prefix: point them here.
grep -rl '"/usr/' "$dst/lib/$arch/cmake" "$dst/share/cmake" 2>/dev/null |
  xargs -r sed -i "s#\"/usr/lib/$arch/cmake/#\"$dst/lib/$arch/cmake/#g"
mkdir -p "$dst/fashion-mnist"
cp /usr/share/datasets/fashion-mnist/*.gz "$dst/fashion-mnist/"
du -sh "$dst"
