// Test helper: small synthetic trainable sets shaped like the model's (norms, biases, query
// tokens, LoRA A/B), for the compress tests.
#ifndef CDCCA_COMPRESS_TEST_SETS_H_
#define CDCCA_COMPRESS_TEST_SETS_H_

#include <torch/torch.h>

#include "compress/named_tensors.h"

namespace cdcca::compress::testing {

inline NamedTensors MakeSet(uint64_t seed) {
  torch::manual_seed(seed);
  return {{"lm.norm.weight", torch::ones({256}) + 0.01 * torch::randn({256})},
          {"lm.layers.0.attn.q_lora.A", 0.02 * torch::randn({8, 256})},
          {"lm.layers.0.attn.q_lora.B", torch::zeros({256, 8})},
          {"qformer.query_tokens", 0.1 * torch::randn({16, 256})},
          {"proj.bias", torch::zeros({384})}};
}

inline NamedTensors Clone(const NamedTensors& set) {
  NamedTensors out;
  for (const auto& [name, t] : set) out.emplace_back(name, t.clone());
  return out;
}

// theta + a Gaussian delta with a different scale per tensor (as real updates have).
inline NamedTensors Perturb(const NamedTensors& set, uint64_t seed, double scale) {
  torch::manual_seed(seed);
  NamedTensors out;
  double s = scale;
  for (const auto& [name, t] : set) {
    out.emplace_back(name, t + s * torch::randn(t.sizes()));
    s *= 2.0;
  }
  return out;
}

}  // namespace cdcca::compress::testing

#endif  // CDCCA_COMPRESS_TEST_SETS_H_
