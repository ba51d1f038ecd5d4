#include "model/family/token_score_kind.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace cdcca::model {
namespace {

// Every kind, in the order errors name them.
constexpr TokenScoreKind kKinds[] = {
    TokenScoreKind::kVis,          TokenScoreKind::kAttentionVariance,
    TokenScoreKind::kAttentionCv,  TokenScoreKind::kAttentionMass,
    TokenScoreKind::kProbeEntropy, TokenScoreKind::kVarianceProbe,
    TokenScoreKind::kVisRelative};

}  // namespace

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
  std::vector<absl::string_view> names;
  for (TokenScoreKind k : kKinds) {
    if (name == TokenScoreName(k)) return k;
    names.push_back(TokenScoreName(k));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown token score '", name, "' (", absl::StrJoin(names, ", "), ")"));
}

bool UsesAttention(TokenScoreKind kind) { return kind != TokenScoreKind::kProbeEntropy; }

bool DeviceComputes(TokenScoreKind kind) {
  return kind == TokenScoreKind::kVis || kind == TokenScoreKind::kVisRelative ||
         kind == TokenScoreKind::kAttentionVariance || kind == TokenScoreKind::kAttentionMass;
}

std::string DeviceScoreNames() {
  std::vector<absl::string_view> names;
  for (TokenScoreKind k : kKinds) {
    if (DeviceComputes(k)) names.push_back(TokenScoreName(k));
  }
  return absl::StrJoin(names, ", ");
}

bool UsesProbe(TokenScoreKind kind) {
  return kind == TokenScoreKind::kProbeEntropy || kind == TokenScoreKind::kVarianceProbe;
}

}  // namespace cdcca::model
