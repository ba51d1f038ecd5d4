#include "compress/named_tensors.h"

#include <torch/torch.h>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compress/apply.h"
#include "compress/delta_encoder.h"

namespace cdcca::compress {

absl::StatusOr<std::vector<TensorView>> ViewsOf(const NamedTensors& tensors) {
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  absl::flat_hash_set<absl::string_view> names;
  for (const auto& [name, tensor] : tensors) {
    if (!names.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrFormat("tensor '%s' appears twice", name));
    }
    if (!tensor.defined() || tensor.scalar_type() != torch::kFloat32 || !tensor.is_contiguous() ||
        !tensor.device().is_cpu()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor '%s' must be a defined, contiguous float32 CPU tensor (is %s)",
                          name, tensor.defined() ? tensor.toString() : std::string("undefined")));
    }
    TensorView v;
    v.name = name;
    v.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
    v.data = tensor.data_ptr<float>();
    views.push_back(std::move(v));
  }
  return views;
}

absl::StatusOr<uint64_t> ApplyUpdate(absl::string_view payload, uint64_t expected_base_version,
                                     NamedTensors& live, const ParseLimits& limits) {
  absl::StatusOr<std::vector<TensorView>> views = ViewsOf(live);
  if (!views.ok()) return views.status();
  return ApplyUpdateToViews(payload, expected_base_version, *views, limits);
}

uint64_t StateDigest(const NamedTensors& tensors) {
  // Keep converted copies alive while their views are hashed.
  std::vector<torch::Tensor> copies;
  copies.reserve(tensors.size());
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    torch::Tensor t = tensor.defined() ? tensor : torch::empty({0});
    if (t.scalar_type() != torch::kFloat32 || !t.is_contiguous() || !t.device().is_cpu()) {
      t = t.to(torch::kCPU, torch::kFloat32).contiguous();
    }
    copies.push_back(t);
    TensorView v;
    v.name = name;
    v.shape.assign(t.sizes().begin(), t.sizes().end());
    v.data = t.data_ptr<float>();
    views.push_back(std::move(v));
  }
  return DigestViews(views);
}

NamedTensors Fp32Clones(const NamedTensors& tensors) {
  torch::NoGradGuard no_grad;
  NamedTensors out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    out.emplace_back(name, t.detach().to(torch::kCPU, torch::kFloat).contiguous().clone());
  }
  return out;
}

absl::Status CopyInto(const NamedTensors& from, const NamedTensors& into) {
  absl::flat_hash_map<std::string, const torch::Tensor*> by_name;
  for (const auto& [name, t] : from) by_name[name] = &t;
  std::vector<std::pair<torch::Tensor, const torch::Tensor*>> pairs;
  pairs.reserve(into.size());
  for (const auto& [name, target] : into) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(absl::StrCat("the state lacks tensor ", name));
    }
    if (it->second->sizes() != target.sizes()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor %s: the state has shape %s, the target %s", name,
                          c10::str(it->second->sizes()), c10::str(target.sizes())));
    }
    pairs.emplace_back(target, it->second);
  }
  torch::NoGradGuard no_grad;
  for (auto& [target, source] : pairs) target.copy_(*source);
  return absl::OkStatus();
}

absl::StatusOr<UpdatePayload> DeltaEncoder::Encode(const NamedTensors& theta_new,
                                                   const NamedTensors& theta_mirror,
                                                   uint64_t base_version, uint64_t new_version) {
  absl::StatusOr<std::vector<TensorView>> fresh = ViewsOf(theta_new);
  if (!fresh.ok()) return fresh.status();
  absl::StatusOr<std::vector<TensorView>> mirror = ViewsOf(theta_mirror);
  if (!mirror.ok()) return mirror.status();
  return Encode(*fresh, *mirror, base_version, new_version);
}

}  // namespace cdcca::compress
