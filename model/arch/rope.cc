#include "model/arch/rope.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "model/runtime/fused_ops.h"

namespace cdcca::model {
namespace {

// yarn's blend of interpolated (divided by factor) and extrapolated (kept) frequencies: a
// linear ramp over the dimensions between the ones that turn beta_fast and beta_slow times
// over the original context.
torch::Tensor YarnInvFreq(const RopeConfig& rope, int64_t dim, const torch::Tensor& pos_freqs) {
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(rope.original_max_position_embeddings / (rotations * 2 * M_PI))) /
           (2 * std::log(rope.theta));
  };
  double low = correction_dim(rope.beta_fast);
  double high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // as transformers: no zero-width ramp
  torch::Tensor ramp = ((torch::arange(dim / 2, torch::kFloat) - low) / (high - low)).clamp(0, 1);
  torch::Tensor extrapolation_weight = 1 - ramp;
  torch::Tensor extrapolated = 1.0 / pos_freqs;
  torch::Tensor interpolated = 1.0 / (rope.factor * pos_freqs);
  return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight;
}

}  // namespace

torch::Tensor RopeInvFreq(const RopeConfig& rope, int64_t head_dim, int64_t seq_len) {
  double base = rope.theta;
  if (rope.type == "dynamic" && seq_len > rope.original_max_position_embeddings) {
    const double ratio = rope.factor * static_cast<double>(seq_len) /
                             static_cast<double>(rope.original_max_position_embeddings) -
                         (rope.factor - 1.0);
    base = base * std::pow(ratio, static_cast<double>(head_dim) / (head_dim - 2));
  }
  // As transformers: integer exponents made float32, base ** (2i / d) in float32.
  torch::Tensor exponent =
      torch::arange(0, head_dim, 2, torch::kLong).to(torch::kFloat) / static_cast<float>(head_dim);
  if (rope.type == "yarn") return YarnInvFreq(rope, head_dim, torch::pow(base, exponent));
  torch::Tensor inv_freq = 1.0 / torch::pow(base, exponent);
  if (rope.type == "linear") return inv_freq / rope.factor;
  if (rope.type != "llama3") return inv_freq;
  const double old_len = static_cast<double>(rope.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / rope.low_freq_factor;
  const double high_freq_wavelen = old_len / rope.high_freq_factor;
  torch::Tensor wavelen = 2 * M_PI / inv_freq;
  // Long wavelengths (low frequencies) are divided by factor, short ones kept, and the band
  // in between interpolated smoothly.
  torch::Tensor scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq);
  torch::Tensor smooth =
      (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
  torch::Tensor smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled;
  torch::Tensor medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return torch::where(medium, smoothed, scaled);
}

void RopeCosSin(const torch::Tensor& inv_freq, const torch::Tensor& positions,
                torch::ScalarType dtype, torch::Tensor* cos, torch::Tensor* sin, double scale) {
  torch::Tensor freqs = positions.to(torch::kFloat).unsqueeze(-1) *
                        inv_freq.to(positions.device(), torch::kFloat);  // [B, T, d/2]
  torch::Tensor emb = torch::cat({freqs, freqs}, -1);
  if (scale == 1.0) {
    *cos = emb.cos().to(dtype);
    *sin = emb.sin().to(dtype);
  } else {
    *cos = (emb.cos() * scale).to(dtype);
    *sin = (emb.sin() * scale).to(dtype);
  }
}

torch::Tensor ApplyRope(const torch::Tensor& x, const torch::Tensor& cos,
                        const torch::Tensor& sin) {
  return RotaryEmbedding(x, cos, sin);
}

}  // namespace cdcca::model
