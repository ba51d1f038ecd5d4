// Weight quantization of the frozen base for device precision (int8 per output channel,
// int4 in groups packed two a byte). Dequantize() is the single definition of the
// effective fp32 weight: the device's matmul path and the cloud mirror both call it, so
// they compute with bit-identical weights.
//
// All functions are pure (no state); thread-safe.
#ifndef CDCCA_MODEL_RUNTIME_QUANTIZE_H_
#define CDCCA_MODEL_RUNTIME_QUANTIZE_H_

#include <torch/types.h>

#include <cstdint>

#include "model/family/config.h"

namespace cdcca::model {

struct QuantizedWeight {
  // int8: kChar [out, in]. int4: kByte [out, ceil(in / group) * group / 2]; column 2k in the
  // low nibble and 2k+1 in the high nibble, each stored as q + 8 with q in [-8, 7]; columns
  // past `in` (padding of the last group) are zero.
  torch::Tensor values;
  // fp32. int8: [out]. int4: [out, ceil(in / group)].
  torch::Tensor scales;
};

// Symmetric quantization of an fp32 [out, in] weight. Scale = max|w| / 127 (int8) or / 7
// (int4, per group); an all-zero row or group gets scale 0. `group` only matters for int4.
QuantizedWeight QuantizeWeight(const torch::Tensor& weight, Precision precision, int64_t group);

// fp32 [out, in] weight the quantized one stands for.
torch::Tensor DequantizeWeight(const QuantizedWeight& q, Precision precision, int64_t in_features,
                               int64_t group);

// Storage of a quantized weight, in bytes (values + scales).
int64_t QuantizedBytes(const QuantizedWeight& q);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_RUNTIME_QUANTIZE_H_
