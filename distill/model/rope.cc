#include "distill/model/rope.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace cdcca::model {
namespace {

using nlohmann::json;

absl::StatusOr<double> NumberField(const json& obj, const std::string& key,
                                   const std::string& where, const std::string& file) {
  if (!obj.contains(key) || !obj[key].is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, ".", key, " missing or not a number"));
  }
  return obj[key].get<double>();
}

// A number field that may be absent or null (then `fallback`).
absl::StatusOr<double> OptionalNumber(const json& obj, const std::string& key, double fallback,
                                      const std::string& where, const std::string& file) {
  if (!obj.contains(key) || obj[key].is_null()) return fallback;
  if (!obj[key].is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, ".", key, " is not a number"));
  }
  return obj[key].get<double>();
}

// transformers' get_mscale: 1 up to scale 1, then 0.1 * mscale * ln(scale) + 1.
double YarnMscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// yarn: factor (or max_position_embeddings / original_max_position_embeddings when absent),
// the attention factor, beta_fast / beta_slow (a 0 or missing value takes the default, as
// transformers' `or`), truncate.
absl::StatusOr<RopeConfig> ParseYarn(const json& params, const std::string& where, int64_t max_pos,
                                     const std::string& file, RopeConfig r) {
  absl::StatusOr<double> orig = OptionalNumber(params, "original_max_position_embeddings",
                                               static_cast<double>(max_pos), where, file);
  if (!orig.ok()) return orig.status();
  r.original_max_position_embeddings = static_cast<int64_t>(*orig);
  if (r.original_max_position_embeddings <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": field ", where,
        ".original_max_position_embeddings (or max_position_embeddings) missing; yarn needs it"));
  }
  absl::StatusOr<double> factor = OptionalNumber(params, "factor", 0.0, where, file);
  if (!factor.ok()) return factor.status();
  r.factor =
      *factor > 0 ? *factor : static_cast<double>(max_pos) / r.original_max_position_embeddings;
  if (!(r.factor > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, ".factor must be > 0 for yarn"));
  }
  absl::StatusOr<double> fast = OptionalNumber(params, "beta_fast", 0.0, where, file);
  if (!fast.ok()) return fast.status();
  absl::StatusOr<double> slow = OptionalNumber(params, "beta_slow", 0.0, where, file);
  if (!slow.ok()) return slow.status();
  r.beta_fast = *fast != 0 ? *fast : 32.0;
  r.beta_slow = *slow != 0 ? *slow : 1.0;
  if (params.contains("truncate") && params["truncate"].is_boolean()) {
    r.truncate = params["truncate"].get<bool>();
  }
  absl::StatusOr<double> attention = OptionalNumber(params, "attention_factor", 0.0, where, file);
  if (!attention.ok()) return attention.status();
  absl::StatusOr<double> mscale = OptionalNumber(params, "mscale", 0.0, where, file);
  if (!mscale.ok()) return mscale.status();
  absl::StatusOr<double> mscale_all = OptionalNumber(params, "mscale_all_dim", 0.0, where, file);
  if (!mscale_all.ok()) return mscale_all.status();
  if (params.contains("attention_factor") && !params["attention_factor"].is_null()) {
    r.attention_factor = *attention;
  } else if (*mscale != 0 && *mscale_all != 0) {
    r.attention_factor = YarnMscale(r.factor, *mscale) / YarnMscale(r.factor, *mscale_all);
  } else {
    r.attention_factor = YarnMscale(r.factor, 1.0);
  }
  return r;
}

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

absl::StatusOr<RopeConfig> ParseRopeConfig(const json& c, const std::string& file) {
  RopeConfig r;
  json params;  // the scaling settings, whichever spelling holds them
  std::string where;
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    params = c["rope_parameters"];
    where = "rope_parameters";
  } else if (c.contains("rope_scaling") && c["rope_scaling"].is_object()) {
    params = c["rope_scaling"];
    where = "rope_scaling";
  }
  if (params.is_object() && params.contains("rope_theta") && params["rope_theta"].is_number()) {
    r.theta = params["rope_theta"].get<double>();
  } else if (c.contains("rope_theta") && c["rope_theta"].is_number()) {
    r.theta = c["rope_theta"].get<double>();
  }
  const double partial = params.is_object() && params.contains("partial_rotary_factor")
                             ? params["partial_rotary_factor"].get<double>()
                             : c.value("partial_rotary_factor", 1.0);
  if (partial != 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field partial_rotary_factor = ", partial, " is not supported"));
  }
  if (!params.is_object()) return r;
  if (params.contains("rope_type") && params["rope_type"].is_string()) {
    r.type = params["rope_type"].get<std::string>();
  } else if (params.contains("type") && params["type"].is_string()) {
    r.type = params["type"].get<std::string>();
  }
  const int64_t max_pos = c.value("max_position_embeddings", int64_t{0});
  if (r.type == "default") return r;
  if (r.type != "linear" && r.type != "dynamic" && r.type != "llama3" && r.type != "yarn") {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, ".rope_type = \"", r.type,
                     "\" is not supported (supported: default, linear, dynamic, llama3, yarn)"));
  }
  if (r.type == "yarn") return ParseYarn(params, where, max_pos, file, r);
  absl::StatusOr<double> factor = NumberField(params, "factor", where, file);
  if (!factor.ok()) return factor.status();
  r.factor = *factor;
  if (r.type == "llama3") {
    absl::StatusOr<double> lo = NumberField(params, "low_freq_factor", where, file);
    if (!lo.ok()) return lo.status();
    absl::StatusOr<double> hi = NumberField(params, "high_freq_factor", where, file);
    if (!hi.ok()) return hi.status();
    absl::StatusOr<double> orig =
        NumberField(params, "original_max_position_embeddings", where, file);
    if (!orig.ok()) return orig.status();
    r.low_freq_factor = *lo;
    r.high_freq_factor = *hi;
    r.original_max_position_embeddings = static_cast<int64_t>(*orig);
  } else if (r.type == "dynamic") {
    r.original_max_position_embeddings = params.value("original_max_position_embeddings", max_pos);
    if (r.original_max_position_embeddings <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": field max_position_embeddings missing (needed by dynamic rope)"));
    }
  }
  return r;
}

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
  const int64_t half = x.size(-1) / 2;
  torch::Tensor rotated =
      torch::cat({-x.narrow(-1, half, x.size(-1) - half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

}  // namespace cdcca::model
