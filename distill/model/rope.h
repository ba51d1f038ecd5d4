// Rotary position embeddings as transformers computes them for the Llama family
// (modeling_rope_utils.py): inverse frequencies for the rope types `default`, `linear`,
// `dynamic` (NTK-aware), `llama3` and `yarn` (with its attention factor on cos/sin), the
// cos/sin tables and rotate-half application.
//
// Pure functions; thread-safe.
#ifndef CDCCA_DISTILL_MODEL_ROPE_H_
#define CDCCA_DISTILL_MODEL_ROPE_H_

#include <torch/types.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

struct RopeConfig {
  std::string type = "default";   // default | linear | dynamic | llama3 | yarn
  double theta = 10000.0;         // rope_theta
  double factor = 1.0;            // linear, dynamic, llama3, yarn
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  // llama3 and yarn: the pre-training context; dynamic: the length past which the base grows
  // (original_max_position_embeddings if given, else max_position_embeddings).
  int64_t original_max_position_embeddings = 0;
  // yarn: the rotation counts bounding the ramp between interpolated and extrapolated
  // dimensions, whether those bounds are rounded outwards to whole dimensions, and the
  // factor cos and sin are multiplied by (attention_factor, or derived from factor and
  // mscale / mscale_all_dim as transformers does). 1 for every other type.
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool truncate = true;
  double attention_factor = 1.0;
};

// Reads rope settings from a decoder config: transformers 5.x `rope_parameters`
// ({rope_type, rope_theta, factor, ...}) or 4.x `rope_theta` + `rope_scaling` ({type or
// rope_type, factor, ...} or null). InvalidArgument naming `file` and the field for an
// unsupported type (longrope, ...), a partial_rotary_factor other than 1, or a missing
// required field.
absl::StatusOr<RopeConfig> ParseRopeConfig(const nlohmann::json& text_config,
                                           const std::string& file);

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

#endif  // CDCCA_DISTILL_MODEL_ROPE_H_
