#include "device/uts.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "absl/strings/str_cat.h"
#include "compress/hash64.h"

namespace cdcca::device {

absl::Status CheckUtsOptions(const UtsOptions& o) {
  if (!(o.entropy_alpha >= 0) || !std::isfinite(o.entropy_alpha)) {
    return absl::InvalidArgumentError("UTS entropy_alpha must be a finite value >= 0");
  }
  if (o.keep_fraction < 0 || o.keep_fraction > 1) {
    return absl::InvalidArgumentError("UTS keep_fraction must be in [0, 1]");
  }
  if (o.mc_passes < 1 || o.mc_passes > 64) {
    return absl::InvalidArgumentError(absl::StrCat("UTS mc_passes ", o.mc_passes, " outside 1-64"));
  }
  if (o.dropout_p < 0 || o.dropout_p >= 1) {
    return absl::InvalidArgumentError("UTS dropout_p must be in [0, 1)");
  }
  if (o.token_ratio < 0 || o.token_ratio > 1) {
    return absl::InvalidArgumentError("UTS token_ratio must be in [0, 1]");
  }
  if (!(o.random_share >= 0 && o.random_share < 1)) {
    return absl::InvalidArgumentError("UTS random_share must be in [0, 1)");
  }
  return absl::OkStatus();
}

bool IsRandomShareSample(absl::string_view device_id, uint64_t sample_id, double share) {
  if (!(share > 0)) return false;
  std::string key(device_id);
  key.push_back('\0');
  for (int b = 0; b < 8; ++b) key.push_back(static_cast<char>((sample_id >> (8 * b)) & 0xff));
  const uint64_t h = compress::Hash64(key.data(), key.size(), /*seed=*/0x72616e646f6dull);
  // The top 53 bits as a uniform double in [0, 1).
  return static_cast<double>(h >> 11) * 0x1.0p-53 < share;
}

namespace {

// The (1 - keep_fraction) quantile of `entropies` (non-empty): about keep_fraction of them
// lie at or above it.
float KeepQuantile(std::vector<float> entropies, float keep_fraction) {
  const size_t k = std::min(entropies.size() - 1,
                            static_cast<size_t>((1.0f - keep_fraction) * entropies.size()));
  std::nth_element(entropies.begin(), entropies.begin() + static_cast<long>(k), entropies.end());
  return entropies[k];
}

}  // namespace

void KeepEverySample(UtsOptions* options) {
  options->keep_fraction = 0;
  options->entropy_alpha = -1;  // mean entropies are >= 0
}

float EntropyGate::threshold() const {
  if (keep_fraction_ <= 0 || keep_fraction_ >= 1) return alpha_;
  if (recent_.empty()) return -std::numeric_limits<float>::infinity();
  return KeepQuantile(std::vector<float>(recent_.begin(), recent_.end()), keep_fraction_);
}

std::vector<bool> KeepTopEntropies(const std::vector<float>& entropies, float keep_fraction) {
  std::vector<bool> keep(entropies.size(), true);
  if (keep_fraction <= 0 || keep_fraction >= 1 || entropies.empty()) return keep;
  const float threshold = KeepQuantile(entropies, keep_fraction);
  for (size_t i = 0; i < entropies.size(); ++i) keep[i] = entropies[i] >= threshold;
  return keep;
}

std::vector<uint16_t> EveryToken(int tokens) {
  std::vector<uint16_t> all(static_cast<size_t>(std::max(tokens, 0)));
  for (size_t t = 0; t < all.size(); ++t) all[t] = static_cast<uint16_t>(t);
  return all;
}

bool EntropyGate::Keep(float entropy) {
  const float t = threshold();
  const bool keep = keep_fraction_ > 0 && keep_fraction_ < 1 ? entropy >= t : entropy > t;
  recent_.push_back(entropy);
  if (recent_.size() > window_) recent_.pop_front();
  return keep;
}

std::vector<uint16_t> SelectTokens(const std::vector<float>& scores,
                                   const std::vector<bool>& present, float ratio, float beta) {
  std::vector<uint16_t> candidates;
  for (size_t i = 0; i < scores.size(); ++i) {
    if (present.empty() || present[i]) candidates.push_back(static_cast<uint16_t>(i));
  }
  std::vector<uint16_t> kept;
  if (ratio > 0) {
    size_t n = static_cast<size_t>(std::lround(ratio * static_cast<float>(scores.size())));
    n = std::clamp<size_t>(n, 1, candidates.size());
    std::stable_sort(candidates.begin(), candidates.end(),
                     [&](uint16_t a, uint16_t b) { return scores[a] > scores[b]; });
    kept.assign(candidates.begin(), candidates.begin() + static_cast<long>(n));
  } else {
    for (uint16_t i : candidates) {
      if (scores[i] > beta) kept.push_back(i);
    }
  }
  std::sort(kept.begin(), kept.end());
  return kept;
}

std::vector<uint16_t> RandomTokenSelection(int tokens, const std::vector<bool>& present,
                                           float ratio, std::mt19937_64& rng) {
  std::vector<uint16_t> candidates;
  for (int i = 0; i < tokens; ++i) {
    if (present.empty() || present[static_cast<size_t>(i)]) {
      candidates.push_back(static_cast<uint16_t>(i));
    }
  }
  size_t n = static_cast<size_t>(std::lround(ratio * static_cast<float>(tokens)));
  n = std::clamp<size_t>(n, candidates.empty() ? 0 : 1, candidates.size());
  // Partial Fisher-Yates: the first n positions become a uniform sample.
  for (size_t i = 0; i < n; ++i) {
    std::uniform_int_distribution<size_t> pick(i, candidates.size() - 1);
    std::swap(candidates[i], candidates[pick(rng)]);
  }
  candidates.resize(n);
  std::sort(candidates.begin(), candidates.end());
  return candidates;
}

float MeanTokenEntropy(const std::vector<float>& step_logits, int steps, int vocab) {
  if (steps <= 0 || vocab <= 0) return 0;
  double total = 0;
  for (int s = 0; s < steps; ++s) {
    const float* row = step_logits.data() + static_cast<size_t>(s) * vocab;
    const float max = *std::max_element(row, row + vocab);
    double z = 0;
    for (int v = 0; v < vocab; ++v) z += std::exp(static_cast<double>(row[v] - max));
    double h = 0;
    for (int v = 0; v < vocab; ++v) {
      const double logp = static_cast<double>(row[v] - max) - std::log(z);
      h -= std::exp(logp) * logp;
    }
    total += h;
  }
  return static_cast<float>(total / steps);
}

}  // namespace cdcca::device
