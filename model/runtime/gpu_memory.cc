#include "model/runtime/gpu_memory.h"

#if CDCCA_HAVE_CUDA_GRAPHS
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace cdcca::model {

GpuMemoryPeak PeakGpuMemory(c10::Device device) {
  GpuMemoryPeak peak;
#if CDCCA_HAVE_CUDA_GRAPHS
  if (device.is_cuda()) {
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
    peak.allocated_bytes = stats.allocated_bytes[0].peak;
    peak.reserved_bytes = stats.reserved_bytes[0].peak;
    peak.allocated_now_bytes = stats.allocated_bytes[0].current;
  }
#else
  (void)device;
#endif
  return peak;
}

}  // namespace cdcca::model
