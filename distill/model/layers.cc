#include "distill/model/layers.h"

#include <cmath>

namespace cdcca::model {

AdaptedLinearImpl::AdaptedLinearImpl(const AdaptedLinearOptions& options) : options_(options) {
  const int64_t in = options.in_features;
  const int64_t out = options.out_features;
  TORCH_CHECK(in > 0 && out > 0, "AdaptedLinear needs positive sizes");
  // Same init as torch::nn::Linear (kaiming-uniform with a = sqrt(5)): bound 1/sqrt(in).
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  torch::Tensor w = torch::empty({out, in}).uniform_(-bound, bound);
  if (options.precision == Precision::kFp32) {
    weight_ = register_parameter("weight", w, /*requires_grad=*/true);
  } else {
    QuantizedWeight q = QuantizeWeight(w, options.precision, options.int4_group);
    qweight_ = register_buffer("qweight", q.values);
    qscale_ = register_buffer("qscale", q.scales);
  }
  if (options.bias) bias_ = register_parameter("bias", torch::zeros({out}));
  if (options.lora_rank > 0) {
    const double a_bound = 1.0 / std::sqrt(static_cast<double>(in));
    lora_a_ = register_parameter("lora_a",
                                 torch::empty({options.lora_rank, in}).uniform_(-a_bound, a_bound));
    lora_b_ = register_parameter("lora_b", torch::zeros({out, options.lora_rank}));
  }
}

torch::Tensor AdaptedLinearImpl::BaseWeight() const {
  if (options_.precision == Precision::kFp32) return weight_;
  if (cache_dequantized_) {
    const void* data = qweight_.data_ptr();
    // In-place loads bump the version counter; moving the module changes the storage.
    if (cache_.defined() && cache_version_ == qweight_._version() + qscale_._version() &&
        cache_data_ == data && cache_.device() == qweight_.device()) {
      return cache_;
    }
    cache_ = DequantizeWeight({qweight_, qscale_}, options_.precision, options_.in_features,
                              options_.int4_group);
    cache_version_ = qweight_._version() + qscale_._version();
    cache_data_ = data;
    return cache_;
  }
  return DequantizeWeight({qweight_, qscale_}, options_.precision, options_.in_features,
                          options_.int4_group);
}

void AdaptedLinearImpl::SetBaseWeight(const torch::Tensor& weight) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == options_.out_features &&
                  weight.size(1) == options_.in_features,
              "SetBaseWeight: shape mismatch");
  if (options_.precision == Precision::kFp32) {
    weight_.copy_(weight);
    return;
  }
  QuantizedWeight q = QuantizeWeight(weight, options_.precision, options_.int4_group);
  qweight_.copy_(q.values);
  qscale_.copy_(q.scales);
  cache_ = torch::Tensor();
}

int64_t AdaptedLinearImpl::BaseBytes() const {
  if (options_.precision == Precision::kFp32) return weight_.numel() * 4;
  return QuantizedBytes({qweight_, qscale_});
}

int64_t AdaptedLinearImpl::CacheBytes() const {
  return cache_.defined() ? cache_.numel() * cache_.element_size() : 0;
}

torch::Tensor AdaptedLinearImpl::forward(const torch::Tensor& x) {
  torch::Tensor y = torch::nn::functional::linear(x, BaseWeight(), bias_);
  if (options_.lora_rank > 0) {
    const double scale = options_.lora_alpha / options_.lora_rank;
    y = y + torch::matmul(torch::matmul(x, lora_a_.t()), lora_b_.t()) * scale;
  }
  return y;
}

RmsNormImpl::RmsNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight_ = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RmsNormImpl::forward(const torch::Tensor& x) {
  torch::Tensor rms = torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return x * rms * weight_;
}

Rotary::Rotary(int64_t head_dim, int64_t max_positions, float theta) {
  const int64_t half = head_dim / 2;
  torch::Tensor inv = torch::pow(static_cast<double>(theta),
                                 -torch::arange(0, half, torch::kDouble) * 2.0 / head_dim);
  torch::Tensor pos = torch::arange(0, max_positions, torch::kDouble);
  torch::Tensor ang = torch::outer(pos, inv);
  cos_ = ang.cos().to(torch::kFloat);
  sin_ = ang.sin().to(torch::kFloat);
}

torch::Tensor Rotary::Apply(const torch::Tensor& x, const torch::Tensor& positions) const {
  // Rotate pairs (x[2i], x[2i+1]) by angle pos * inv[i].
  const int64_t half = x.size(-1) / 2;
  if (cos_.device() != x.device()) {
    cos_ = cos_.to(x.device());
    sin_ = sin_.to(x.device());
  }
  torch::Tensor cos = cos_.index_select(0, positions.reshape(-1))
                          .view({positions.size(0), 1, positions.size(1), half});
  torch::Tensor sin = sin_.index_select(0, positions.reshape(-1))
                          .view({positions.size(0), 1, positions.size(1), half});
  torch::Tensor xp = x.view({x.size(0), x.size(1), x.size(2), half, 2});
  torch::Tensor x0 = xp.select(-1, 0);
  torch::Tensor x1 = xp.select(-1, 1);
  torch::Tensor r0 = x0 * cos - x1 * sin;
  torch::Tensor r1 = x0 * sin + x1 * cos;
  return torch::stack({r0, r1}, -1).view(x.sizes());
}

torch::Tensor AttentionProbs(const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& allowed) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (!allowed.defined()) return torch::softmax(scores, -1);
  // A large finite negative rather than -inf: a row with no allowed key then stays finite
  // (no NaN in forward or backward) and is zeroed by the where(), which also makes every
  // disallowed weight exactly zero whatever its key held.
  scores = scores.masked_fill(allowed.logical_not(), -1e9);
  torch::Tensor probs = torch::softmax(scores, -1);
  return torch::where(allowed, probs, torch::zeros({}, probs.options()));
}

torch::Tensor MaskedAttention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& allowed,
                              double dropout_p, torch::Tensor* probs_out) {
  torch::Tensor probs = AttentionProbs(q, k, allowed);
  if (probs_out != nullptr) *probs_out = probs;
  if (dropout_p > 0.0) probs = torch::dropout(probs, dropout_p, /*train=*/true);
  return torch::matmul(probs, v);
}

}  // namespace cdcca::model
