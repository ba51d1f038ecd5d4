// Milliseconds per call of a function on a CUDA device, for the GPU check programs.
#ifndef CDCCA_MODEL_BENCH_CUDA_MILLIS_H_
#define CDCCA_MODEL_BENCH_CUDA_MILLIS_H_

#include <torch/cuda.h>

#include <chrono>

namespace cdcca::model {

// Milliseconds per call of `fn` over `repeats` calls, after `warmups` calls, the device
// synchronized before the clock starts and before it stops.
template <typename Fn>
double CudaMillis(Fn fn, int repeats, int warmups = 3) {
  for (int i = 0; i < warmups; ++i) fn();
  torch::cuda::synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) fn();
  torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
             .count() /
         repeats;
}

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_BENCH_CUDA_MILLIS_H_
