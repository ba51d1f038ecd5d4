// CPU matrix products with int8 (per output channel) and int4 (groups, two a byte) weights as
// quantize.h holds them, computed from the packed bytes: no dequantized copy of the weight
// is kept. Activations stay fp32 (weight-only quantization), so the result equals
// x · DequantizeWeight(q)^T up to the order of the float sums.
//
// Few rows (decode): one pass over the packed weight, rows of W spread over LibTorch's
// intra-op threads, AVX2+FMA where the processor has it (checked at run time), portable C++
// elsewhere. Many rows (prefill): W is dequantized a block of output channels at a time into
// a scratch buffer and multiplied with LibTorch's GEMM.
//
// Pure functions; thread-safe.
#ifndef CDCCA_MODEL_RUNTIME_QMATMUL_H_
#define CDCCA_MODEL_RUNTIME_QMATMUL_H_

#include <torch/types.h>

#include <cstdint>

#include "model/family/config.h"
#include "model/runtime/quantize.h"

namespace cdcca::model {

// x [..., in] fp32 CPU; q as QuantizeWeight(W [out, in], precision, group) made it; bias
// [out] fp32 or undefined. Returns [..., out] fp32.
torch::Tensor QuantizedLinear(const torch::Tensor& x, const QuantizedWeight& q, Precision precision,
                              int64_t in_features, int64_t group, const torch::Tensor& bias);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_RUNTIME_QMATMUL_H_
