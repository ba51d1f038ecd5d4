#include "distill/model/hf_linear.h"

#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "distill/model/qmatmul.h"

namespace cdcca::model {

torch::Tensor Placeholder(c10::IntArrayRef shape, torch::ScalarType dtype, torch::Device device) {
  return torch::zeros({1}, torch::dtype(dtype).device(device)).expand(shape);
}

HfLinearImpl::HfLinearImpl(const HfLinearOptions& options) : options_(options) {
  weight = register_parameter(
      "weight", Placeholder({options.out_features, options.in_features}, options.precision.dtype),
      /*requires_grad=*/false);
  if (options.bias) {
    bias = register_parameter("bias", Placeholder({options.out_features}, options.precision.dtype),
                              /*requires_grad=*/false);
  }
}

absl::Status HfLinearImpl::Adopt(const std::string& local_name, torch::Tensor tensor) {
  torch::NoGradGuard no_grad;
  if (local_name == "bias" && options_.bias) {
    bias.set_data(tensor.to(options_.precision.dtype));
    return absl::OkStatus();
  }
  if (local_name != "weight") {
    return absl::InvalidArgumentError(absl::StrCat("linear layer has no tensor ", local_name));
  }
  if (!quantized()) {
    weight.set_data(tensor.to(options_.precision.dtype));
    return absl::OkStatus();
  }
  const torch::Device device = tensor.device();
  QuantizedWeight q = QuantizeWeight(tensor.to(torch::kFloat), options_.precision.weights,
                                     options_.precision.int4_group);
  q_.values = q.values.to(device);
  q_.scales = q.scales.to(device);
  // The float weight is dropped: the placeholder stays registered for its shape only.
  weight.set_data(Placeholder(weight.sizes(), options_.precision.dtype, device));
  return absl::OkStatus();
}

template <typename Move>
void HfLinearImpl::MoveHeld(Move move) {
  if (!quantized() || !q_.values.defined()) {
    move();
    return;
  }
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> shape = weight.sizes().vec();
  // to() of an expanded tensor would allocate the full [out, in] weight on the target.
  weight.set_data(torch::zeros({1}, weight.options()));
  move();
  weight.set_data(weight.expand(shape));
  q_.values = q_.values.to(weight.device());
  q_.scales = q_.scales.to(weight.device());
}

void HfLinearImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  MoveHeld([&] { torch::nn::Module::to(device, dtype, non_blocking); });
}

void HfLinearImpl::to(torch::Dtype dtype, bool non_blocking) {
  MoveHeld([&] { torch::nn::Module::to(dtype, non_blocking); });
}

void HfLinearImpl::to(torch::Device device, bool non_blocking) {
  MoveHeld([&] { torch::nn::Module::to(device, non_blocking); });
}

torch::Tensor HfLinearImpl::EffectiveWeight() const {
  if (!quantized() || !q_.values.defined()) return weight;
  return DequantizeWeight(q_, options_.precision.weights, options_.in_features,
                          options_.precision.int4_group)
      .to(options_.precision.dtype);
}

void HfLinearImpl::AddLora(int64_t rank, double alpha) {
  if (rank <= 0 || has_lora()) return;
  const auto options =
      torch::TensorOptions().dtype(options_.precision.dtype).device(weight.device());
  // A as torch's Linear default (kaiming-uniform-like scale), B zero: the product starts at 0.
  const double bound = 1.0 / std::sqrt(static_cast<double>(options_.in_features));
  lora_a = register_parameter(
      "lora_a", torch::empty({rank, options_.in_features}, options).uniform_(-bound, bound));
  lora_b = register_parameter("lora_b", torch::zeros({options_.out_features, rank}, options));
  lora_scale_ = alpha / static_cast<double>(rank);
}

torch::Tensor HfLinearImpl::MergedWeight() const {
  TORCH_CHECK(!quantized(), "MergedWeight needs an unquantized layer");
  if (!has_lora()) return weight;
  return weight + torch::matmul(lora_b, lora_a) * lora_scale_;
}

torch::Tensor HfLinearImpl::forward(const torch::Tensor& x) {
  torch::Tensor y;
  // The packed kernels take int4 groups of a multiple of 32 (the published 32/64/128); other
  // group sizes (the small families use any divisor of the width) dequantize per call.
  const bool kernel_group =
      options_.precision.weights != Precision::kInt4 || options_.precision.int4_group % 32 == 0;
  if (quantized() && q_.values.defined() && x.device().is_cpu() &&
      x.scalar_type() == torch::kFloat && kernel_group) {
    y = QuantizedLinear(x, q_, options_.precision.weights, options_.in_features,
                        options_.precision.int4_group, bias);
  } else {
    y = torch::linear(x, EffectiveWeight(), bias);
  }
  if (has_lora()) y = y + torch::linear(torch::linear(x, lora_a), lora_b) * lora_scale_;
  return y;
}

int64_t HfLinearImpl::WeightBytes() const {
  if (quantized() && q_.values.defined()) return QuantizedBytes(q_);
  return weight.numel() * weight.element_size();
}

HfEmbeddingImpl::HfEmbeddingImpl(int64_t num, int64_t dim, torch::ScalarType dtype) {
  weight = register_parameter("weight", Placeholder({num, dim}, dtype), /*requires_grad=*/false);
}

torch::Tensor HfEmbeddingImpl::forward(const torch::Tensor& ids) {
  return torch::embedding(weight, ids);
}

HfRmsNormImpl::HfRmsNormImpl(int64_t dim, double eps, torch::ScalarType dtype) : eps_(eps) {
  weight = register_parameter("weight", Placeholder({dim}, dtype), /*requires_grad=*/false);
}

torch::Tensor HfRmsNormImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = x.to(torch::kFloat);
  torch::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * torch::rsqrt(variance + eps_);
  return weight * h.to(x.scalar_type());
}

HfLayerNormImpl::HfLayerNormImpl(int64_t dim, double eps, torch::ScalarType dtype) : eps_(eps) {
  weight = register_parameter("weight", Placeholder({dim}, dtype), /*requires_grad=*/false);
  bias = register_parameter("bias", Placeholder({dim}, dtype), /*requires_grad=*/false);
}

torch::Tensor HfLayerNormImpl::forward(const torch::Tensor& x) {
  return torch::layer_norm(x, {x.size(-1)}, weight, bias, eps_);
}

torch::Tensor Activation(const std::string& name, const torch::Tensor& x) {
  if (name == "silu" || name == "swish") return torch::silu(x);
  if (name == "gelu") return torch::gelu(x);
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return torch::gelu(x, "tanh");
  if (name == "quick_gelu") return x * torch::sigmoid(1.702 * x);
  if (name == "relu") return torch::relu(x);
  TORCH_CHECK(false, "unsupported activation ", name);
}

void InitializeHfParameters(torch::nn::Module& module, double std) {
  torch::NoGradGuard no_grad;
  // `module` itself may be under construction (not yet owned by a shared_ptr), so it is not
  // taken from named_modules(include_self).
  std::vector<torch::nn::Module*> all{&module};
  for (const auto& m : module.modules(/*include_self=*/false)) all.push_back(m.get());
  for (torch::nn::Module* mp : all) {
    torch::nn::Module& m = *mp;
    const bool norm = dynamic_cast<HfRmsNormImpl*>(&m) != nullptr ||
                      dynamic_cast<HfLayerNormImpl*>(&m) != nullptr;
    for (auto& p : m.named_parameters(/*recurse=*/false)) {
      torch::Tensor& t = p.value();
      // A placeholder is an expanded single element: a zero stride on a dimension > 1.
      bool placeholder = false;
      for (int64_t d = 0; d < t.dim(); ++d) placeholder |= t.stride(d) == 0 && t.size(d) > 1;
      // (A one-element parameter cannot be told apart; initialising it again is harmless.)
      if (!placeholder && t.numel() > 1) continue;
      torch::Tensor fresh = torch::empty(t.sizes(), t.options());
      if (p.key() == "bias") {
        fresh.zero_();
      } else if (norm) {
        fresh.fill_(1.0);
      } else {
        fresh.normal_(0.0, std);
      }
      t.set_data(fresh);
    }
  }
}

int64_t ResidentBytes(torch::nn::Module& module) {
  std::set<const void*> seen;
  int64_t total = 0;
  auto count = [&](const torch::Tensor& t) {
    if (!t.defined()) return;
    const void* key = t.storage().data();
    if (key == nullptr || !seen.insert(key).second) return;
    total += static_cast<int64_t>(t.storage().nbytes());
  };
  for (const auto& p : module.parameters()) count(p);
  for (const auto& b : module.buffers()) count(b);
  for (const auto& m : module.modules()) {
    if (auto* linear = dynamic_cast<HfLinearImpl*>(m.get());
        linear != nullptr && linear->quantized()) {
      total += linear->WeightBytes();
    }
  }
  return total;
}

}  // namespace cdcca::model
