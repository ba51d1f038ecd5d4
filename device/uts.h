// Uncertainty-guided token sampling (UTS, paper Sec. 3.2): which samples, and which of their
// visual tokens, a device sends the cloud.
//
// Stage 1 (per sample): keep a sample when the mean entropy of its answer tokens (Eq. 2)
// exceeds alpha. alpha is fixed, or the running (1 - keep_fraction) quantile of the last
// `window` entropies, so that a device keeps about `keep_fraction` of its stream whatever
// the absolute entropy level of its model is.
// Stage 2 (per visual token): a score per token from M stochastic passes (VIS by default;
// see InferenceRuntime::TokenScores); keep tokens whose score exceeds beta, or the top
// `token_ratio` of them. RandomTokenSelection is the paper's comparison baseline.
//
// Torch-free and protobuf-free. EntropyGate is thread-compatible (one per stream); the functions
// are pure.
#ifndef CDCCA_DEVICE_UTS_H_
#define CDCCA_DEVICE_UTS_H_

#include <cstdint>
#include <deque>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "compress/uplink_codec.h"
#include "model/family/token_score_kind.h"
#include "settings/defaults.h"

namespace cdcca::device {

// What a stage-2 score is computed from (see InferenceRuntime::TokenScores): the model's
// enum and names, one definition (model/family/token_score_kind.h).
using TokenScore = model::TokenScoreKind;
using model::ParseTokenScore;
using model::TokenScoreName;

// Defaults of keep_fraction, mc_passes, dropout_p and token_ratio: the defaults table's
// (settings/defaults.h).
struct UtsOptions {
  // Stage 1. entropy_alpha in nats; keep_fraction in (0, 1) switches to the running quantile.
  float entropy_alpha = 0.5f;
  float keep_fraction = static_cast<float>(settings::kUtsKeepFraction);
  int window = 256;  // entropies the running quantile looks at
  // Share of the samples stage 1 passes over that are kept all the same (in [0, 1)), chosen
  // by IsRandomShareSample: the unbiased part of the uplink.
  float random_share = static_cast<float>(settings::kUtsRandomShare);
  // Stage 2.
  int mc_passes = settings::kUtsMcPasses;
  float dropout_p = static_cast<float>(settings::kUtsDropout);
  float variance_beta = 0.0f;  // used when token_ratio == 0
  // Fraction of visual tokens to keep; 0 = use beta.
  float token_ratio = static_cast<float>(settings::kUtsTokenRatio);
  TokenScore score = TokenScore::kVis;  // VIS (Eq. 3) on every architecture
  // Keep token_ratio of the tokens uniformly at random instead (the paper's comparison
  // baseline; stage 2 then costs nothing).
  bool random_tokens = false;
  compress::FeaturePrecision precision = compress::FeaturePrecision::kFp16;
};

// Stage 1 off: every sample passes (a fixed threshold below any entropy). For drivers that
// keep a whole stream or decide stage 1 themselves over a finished one (KeepTopEntropies);
// CheckUtsOptions refuses the result, which no user or cloud setting can ask for.
void KeepEverySample(UtsOptions* options);

// INVALID_ARGUMENT naming the first field out of range (alpha not finite or < 0, keep_fraction
// or token_ratio outside [0, 1], mc_passes outside 1-64, dropout_p or random_share outside
// [0, 1)).
// The cloud's settings merged over a device's (MergeCloudSettings) are checked by it:
// device/uts_cloud_settings.h.
absl::Status CheckUtsOptions(const UtsOptions& options);

class EntropyGate {
 public:
  explicit EntropyGate(const UtsOptions& options)
      : alpha_(options.entropy_alpha),
        keep_fraction_(options.keep_fraction),
        window_(options.window < 1 ? 1 : options.window) {}

  // Records `entropy` and says whether its sample passes stage 1. With a running quantile,
  // the first sample of an empty window passes (nothing to compare against yet).
  bool Keep(float entropy);

  // The threshold the next sample is compared with.
  float threshold() const;

 private:
  float alpha_;
  float keep_fraction_;
  size_t window_;
  std::deque<float> recent_;
};

// Stage 1 over a finished stream, offline: per entropy, whether it is at or above the
// (1 - keep_fraction) quantile of all of them, EntropyGate's rule with the whole stream as its
// window (the threshold is the one EntropyGate::threshold computes). Every sample for a
// keep_fraction of 0 or 1.
std::vector<bool> KeepTopEntropies(const std::vector<float>& entropies, float keep_fraction);

// Whether sample `sample_id` of device `device_id` belongs to the random share `share` (in
// [0, 1); <= 0: never): a hash of the two, independent of the guard's held-out choice
// (compress::IsHeldOutSample), the same on every run.
bool IsRandomShareSample(absl::string_view device_id, uint64_t sample_id, double share);

// Every index of a `tokens`-token grid, ascending (none for tokens <= 0): the choice of a
// sample that goes up whole.
std::vector<uint16_t> EveryToken(int tokens);

// Indices (ascending) of the tokens to keep: the top `ratio` by score (ties to the lower
// index; at least one token when ratio > 0), or every token with score > beta when
// ratio == 0. Tokens with present[i] == false (absent already) are never kept; `present`
// may be empty (= all present).
std::vector<uint16_t> SelectTokens(const std::vector<float>& scores,
                                   const std::vector<bool>& present, float ratio, float beta);

// `ratio` of the present tokens, uniformly at random (ascending indices).
std::vector<uint16_t> RandomTokenSelection(int tokens, const std::vector<bool>& present,
                                           float ratio, std::mt19937_64& rng);

// Mean over the answer's tokens of the entropy (nats) of each step's distribution, given
// the per-step logits, row-major [steps x vocab]. Eq. 2 of the paper.
float MeanTokenEntropy(const std::vector<float>& step_logits, int steps, int vocab);

}  // namespace cdcca::device

#endif  // CDCCA_DEVICE_UTS_H_
