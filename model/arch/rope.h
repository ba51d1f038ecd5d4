// Rotary position embeddings as transformers computes them for the Llama family
// (modeling_rope_utils.py): inverse frequencies for the rope types `default`, `linear`,
// `dynamic` (NTK-aware), `llama3` and `yarn` (with its attention factor on cos/sin), the
// cos/sin tables and rotate-half application.
//
// Pure functions; thread-safe.
#ifndef CDCCA_MODEL_ARCH_ROPE_H_
#define CDCCA_MODEL_ARCH_ROPE_H_

#include <torch/types.h>

#include <cstdint>
#include <string>

#include "model/hub/folder_config.h"

namespace cdcca::model {

// RopeConfig and ParseRopeConfig (the config.json fields) are in folder_config.h.

// fp32 [head_dim / 2] inverse frequencies. `seq_len` (max position + 1 of the current
// forward) only matters for `dynamic`.
torch::Tensor RopeInvFreq(const RopeConfig& rope, int64_t head_dim, int64_t seq_len);

// cos and sin [B, T, head_dim] (the half-dim table repeated twice) for positions [B, T]
// (int64), computed in fp32, multiplied by `scale` (RopeConfig::attention_factor), then
// cast to `dtype`.
void RopeCosSin(const torch::Tensor& inv_freq, const torch::Tensor& positions,
                torch::ScalarType dtype, torch::Tensor* cos, torch::Tensor* sin,
                double scale = 1.0);

// x * cos + rotate_half(x) * sin for x [B, heads, T, head_dim], cos/sin [B, T, head_dim];
// rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]).
torch::Tensor ApplyRope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_ROPE_H_
