// Batched products of many small matrices, as attention computes them.
//
// An attention layer multiplies one small matrix pair per (sequence, head): queries by keys,
// weights by values. Training the project's towers on the CPU gives batches of ~800 pairs of
// 14 x 32 by 32 x 22. Debian's LibTorch 1.13 (no MKL) runs such a torch::bmm as one BLAS call
// per pair, each preceded by three tensor selections, so the product spends most of its time
// outside arithmetic. BatchedMatmul computes the same product with one kernel over the batch,
// forward and backward; elsewhere (other devices, dtypes or shapes) it is torch::matmul.
#ifndef CDCCA_MODEL_RUNTIME_BATCHED_MATMUL_H_
#define CDCCA_MODEL_RUNTIME_BATCHED_MATMUL_H_

#include <torch/types.h>

namespace cdcca::model {

// torch::matmul(a, b) for a [..., M, K] and b [..., K, P] with the same leading dimensions,
// differentiable in both. Equal to torch::matmul up to float rounding.
torch::Tensor BatchedMatmul(const torch::Tensor& a, const torch::Tensor& b);

// Whether BatchedMatmul(a, b) takes its own kernel (CPU, float32, >= 3 dims, equal leading
// dimensions, small matrices); exposed for tests.
bool UsesSmallMatrixKernel(const torch::Tensor& a, const torch::Tensor& b);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_RUNTIME_BATCHED_MATMUL_H_
