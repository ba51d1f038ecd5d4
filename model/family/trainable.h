// The trainable set for adaptation: the one place that says which parameters of an MLLM
// change after pretraining. Members (by name): norm weights and biases (LayerNorm/RMSNorm
// modules, i.e. a module whose name contains "norm" in any case), every "bias", the query
// tokens ("query_tokens" of the BLIP-2 towers), LoRA
// "lora_a"/"lora_b", and the gated adapter prompts "adapter_prompt"/"adapter_gate".
// Everything else (the base linear weights, embeddings, the vision encoder) is frozen.
//
// The set is an ordered list of (name, tensor) in named_parameters() order; the tensors
// share storage with the model, so the compress module's in-place adds change the model.
#ifndef CDCCA_MODEL_FAMILY_TRAINABLE_H_
#define CDCCA_MODEL_FAMILY_TRAINABLE_H_

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace cdcca::model {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// True if a parameter named `name` (as in named_parameters()) is in the trainable set.
bool IsTrainableName(const std::string& name);

// The trainable set of `model`, without touching requires_grad.
NamedTensors TrainableParameters(const torch::nn::Module& model);

// Sets requires_grad = true on the trainable set and false on every other parameter of
// `model`, and returns the set.
NamedTensors SelectTrainable(torch::nn::Module& model);

// Sets requires_grad on every parameter (pretraining trains the whole tower).
void SetAllTrainable(torch::nn::Module& model, bool trainable);

int64_t NumElements(const NamedTensors& tensors);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_TRAINABLE_H_
