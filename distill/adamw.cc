#include "distill/adamw.h"

#include <cmath>
#include <map>
#include <tuple>
#include <utility>

namespace cdcca::distill {

MultiTensorAdamW::MultiTensorAdamW(std::vector<torch::Tensor> params, const AdamWOptions& options)
    : params_(std::move(params)), state_(params_.size()), options_(options) {}

void MultiTensorAdamW::zero_grad() {
  for (torch::Tensor& p : params_) p.mutable_grad() = torch::Tensor();
}

void MultiTensorAdamW::step() {
  torch::NoGradGuard no_grad;
  // One group per dtype, device and step count: the _foreach_ passes take one scalar per call
  // (the bias corrections depend on the count), and their fast path one dtype and device.
  using Key = std::tuple<int, std::string, int64_t>;
  struct Group {
    std::vector<torch::Tensor> params, grads, exp_avg, exp_avg_sq;
  };
  std::map<Key, Group> groups;
  for (size_t i = 0; i < params_.size(); ++i) {
    const torch::Tensor& p = params_[i];
    const torch::Tensor& g = p.grad();
    if (!g.defined()) continue;
    State& s = state_[i];
    if (!s.exp_avg.defined()) {
      s.exp_avg = torch::zeros_like(p, torch::MemoryFormat::Preserve);
      s.exp_avg_sq = torch::zeros_like(p, torch::MemoryFormat::Preserve);
    }
    ++s.steps;
    Group& group = groups[{static_cast<int>(p.scalar_type()), p.device().str(), s.steps}];
    group.params.push_back(p);
    group.grads.push_back(g);
    group.exp_avg.push_back(s.exp_avg);
    group.exp_avg_sq.push_back(s.exp_avg_sq);
  }
  const AdamWOptions& o = options_;
  for (auto& [key, g] : groups) {
    const int64_t steps = std::get<2>(key);
    if (o.weight_decay != 0.0) at::_foreach_mul_(g.params, 1.0 - o.lr * o.weight_decay);
    at::_foreach_mul_(g.exp_avg, o.beta1);
    at::_foreach_add_(g.exp_avg, g.grads, 1.0 - o.beta1);
    at::_foreach_mul_(g.exp_avg_sq, o.beta2);
    at::_foreach_addcmul_(g.exp_avg_sq, g.grads, g.grads, 1.0 - o.beta2);
    const double bias1 = 1.0 - std::pow(o.beta1, static_cast<double>(steps));
    const double bias2 = 1.0 - std::pow(o.beta2, static_cast<double>(steps));
    std::vector<torch::Tensor> denom = at::_foreach_sqrt(g.exp_avg_sq);
    at::_foreach_div_(denom, std::sqrt(bias2));
    at::_foreach_add_(denom, o.eps);
    at::_foreach_addcdiv_(g.params, g.exp_avg, denom, -o.lr / bias1);
  }
}

}  // namespace cdcca::distill
