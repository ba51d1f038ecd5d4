// The UTS stage-2 token scores by name (paper Sec. 3.2, Eq. 3): one enum shared by the
// device (device/uts.h, torch-free), the harness's experiment files and the torch code that
// computes them (model/family/token_scores.h). Torch-free, so the device's UTS library and
// the experiment parser link it without LibTorch.
//
// Thread-safety: pure functions.
#ifndef CDCCA_MODEL_FAMILY_TOKEN_SCORE_KIND_H_
#define CDCCA_MODEL_FAMILY_TOKEN_SCORE_KIND_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::model {

enum class TokenScoreKind {
  // Variance over the M dropout passes of the cross-attention mass each visual token
  // receives (the paper's token variance, Eq. 3, on the student's attention). Scales with
  // the mass, so it favours the tokens the student reads most (the items in a scene). Above
  // random token sampling in `cdcca adapt-eval`, but blind to where a frame is corrupted
  // (docs/BENCHMARKS.md, "Adaptation", "VIS diagnostic").
  kAttentionVariance,
  // Variance divided by the squared mean attention mass (the squared coefficient of
  // variation). Ranks tokens the student barely reads (empty background) first; measured
  // below random. Kept for comparison.
  kAttentionCv,
  // Mean attention mass over the passes: what the student reads, with no uncertainty in it.
  // An ablation, to tell what the variance adds over the mass it scales with.
  kAttentionMass,
  // Predictive entropy of the family's token probe under the same dropout passes, smoothed
  // over the token grid (TokenProbeImpl::Uncertainty): how unsure the device is of what each
  // token shows. Finds the corrupted half of a frame best, but keeps the tokens the teacher
  // can read least (below random in adaptation). Needs probe.safetensors.
  kProbeEntropy,
  // The device default: attention variance times the cube of the probe entropy, the entropy
  // from one pass without dropout (the dropout passes are the attention's; the probe's own
  // would double stage 2's cost). Tokens the student reads (which the teacher needs in order
  // to answer) and cannot make out (which the adaptation is for): most kept tokens fall in
  // the corrupted half of a frame, and the cloud recovers the all-tokens gain from them
  // (docs/BENCHMARKS.md). A family without probe.safetensors scores with the attention
  // variance alone (device InferenceRuntime::EffectiveScore).
  kVarianceProbe,
};

// "attention_variance", "attention_cv", "attention_mass", "probe_entropy", "variance_probe".
absl::string_view TokenScoreName(TokenScoreKind kind);
// INVALID_ARGUMENT naming the known scores for any other name.
absl::StatusOr<TokenScoreKind> ParseTokenScore(absl::string_view name);

// What a score is computed from: the student's attention statistics, the token probe, or both.
bool UsesAttention(TokenScoreKind kind);
bool UsesProbe(TokenScoreKind kind);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_TOKEN_SCORE_KIND_H_
