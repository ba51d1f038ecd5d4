#include <cmath>

#include "device/uts_cloud_settings.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::device {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::ElementsAre;

TEST(UtsTest, MeanTokenEntropyMatchesHandComputation) {
  // Step 1: uniform over 4 -> ln 4. Step 2: logits (ln 1, ln 3) over 2 -> p = (1/4, 3/4).
  const float inf = -1e30f;
  std::vector<float> logits = {0, 0, 0, 0, 0, std::log(3.0f), inf, inf};
  const double h1 = std::log(4.0);
  const double h2 = -(0.25 * std::log(0.25) + 0.75 * std::log(0.75));
  EXPECT_NEAR(MeanTokenEntropy(logits, 2, 4), (h1 + h2) / 2, 1e-6);
  // A one-hot distribution has zero entropy.
  EXPECT_NEAR(MeanTokenEntropy({50, 0, 0}, 1, 3), 0.0, 1e-6);
}

TEST(UtsTest, TokenScoreNamesRoundTripAndUnknownOnesAreRefused) {
  for (TokenScore s : {TokenScore::kVis, TokenScore::kAttentionVariance, TokenScore::kAttentionCv,
                       TokenScore::kAttentionMass, TokenScore::kProbeEntropy,
                       TokenScore::kVarianceProbe, TokenScore::kVisRelative}) {
    ASSERT_OK_AND_ASSIGN(TokenScore back, ParseTokenScore(TokenScoreName(s)));
    EXPECT_EQ(back, s) << TokenScoreName(s);
  }
  EXPECT_EQ(TokenScoreName(UtsOptions().score), "vis");
  EXPECT_THAT(ParseTokenScore("variance"),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("variance_probe")));
}

TEST(UtsTest, FixedAlphaKeepsSamplesAboveIt) {
  UtsOptions o;
  o.keep_fraction = 0;
  o.entropy_alpha = 1.0f;
  EntropyGate gate(o);
  EXPECT_FALSE(gate.Keep(0.5f));
  EXPECT_FALSE(gate.Keep(1.0f));
  EXPECT_TRUE(gate.Keep(1.5f));
}

TEST(UtsTest, RunningQuantileKeepsTheTargetFractionOfAStream) {
  UtsOptions o;
  o.keep_fraction = 0.25f;
  o.window = 200;
  EntropyGate gate(o);
  std::mt19937 rng(3);
  std::lognormal_distribution<float> entropies(0.0f, 0.7f);
  int kept = 0;
  const int n = 4000;
  for (int i = 0; i < n; ++i) kept += gate.Keep(entropies(rng)) ? 1 : 0;
  EXPECT_NEAR(static_cast<double>(kept) / n, 0.25, 0.03);
  // Scale-free: ten times larger entropies give the same fraction.
  EntropyGate scaled(o);
  std::mt19937 rng2(3);
  int kept2 = 0;
  for (int i = 0; i < n; ++i) kept2 += scaled.Keep(10 * entropies(rng2)) ? 1 : 0;
  EXPECT_EQ(kept, kept2);
}

TEST(UtsTest, KeepTopEntropiesIsTheGatesQuantileOverTheWholeStream) {
  const std::vector<float> entropies = {0.3f, 1.2f, 0.7f, 0.7f, 2.0f, 0.1f, 0.9f, 0.5f};
  // The top half: at or above the 0.5 quantile (0.7), ties included.
  EXPECT_EQ(KeepTopEntropies(entropies, 0.5f),
            (std::vector<bool>{false, true, true, true, true, false, true, false}));
  // The threshold is the one a gate whose window holds the whole stream compares with.
  UtsOptions o;
  o.keep_fraction = 0.25f;
  o.window = static_cast<int>(entropies.size());
  EntropyGate gate(o);
  for (float e : entropies) gate.Keep(e);
  const std::vector<bool> keep = KeepTopEntropies(entropies, 0.25f);
  for (size_t i = 0; i < entropies.size(); ++i) {
    EXPECT_EQ(keep[i], entropies[i] >= gate.threshold()) << i;
  }
  // 0 and 1 keep everything, as does an empty stream.
  for (float kf : {0.0f, 1.0f}) {
    EXPECT_EQ(KeepTopEntropies(entropies, kf), std::vector<bool>(entropies.size(), true)) << kf;
  }
  EXPECT_TRUE(KeepTopEntropies({}, 0.5f).empty());
}

TEST(UtsTest, KeepEverySampleTurnsStageOneOffAndNoUserCanAskForIt) {
  UtsOptions o;
  o.keep_fraction = 0.5f;
  o.entropy_alpha = 3.0f;
  KeepEverySample(&o);
  EntropyGate gate(o);
  for (float e : {0.0f, 0.0f, 5.0f, 0.0f}) EXPECT_TRUE(gate.Keep(e)) << e;
  EXPECT_THAT(CheckUtsOptions(o), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(UtsTest, EveryTokenListsTheGrid) {
  EXPECT_THAT(EveryToken(4), ElementsAre(0, 1, 2, 3));
  EXPECT_TRUE(EveryToken(0).empty());
  EXPECT_TRUE(EveryToken(-1).empty());
}

TEST(UtsTest, SelectTokensTakesTheTopRatioOrThoseAboveBeta) {
  const std::vector<float> scores = {0.1f, 0.9f, 0.5f, 0.7f, 0.2f, 0.8f};
  EXPECT_THAT(SelectTokens(scores, {}, 0.5f, 0), ElementsAre(1, 3, 5));
  EXPECT_THAT(SelectTokens(scores, {}, 0, 0.45f), ElementsAre(1, 2, 3, 5));
  // Absent tokens are never kept.
  EXPECT_THAT(SelectTokens(scores, {true, false, true, true, true, true}, 0.5f, 0),
              ElementsAre(2, 3, 5));
  // At least one token for any ratio > 0.
  EXPECT_THAT(SelectTokens(scores, {}, 0.01f, 0), ElementsAre(1));
  // Ties go to the lower index; the count is ratio x tokens rounded half away from zero.
  const std::vector<float> tied = {0.1f, 0.9f, 0.5f, 0.5f, 0.2f, 0.5f};
  EXPECT_THAT(SelectTokens(tied, {}, 0.5f, 0), ElementsAre(1, 2, 3));
  EXPECT_THAT(SelectTokens(tied, {}, 0.25f, 0), ElementsAre(1, 2));  // 1.5 -> 2
}

TEST(UtsTest, RandomSelectionIsUniformAtTheRatio) {
  std::mt19937_64 rng(11);
  std::vector<int> hits(64, 0);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint16_t> kept = RandomTokenSelection(64, {}, 0.25f, rng);
    ASSERT_EQ(kept.size(), 16u);
    ASSERT_TRUE(std::is_sorted(kept.begin(), kept.end()));
    for (uint16_t k : kept) ++hits[k];
  }
  for (int h : hits) EXPECT_NEAR(h, 500, 90);
}

TEST(UtsTest, CloudSettingsOverrideLocalDefaultsAndAreValidated) {
  UtsOptions o;
  v1::UtsSettings cloud;
  cloud.set_mc_passes(16);
  cloud.set_token_ratio(0.25f);
  cloud.set_feature_precision(v1::FEATURE_PRECISION_INT8);
  ASSERT_OK(MergeCloudSettings(cloud, &o));
  EXPECT_EQ(o.mc_passes, 16);
  EXPECT_EQ(o.token_ratio, 0.25f);
  EXPECT_EQ(o.precision, compress::FeaturePrecision::kInt8);
  EXPECT_EQ(o.dropout_p, UtsOptions().dropout_p);
  cloud.set_dropout_p(1.5f);
  EXPECT_THAT(MergeCloudSettings(cloud, &o), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(o.mc_passes, 16);  // unchanged by a rejected merge
}

}  // namespace
}  // namespace cdcca::device
