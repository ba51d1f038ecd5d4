#include "distill/model/token_scores.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "distill/model/mllm.h"

namespace cdcca::model {

absl::string_view TokenScoreName(TokenScoreKind kind) {
  switch (kind) {
    case TokenScoreKind::kAttentionCv:
      return "attention_cv";
    case TokenScoreKind::kAttentionVariance:
      return "attention_variance";
    case TokenScoreKind::kAttentionMass:
      return "attention_mass";
    case TokenScoreKind::kProbeEntropy:
      return "probe_entropy";
  }
  return "?";
}

absl::StatusOr<TokenScoreKind> ParseTokenScore(absl::string_view name) {
  for (TokenScoreKind k : {TokenScoreKind::kAttentionCv, TokenScoreKind::kAttentionVariance,
                           TokenScoreKind::kAttentionMass, TokenScoreKind::kProbeEntropy}) {
    if (name == TokenScoreName(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown token score '", name, "'"));
}

torch::Tensor VisualTokenScores(const StochasticStats& stats, TokenScoreKind kind) {
  TORCH_CHECK(kind != TokenScoreKind::kProbeEntropy,
              "probe_entropy comes from TokenProbeImpl::Uncertainty, not attention statistics");
  if (kind == TokenScoreKind::kAttentionMass) return stats.attention_mass.mean(0);
  torch::Tensor variance = stats.attention_mass_variance;
  if (kind == TokenScoreKind::kAttentionCv) {
    torch::Tensor mean = stats.attention_mass.mean(0);
    // The epsilon keeps tokens that receive no mass at all (masked) at a finite score.
    return variance / (mean * mean + 1e-12);
  }
  return variance;
}

}  // namespace cdcca::model
