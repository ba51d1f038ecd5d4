#!/usr/bin/env bash
# Speed and memory at published shapes, one device call per mode, on the GPU machine (device tool):
#   gpu  builds cdcca's decode_bench (core-only, PyTorch's LibTorch, carried .gpu-deps/), creates
#        the random-weight folders at the published shapes (scripts/hf_bench_shapes.py) and
#        times transformers (eager, SDPA) and cdcca (bf16, CUDA) on the same weights and
#        inputs; writes $OUT/hf_bench_gpu.json and, for the 2-core machine, the 0.5B folder's
#        skeleton (scripts/hf_bench_clone.py).
#   cpu  builds, creates the 0.5B folder, times cdcca fp32 / int8 / int4 and transformers fp32
#        on the machine's CPU cores; writes $OUT/hf_bench_cpu.json.
#   all  both, in one call.
# Usage: scripts/hf_bench_gpu.sh gpu|cpu|all   (results under $OUT, else ./out)
set -euo pipefail
mode=${1:?gpu or cpu}
out=${OUT:-$PWD/out}
mkdir -p "$out"
work=${HF_BENCH_DIR:-/tmp/decode_bench}
qwen=llava-interleave-qwen-0.5b
export PYTHONUNBUFFERED=1

# Build; if the CUDA-graph code does not compile against this LibTorch, build without it.
export CDCCA_GPU_TARGETS=decode_bench
start=$(date +%s)
if ! (source scripts/gpu_build.sh) >"$out/build.log" 2>&1 || [ ! -x build-gpu/model/decode_bench ]; then
  echo "build with CUDA graphs failed; retrying without" | tee -a "$out/build.log"
  cmake build-gpu -DCDCCA_CUDA_GRAPHS=OFF -DCMAKE_CXX_FLAGS=-DCDCCA_NO_AT_RMS_NORM >>"$out/build.log" 2>&1
  (source scripts/gpu_build.sh) >>"$out/build.log" 2>&1
fi
tail -5 "$out/build.log"
echo "build: $(( $(date +%s) - start )) s"
[ -x build-gpu/model/decode_bench ] || { echo "decode_bench did not build"; exit 1; }
export LD_LIBRARY_PATH=$PWD/.gpu-deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
bench=build-gpu/model/decode_bench
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
lscpu | grep -E "Model name|^CPU\(s\)" || true

if [ "$mode" = gpu ] || [ "$mode" = all ]; then
  python3 scripts/hf_bench_shapes.py --out "$out/hf_bench_gpu.json" --save "$work" \
    --cdcca "$bench" --keep "$qwen"
  # The decode step without CUDA graph capture, for the record (0.5B: launch-bound).
  CDCCA_NO_CUDA_GRAPH=1 "$bench" --model "$work/$qwen" --paths static >"$out/cdcca_qwen_no_graph.json"
  if [ "$mode" = gpu ]; then
    python3 scripts/hf_bench_clone.py skeleton "$work/$qwen" "$out/qwen05b_skeleton"
    tar -C "$out" -cf "$out/qwen05b_skeleton.tar" qwen05b_skeleton && rm -r "$out/qwen05b_skeleton"
  fi
fi
if [ "$mode" = cpu ] || [ "$mode" = all ]; then
  [ -d "$work/$qwen" ] || python3 scripts/hf_bench_shapes.py --out /dev/null --save "$work" \
    --models "$qwen" --keep "$qwen" --save_only
  cpu=$work/cpu-results
  mkdir -p "$cpu"
  for p in fp32 int8 int4; do
    "$bench" --model "$work/$qwen" --device cpu --precision "$p" --paths reference \
      --repeats 2 >"$cpu/cdcca_$p.json"
    cut -c1-600 "$cpu/cdcca_$p.json"
  done
  python3 scripts/hf_bench_shapes.py --cpu --load "$work/$qwen" --repeats 2 \
    --out "$cpu/transformers.json"
  python3 - "$cpu" "$out/hf_bench_cpu.json" <<'PY'
import json, sys, os
cpu, dst = sys.argv[1], sys.argv[2]
r = json.load(open(os.path.join(cpu, "transformers.json")))
read = lambda f: json.loads(open(os.path.join(cpu, f)).read().strip().splitlines()[-1])
r["cdcca"] = {p: read(f"cdcca_{p}.json") for p in ["fp32", "int8", "int4"]}
json.dump(r, open(dst, "w"), indent=1)
PY
fi
