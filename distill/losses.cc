#include "distill/losses.h"

#include <torch/torch.h>

namespace cdcca::distill {
namespace {

// mask as float of x's leading shape ([...]), all ones if undefined.
torch::Tensor MaskOf(const torch::Tensor& x, const torch::Tensor& mask) {
  if (!mask.defined()) {
    auto sizes = x.sizes().vec();
    sizes.pop_back();
    return torch::ones(sizes, x.options().dtype(torch::kFloat));
  }
  return mask.to(x.device(), torch::kFloat);
}

// Sum of per-position values divided by the number of positions, 0 when there are none.
torch::Tensor MaskedMean(const torch::Tensor& per_position, const torch::Tensor& weight) {
  return (per_position * weight).sum() / weight.sum().clamp_min(1.0);
}

}  // namespace

torch::Tensor LayerNormFeatures(const torch::Tensor& x) {
  return torch::layer_norm(x, {x.size(-1)}, /*weight=*/{}, /*bias=*/{}, 1e-5);
}

torch::Tensor FeatureMse(const torch::Tensor& teacher, const torch::Tensor& student,
                         const torch::Tensor& mask, bool normalize) {
  TORCH_CHECK(teacher.sizes() == student.sizes(), "FeatureMse: shapes differ");
  torch::Tensor t = normalize ? LayerNormFeatures(teacher) : teacher;
  torch::Tensor s = normalize ? LayerNormFeatures(student) : student;
  return MaskedMean((t - s).pow(2).mean(-1), MaskOf(student, mask));
}

torch::Tensor TokenCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  torch::Tensor valid = targets >= 0;
  torch::Tensor safe = targets.clamp_min(0);
  torch::Tensor logp = torch::log_softmax(logits, -1);
  torch::Tensor nll = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1);
  return MaskedMean(nll, valid.to(torch::kFloat));
}

torch::Tensor SoftCrossEntropy(const torch::Tensor& logits, const torch::Tensor& target_probs,
                               const torch::Tensor& mask) {
  torch::Tensor ce = -(target_probs * torch::log_softmax(logits, -1)).sum(-1);
  return MaskedMean(ce, MaskOf(ce.unsqueeze(-1), mask));
}

namespace {

// KL(teacher || student) per position at `temperature` (not yet scaled by its square).
torch::Tensor PositionKl(const torch::Tensor& teacher_logits, const torch::Tensor& student_logits,
                         double temperature) {
  TORCH_CHECK(temperature > 0, "TemperatureKl: temperature must be positive");
  torch::Tensor lt = torch::log_softmax(teacher_logits / temperature, -1);
  torch::Tensor ls = torch::log_softmax(student_logits / temperature, -1);
  return (lt.exp() * (lt - ls)).sum(-1);
}

}  // namespace

torch::Tensor TemperatureKl(const torch::Tensor& teacher_logits,
                            const torch::Tensor& student_logits, const torch::Tensor& mask,
                            double temperature) {
  torch::Tensor kl = PositionKl(teacher_logits, student_logits, temperature);
  return temperature * temperature * MaskedMean(kl, MaskOf(kl.unsqueeze(-1), mask));
}

torch::Tensor WeightedTokenCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                        const torch::Tensor& weights) {
  torch::Tensor logp = torch::log_softmax(logits, -1);
  torch::Tensor nll = -logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1);
  torch::Tensor w = weights.to(nll.dtype()) * (targets >= 0).to(nll.dtype());
  return (nll * w).sum() / w.sum().clamp_min(1e-12);
}

torch::Tensor WeightedTemperatureKl(const torch::Tensor& teacher_logits,
                                    const torch::Tensor& student_logits,
                                    const torch::Tensor& weights, double temperature) {
  torch::Tensor kl = PositionKl(teacher_logits, student_logits, temperature);
  torch::Tensor w = weights.to(kl.dtype());
  return temperature * temperature * (kl * w).sum() / w.sum().clamp_min(1e-12);
}

torch::Tensor MeanEntropy(const torch::Tensor& logits, const torch::Tensor& mask) {
  torch::Tensor logp = torch::log_softmax(logits, -1);
  torch::Tensor ent = -(logp.exp() * logp).sum(-1);
  return MaskedMean(ent, MaskOf(ent.unsqueeze(-1), mask));
}

torch::Tensor PearsonDistance(const torch::Tensor& teacher, const torch::Tensor& student,
                              const torch::Tensor& mask) {
  TORCH_CHECK(teacher.sizes() == student.sizes(), "PearsonDistance: shapes differ");
  const int64_t c = teacher.size(-1);
  torch::Tensor w = MaskOf(student, mask).reshape({-1, 1});  // [P, 1]
  torch::Tensor t = teacher.reshape({-1, c});
  torch::Tensor s = student.reshape({-1, c});
  torch::Tensor n = w.sum().clamp_min(1.0);
  torch::Tensor tc = t - (t * w).sum(0) / n;
  torch::Tensor sc = s - (s * w).sum(0) / n;
  torch::Tensor cov = (tc * sc * w).sum(0);
  torch::Tensor denom = ((tc.pow(2) * w).sum(0) * (sc.pow(2) * w).sum(0) + 1e-12).sqrt();
  return 1.0 - (cov / denom).mean();
}

torch::Tensor ChannelWiseDivergence(const torch::Tensor& teacher, const torch::Tensor& student,
                                    const torch::Tensor& mask, double tau) {
  TORCH_CHECK(teacher.sizes() == student.sizes() && teacher.dim() == 3,
              "ChannelWiseDivergence: features must be [B, T, C] of equal shape");
  TORCH_CHECK(tau > 0, "ChannelWiseDivergence: tau must be positive");
  torch::Tensor w = MaskOf(student, mask);        // [B, T]
  torch::Tensor absent = (w <= 0).unsqueeze(-1);  // [B, T, 1]
  // Absent positions get a huge negative logit so they take no probability mass on either
  // side; a finite value (not -inf) keeps the backward pass free of 0 * inf = NaN.
  const double neg = -1e9;
  torch::Tensor lt = torch::log_softmax((teacher / tau).masked_fill(absent, neg), 1);
  torch::Tensor ls = torch::log_softmax((student / tau).masked_fill(absent, neg), 1);
  // Rows with no position at all would otherwise contribute a uniform-vs-uniform term.
  torch::Tensor term = (lt.exp() * (lt - ls)).masked_fill(absent, 0.0);
  torch::Tensor per_row_channel = term.sum(1);                         // [B, C]
  torch::Tensor rows = (w.sum(1) > 0).to(torch::kFloat).unsqueeze(1);  // [B, 1]
  torch::Tensor total = (per_row_channel * rows).sum();
  return tau * tau * total / (rows.sum() * teacher.size(2)).clamp_min(1.0);
}

}  // namespace cdcca::distill
