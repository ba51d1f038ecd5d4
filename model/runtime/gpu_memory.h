// Peak memory of LibTorch's CUDA caching allocator, for the benchmarks that report it
// (decode_bench, akd_bench). Zero on CPU and where LibTorch is not a CUDA build.
#ifndef CDCCA_MODEL_RUNTIME_GPU_MEMORY_H_
#define CDCCA_MODEL_RUNTIME_GPU_MEMORY_H_

#include <c10/core/Device.h>

#include <cstdint>

namespace cdcca::model {

struct GpuMemoryPeak {
  int64_t allocated_bytes = 0;      // the most held by live tensors at once
  int64_t reserved_bytes = 0;       // the most the allocator held from the driver at once
  int64_t allocated_now_bytes = 0;  // held by live tensors at the call
};

// Since the process started (or the allocator's last peak reset), on `device`; a CUDA device
// without an index means device 0.
GpuMemoryPeak PeakGpuMemory(c10::Device device);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_RUNTIME_GPU_MEMORY_H_
