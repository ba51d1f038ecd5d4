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
class TokenProbeImpl;

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
  // computed from the attention statistics.
  kProbeEntropy,
  // Attention variance times the cube of the probe entropy: tokens the student reads (which
  // the teacher needs in order to answer) and cannot make out (which the adaptation is for).
  // The probe entropy here is that of one pass without dropout (ProbeEntropyFor): the
  // dropout passes are the attention's, and the probe's own would double stage 2's cost.
  // The cube tilts the ranking towards the probe: measured, it moves more kept tokens into
  // the corrupted half of a frame than the plain product while the cloud still recovers the
  // all-tokens gain (docs/BENCHMARKS.md, "VIS diagnostic").
  kVarianceProbe,
};

// The probe entropy's exponent in kVarianceProbe.
inline constexpr double kVarianceProbeExponent = 3.0;

// "attention_cv", "attention_variance", "attention_mass", "probe_entropy", "variance_probe".
absl::string_view TokenScoreName(TokenScoreKind kind);
absl::StatusOr<TokenScoreKind> ParseTokenScore(absl::string_view name);

// What a score is computed from: the student's attention statistics, the token probe, or both.
bool UsesAttention(TokenScoreKind kind);
bool UsesProbe(TokenScoreKind kind);

// The probe entropy [B, N] that `kind` scores with, from tokens [B, N, d_vis]: M passes at
// dropout_p for kProbeEntropy, one pass without dropout for kVarianceProbe (it draws no random
// numbers). Only for kinds with UsesProbe.
torch::Tensor ProbeEntropyFor(TokenProbeImpl& probe, const torch::Tensor& tokens,
                              TokenScoreKind kind, int passes, double dropout_p);

// [B, N] float scores, higher = keep first, from `stats` (its attention_mass_variance, and
// attention_mass [M, B, N] for the mean) when UsesAttention(kind), and from `probe_entropy`
// ([B, N], TokenProbeImpl::Uncertainty) when UsesProbe(kind); the other may be empty. Zero
// dropout gives all-zero attention scores.
torch::Tensor VisualTokenScores(const StochasticStats* stats, const torch::Tensor& probe_entropy,
                                TokenScoreKind kind);

}  // namespace cdcca::model

#endif  // CDCCA_DISTILL_MODEL_TOKEN_SCORES_H_
