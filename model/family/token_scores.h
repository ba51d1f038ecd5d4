// UTS stage-2 scores per visual token (paper Eq. 3), computed from the student's M
// stochastic passes (Blip2TowerImpl::StochasticPasses). One definition shared by the device
// runtime (device/inference_runtime.cc) and the offline adaptation experiment
// (distill/adapt_eval.h), so the experiment selects tokens exactly as a device does.
//
// Thread-safety: pure functions of their inputs.
#ifndef CDCCA_MODEL_FAMILY_TOKEN_SCORES_H_
#define CDCCA_MODEL_FAMILY_TOKEN_SCORES_H_

#include <torch/types.h>

#include "model/family/token_score_kind.h"

namespace cdcca::model {

struct StochasticStats;
class TokenProbeImpl;

// The probe entropy's exponent in kVarianceProbe.
inline constexpr double kVarianceProbeExponent = 3.0;

// The probe entropy [B, N] that `kind` scores with, from tokens [B, N, d_vis]: M passes at
// dropout_p for kProbeEntropy, one pass without dropout for kVarianceProbe (it draws no random
// numbers). Only for kinds with UsesProbe.
torch::Tensor ProbeEntropyFor(TokenProbeImpl& probe, const torch::Tensor& tokens,
                              TokenScoreKind kind, int passes, double dropout_p);

// [B, N] float scores, higher = keep first, from `stats` (its token_variance for kVis, its
// attention_mass_variance, and attention_mass [M, B, N] for the mean) when
// UsesAttention(kind), and from `probe_entropy`
// ([B, N], TokenProbeImpl::Uncertainty) when UsesProbe(kind); the other may be empty. Zero
// dropout gives all-zero attention scores.
torch::Tensor VisualTokenScores(const StochasticStats* stats, const torch::Tensor& probe_entropy,
                                TokenScoreKind kind);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_TOKEN_SCORES_H_
