// What the callers of cdcca's CUDA kernels (cuda_kernels.h) share: a tensor's kernel element
// type, the current stream of its device, and a failed launch as a LibTorch error. Included only
// where CDCCA_HAVE_CUDA_KERNELS is defined (a CUDA LibTorch; the translation unit needs its CUDA
// headers).
#ifndef CDCCA_MODEL_RUNTIME_CUDA_DISPATCH_H_
#define CDCCA_MODEL_RUNTIME_CUDA_DISPATCH_H_

#include <c10/cuda/CUDAStream.h>
#include <torch/types.h>

#include "model/runtime/cuda_kernels.h"

namespace cdcca::model::cuda_kernels {

// The kernels' type for a float, half or bf16 tensor (float for anything else: callers check).
inline Dtype KernelDtype(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kHalf:
      return Dtype::kHalf;
    case torch::kBFloat16:
      return Dtype::kBFloat16;
    default:
      return Dtype::kFloat;
  }
}

inline void* StreamOf(const torch::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

inline void CheckKernel(int code, const char* what) {
  TORCH_CHECK(code == 0, what, "'s CUDA kernel failed: ", ErrorString(code));
}

}  // namespace cdcca::model::cuda_kernels

#endif  // CDCCA_MODEL_RUNTIME_CUDA_DISPATCH_H_
