// UTS stage-2 scores per visual token (paper Eq. 3), computed from the student's M
// stochastic passes (MllmImpl::StochasticPasses). One definition shared by the device
// runtime (device/inference_runtime.cc) and the offline adaptation experiment
// (distill/adapt_eval.h), so the experiment selects tokens exactly as a device does.
//
// Thread-safety: pure functions of their inputs.
#ifndef CDCCA_DISTILL_MODEL_TOKEN_SCORES_H_
#define CDCCA_DISTILL_MODEL_TOKEN_SCORES_H_

#include <torch/types.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::model {

struct StochasticStats;

enum class TokenScoreKind {
  // Variance over the passes of the cross-attention mass a token receives, divided by its
  // squared mean (the squared coefficient of variation): instability of the student's use
  // of the token independent of how much mass it gets on average.
  kAttentionCv,
  // Plain variance over the passes of the attention mass per token. Scales with the mass
  // itself, so it favours the tokens the student reads most (the items in a scene).
  kAttentionVariance,
  // Mean attention mass over the passes: what the student reads, with no uncertainty in it.
  // An ablation, to tell what the variance adds over the mass it scales with.
  kAttentionMass,
  // Predictive entropy of the token probe under dropout, smoothed over the grid
  // (TokenProbeImpl::Uncertainty): how unsure the device is of what each token shows. Not
  // computed from the attention statistics: VisualTokenScores refuses it.
  kProbeEntropy,
};

absl::string_view TokenScoreName(TokenScoreKind kind);  // "attention_cv", "attention_variance",
                                                        // "attention_mass", "probe_entropy"
absl::StatusOr<TokenScoreKind> ParseTokenScore(absl::string_view name);

// [B, N] float scores from `stats` (its attention_mass_variance, and attention_mass [M, B, N]
// for the mean); higher = keep first. Zero dropout gives all-zero scores.
torch::Tensor VisualTokenScores(const StochasticStats& stats, TokenScoreKind kind);

}  // namespace cdcca::model

#endif  // CDCCA_DISTILL_MODEL_TOKEN_SCORES_H_
