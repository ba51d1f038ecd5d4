#include "model/runtime/quantize.h"

#include <torch/torch.h>

namespace cdcca::model {

QuantizedWeight QuantizeWeight(const torch::Tensor& weight, Precision precision, int64_t group) {
  torch::NoGradGuard no_grad;
  const torch::Tensor w = weight.detach().to(torch::kCPU, torch::kFloat).contiguous();
  TORCH_CHECK(w.dim() == 2, "QuantizeWeight expects a 2-D weight");
  const int64_t out = w.size(0);
  const int64_t in = w.size(1);
  QuantizedWeight q;
  if (precision == Precision::kInt8) {
    torch::Tensor scale = w.abs().amax(1) / 127.0f;  // [out]
    torch::Tensor safe = torch::where(scale > 0, scale, torch::ones_like(scale));
    q.values = torch::round(w / safe.unsqueeze(1)).clamp(-127, 127).to(torch::kChar);
    q.scales = scale;
    return q;
  }
  TORCH_CHECK(precision == Precision::kInt4, "QuantizeWeight: fp32 is not a quantized precision");
  const int64_t groups = (in + group - 1) / group;
  const int64_t padded = groups * group;
  torch::Tensor wp = torch::zeros({out, padded}, torch::kFloat);
  wp.narrow(1, 0, in).copy_(w);
  torch::Tensor wg = wp.view({out, groups, group});
  torch::Tensor scale = wg.abs().amax(2) / 7.0f;  // [out, groups]
  torch::Tensor safe = torch::where(scale > 0, scale, torch::ones_like(scale));
  torch::Tensor qv = torch::round(wg / safe.unsqueeze(2)).clamp(-8, 7).to(torch::kInt) + 8;
  qv = qv.view({out, padded / 2, 2});
  torch::Tensor packed = qv.select(2, 0) + qv.select(2, 1) * 16;  // low nibble = even column
  q.values = packed.to(torch::kByte).contiguous();
  q.scales = scale.contiguous();
  return q;
}

torch::Tensor DequantizeWeight(const QuantizedWeight& q, Precision precision, int64_t in_features,
                               int64_t group) {
  torch::NoGradGuard no_grad;
  if (precision == Precision::kInt8) {
    return q.values.to(torch::kFloat) * q.scales.unsqueeze(1);
  }
  TORCH_CHECK(precision == Precision::kInt4, "DequantizeWeight: fp32 is not quantized");
  const int64_t out = q.values.size(0);
  const int64_t groups = q.scales.size(1);
  // Nibbles stay one byte each until the one conversion to fp32, which is then shifted and
  // scaled in place: (q - 8) is exact in fp32, so each weight is the one rounding of
  // (q - 8) * scale, as the definition says, in a third of the memory traffic of int32
  // nibbles (training on CUDA dequantizes every product twice a step).
  torch::Tensor lo = q.values.bitwise_and(15);
  torch::Tensor hi = torch::bitwise_right_shift(q.values, 4);
  torch::Tensor w = torch::stack({lo, hi}, 2)
                        .view({out, groups, group})
                        .to(torch::kFloat)
                        .sub_(8)
                        .mul_(q.scales.unsqueeze(2))
                        .view({out, groups * group});
  return w.narrow(1, 0, in_features).contiguous();
}

int64_t QuantizedBytes(const QuantizedWeight& q) {
  return q.values.numel() * q.values.element_size() + q.scales.numel() * q.scales.element_size();
}

}  // namespace cdcca::model
