// Named tensors: a model's tensors by checkpoint name, in a fixed order. The trainable set of
// a model (MultimodalModel::TrainableParameters) and an update's tensors travel as this; the
// tensors may alias the model, so an in-place add on them changes the model.
#ifndef CDCCA_MODEL_ARCH_NAMED_TENSORS_H_
#define CDCCA_MODEL_ARCH_NAMED_TENSORS_H_

#include <torch/types.h>

#include <string>
#include <utility>
#include <vector>

namespace cdcca::model {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_NAMED_TENSORS_H_
