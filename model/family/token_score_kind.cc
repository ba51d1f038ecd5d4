#include "model/family/token_score_kind.h"

#include "absl/strings/str_cat.h"

namespace cdcca::model {

absl::string_view TokenScoreName(TokenScoreKind kind) {
  switch (kind) {
    case TokenScoreKind::kVis:
      return "vis";
    case TokenScoreKind::kAttentionVariance:
      return "attention_variance";
    case TokenScoreKind::kAttentionCv:
      return "attention_cv";
    case TokenScoreKind::kAttentionMass:
      return "attention_mass";
    case TokenScoreKind::kProbeEntropy:
      return "probe_entropy";
    case TokenScoreKind::kVarianceProbe:
      return "variance_probe";
    case TokenScoreKind::kVisRelative:
      return "vis_relative";
  }
  return "?";
}

absl::StatusOr<TokenScoreKind> ParseTokenScore(absl::string_view name) {
  for (TokenScoreKind k :
       {TokenScoreKind::kVis, TokenScoreKind::kAttentionVariance, TokenScoreKind::kAttentionCv,
        TokenScoreKind::kAttentionMass, TokenScoreKind::kProbeEntropy,
        TokenScoreKind::kVarianceProbe, TokenScoreKind::kVisRelative}) {
    if (name == TokenScoreName(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown token score '", name,
      "' (vis, attention_variance, attention_cv, attention_mass, probe_entropy, variance_probe, "
      "vis_relative)"));
}

bool UsesAttention(TokenScoreKind kind) { return kind != TokenScoreKind::kProbeEntropy; }

bool DeviceComputes(TokenScoreKind kind) {
  return kind == TokenScoreKind::kVis || kind == TokenScoreKind::kVisRelative ||
         kind == TokenScoreKind::kAttentionVariance || kind == TokenScoreKind::kAttentionMass;
}

absl::string_view DeviceScoreNames() {
  return "vis (Eq. 3), vis_relative, attention_variance or attention_mass";
}

bool UsesProbe(TokenScoreKind kind) {
  return kind == TokenScoreKind::kProbeEntropy || kind == TokenScoreKind::kVarianceProbe;
}

}  // namespace cdcca::model
