#!/usr/bin/env bash
# Builds the core (CDCCA_CORE_ONLY) on the GPU machine and runs `cdcca adapt-eval` there,
# once per argument set; the same command as on a workstation, only the device differs.
# Needs .gpu-deps/ from scripts/gpu_deps.sh (carried). Usage:
#   scripts/adapt_gpu.sh OUT_DIR "FLAGS OF RUN 1" "FLAGS OF RUN 2" ...
# Run i writes OUT_DIR/run<i>.md, .json and .log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}
shift
mkdir -p "$out"
source scripts/gpu_build.sh >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
set +e  # one failed run must not stop the others
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true
i=0
for flags in "$@"; do
  i=$((i + 1))
  echo "== run$i: cdcca adapt-eval $flags"
  # shellcheck disable=SC2086
  build-gpu/sim/cdcca adapt-eval $flags --out "$out/run$i" 2>&1 | tee "$out/run$i.log" | grep -v "^\[adapt-eval\] all\|^\[adapt-eval\] uts\|^\[adapt-eval\] random" || true
done
