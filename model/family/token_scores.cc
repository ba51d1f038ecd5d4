#include "model/family/token_scores.h"

#include <torch/torch.h>

#include "model/family/blip2_tower.h"
#include "model/family/token_probe.h"

namespace cdcca::model {

torch::Tensor ProbeEntropyFor(TokenProbeImpl& probe, const torch::Tensor& tokens,
                              TokenScoreKind kind, int passes, double dropout_p) {
  TORCH_CHECK(UsesProbe(kind), TokenScoreName(kind), " does not use the token probe");
  if (kind == TokenScoreKind::kVarianceProbe) return probe.Uncertainty(tokens, 1, 0.0);
  return probe.Uncertainty(tokens, passes, dropout_p);
}

torch::Tensor VisualTokenScores(const StochasticStats* stats, const torch::Tensor& probe_entropy,
                                TokenScoreKind kind) {
  TORCH_CHECK(!UsesAttention(kind) || stats != nullptr, TokenScoreName(kind),
              " needs the attention statistics");
  TORCH_CHECK(!UsesProbe(kind) || probe_entropy.defined(), TokenScoreName(kind),
              " needs the token probe's entropy");
  switch (kind) {
    case TokenScoreKind::kVis:
      return stats->token_variance;
    case TokenScoreKind::kProbeEntropy:
      return probe_entropy;
    case TokenScoreKind::kAttentionMass:
      return stats->attention_mass.mean(0);
    case TokenScoreKind::kAttentionCv: {
      torch::Tensor mean = stats->attention_mass.mean(0);
      // The epsilon keeps tokens that receive no mass at all (masked) at a finite score.
      return stats->attention_mass_variance / (mean * mean + 1e-12);
    }
    case TokenScoreKind::kVarianceProbe:
      return stats->attention_mass_variance *
             probe_entropy.to(stats->attention_mass_variance.device()).pow(kVarianceProbeExponent);
    case TokenScoreKind::kAttentionVariance:
      break;
  }
  return stats->attention_mass_variance;
}

}  // namespace cdcca::model
