#include "model/family/trainable.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

namespace cdcca::model {

bool IsTrainableName(const std::string& name) {
  std::vector<absl::string_view> parts = absl::StrSplit(name, '.');
  const absl::string_view leaf = parts.back();
  if (leaf == "bias" || leaf == "query_tokens" || leaf == "lora_a" || leaf == "lora_b" ||
      leaf == "adapter_prompt" || leaf == "adapter_gate") {
    return true;
  }
  // Norm modules: "ffn_norm", "post_attention_layernorm", the Q-Former's "LayerNorm", the
  // ViT's "layer_norm1".
  return parts.size() >= 2 &&
         absl::StrContains(absl::AsciiStrToLower(parts[parts.size() - 2]), "norm");
}

NamedTensors TrainableParameters(const torch::nn::Module& model) {
  NamedTensors out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (IsTrainableName(item.key())) out.emplace_back(item.key(), item.value());
  }
  return out;
}

NamedTensors SelectTrainable(torch::nn::Module& model) {
  for (auto& item : model.named_parameters(/*recurse=*/true)) {
    item.value().set_requires_grad(IsTrainableName(item.key()));
  }
  return TrainableParameters(model);
}

void SetAllTrainable(torch::nn::Module& model, bool trainable) {
  for (auto& p : model.parameters(/*recurse=*/true)) p.set_requires_grad(trainable);
}

int64_t NumElements(const NamedTensors& tensors) {
  int64_t n = 0;
  for (const auto& [name, t] : tensors) n += t.numel();
  return n;
}

}  // namespace cdcca::model
