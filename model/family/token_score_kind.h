// The UTS stage-2 token scores by name (paper Sec. 3.2, Eq. 3): one enum shared by the
// device (device/uts.h, torch-free), the harness's experiment files and the torch code that
// computes them (the device runtime, over MultimodalModel::StochasticVisualTokens). Torch-free, so
// the device's UTS library and the experiment parser link it without LibTorch.
//
// Thread-safety: pure functions.
#ifndef CDCCA_MODEL_FAMILY_TOKEN_SCORE_KIND_H_
#define CDCCA_MODEL_FAMILY_TOKEN_SCORE_KIND_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::model {

enum class TokenScoreKind {
  // The device default on every architecture: VIS (paper Eq. 3), the variance over the M
  // passes (element-wise MC dropout on the visual tokens the model reads, the model's own
  // dropout active) of each token's representation F where the model acts on it, averaged
  // over F's features: BLIP-2 / InstructBLIP and the project's families, the token's
  // contribution to the Q-Former's cross-attention output in every cross-attending layer;
  // LLaVA, what the lower half of the LM adds to the token's row (model/arch/multimodal_model.h,
  // VisualTokenPassOptions). Nothing trained for it. The kinds below are ablations.
  kVis,
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
  // Predictive entropy of a token probe trained on the benchmark's cell labels, under the
  // same dropout passes. No model folder carries such a probe (the project's families no
  // longer train one), so the device refuses this score; the name stays so that an experiment
  // file naming it gets that error rather than an unknown-name one. Its measured figures are
  // in docs/BENCHMARKS.md.
  kProbeEntropy,
  // Attention variance times the cube of the probe entropy, the entropy
  // from one pass without dropout (the dropout passes are the attention's; the probe's own
  // would double stage 2's cost). Tokens the student reads (which the teacher needs in order
  // to answer) and cannot make out (which the adaptation is for): most kept tokens fall in
  // the corrupted half of a frame, and the cloud recovers the all-tokens gain from them
  // (docs/BENCHMARKS.md). Without a probe (no model folder has one) the device scores with
  // the attention variance alone (device InferenceRuntime::EffectiveScore).
  kVarianceProbe,
  // VIS divided by the squared size of the token's mean F (model/arch/multimodal_model.h,
  // VisRelativeVariance): element-wise dropout moves F in proportion to the token, so plain
  // VIS also ranks by how large F is; this ranks by how much F moves for its size. An
  // ablation, measured beside VIS in docs/BENCHMARKS.md.
  kVisRelative,
};

// "vis", "attention_variance", "attention_cv", "attention_mass", "probe_entropy",
// "variance_probe", "vis_relative".
absl::string_view TokenScoreName(TokenScoreKind kind);
// INVALID_ARGUMENT naming the known scores for any other name.
absl::StatusOr<TokenScoreKind> ParseTokenScore(absl::string_view name);

// What a score is computed from: the student's stochastic passes (VIS and the attention
// statistics), the token probe, or both.
bool UsesAttention(TokenScoreKind kind);
bool UsesProbe(TokenScoreKind kind);

// The scores a device computes from its own passes (vis, vis_relative, attention_variance,
// attention_mass); the others need a token probe, which no model folder carries.
bool DeviceComputes(TokenScoreKind kind);
// Their names, for errors: "vis, attention_variance, attention_mass, vis_relative".
std::string DeviceScoreNames();

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_TOKEN_SCORE_KIND_H_
