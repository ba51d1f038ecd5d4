#include "distill/model/rope.h"

#include <torch/torch.h>

#include <cmath>

#include "absl/strings/str_cat.h"

namespace cdcca::model {
namespace {

using nlohmann::json;

absl::StatusOr<double> NumberField(const json& obj, const std::string& key, const std::string& where,
                                   const std::string& file) {
  if (!obj.contains(key) || !obj[key].is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, ".", key, " missing or not a number"));
  }
  return obj[key].get<double>();
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
  if (r.type != "linear" && r.type != "dynamic" && r.type != "llama3") {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, ".rope_type = \"", r.type,
                     "\" is not supported (supported: default, linear, dynamic, llama3)"));
  }
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
    r.original_max_position_embeddings =
        params.value("original_max_position_embeddings", max_pos);
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
  torch::Tensor inv_freq = 1.0 / torch::pow(base, exponent);
  if (rope.type == "linear") return inv_freq / rope.factor;
  if (rope.type != "llama3") return inv_freq;
  const double old_len = static_cast<double>(rope.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / rope.low_freq_factor;
  const double high_freq_wavelen = old_len / rope.high_freq_factor;
  torch::Tensor wavelen = 2 * M_PI / inv_freq;
  // Long wavelengths (low frequencies) are divided by factor, short ones kept, and the band
  // in between interpolated smoothly.
  torch::Tensor scaled =
      torch::where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq);
  torch::Tensor smooth = (old_len / wavelen - rope.low_freq_factor) /
                         (rope.high_freq_factor - rope.low_freq_factor);
  torch::Tensor smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled;
  torch::Tensor medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return torch::where(medium, smoothed, scaled);
}

void RopeCosSin(const torch::Tensor& inv_freq, const torch::Tensor& positions,
                torch::ScalarType dtype, torch::Tensor* cos, torch::Tensor* sin) {
  torch::Tensor freqs = positions.to(torch::kFloat).unsqueeze(-1) *
                        inv_freq.to(positions.device(), torch::kFloat);  // [B, T, d/2]
  torch::Tensor emb = torch::cat({freqs, freqs}, -1);
  *cos = emb.cos().to(dtype);
  *sin = emb.sin().to(dtype);
}

torch::Tensor ApplyRope(const torch::Tensor& x, const torch::Tensor& cos,
                        const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  torch::Tensor rotated =
      torch::cat({-x.narrow(-1, half, x.size(-1) - half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

}  // namespace cdcca::model
