#include "device/sample_step.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "compress/hash64.h"
#include "compress/uplink_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::device {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr int kTokens = 8;
constexpr int kDim = 3;

// One answered frame on a kTokens x kDim grid whose token t holds (t, t + 0.5, t + 0.25), so
// the features of a sample show which rows it carries.
struct FakeAnswer {
  std::vector<float> features;
  std::vector<uint32_t> question = {5, 6, 7};
  std::vector<uint32_t> answer = {9};
  float entropy = 1.0f;
  uint64_t version = 0;

  FakeAnswer() {
    for (int t = 0; t < kTokens; ++t) {
      features.insert(features.end(), {float(t), t + 0.5f, t + 0.25f});
    }
  }
  AnsweredFrame Frame() const {
    AnsweredFrame f;
    f.entropy = entropy;
    f.tokens = kTokens;
    f.dim = kDim;
    f.features = features;
    f.question_ids = question;
    f.answer_ids = answer;
    f.model_version = version;
    return f;
  }
};

// The start of a 16 x 16 baseline JPEG, up to its frame header: what the codec reads of a frame.
const std::string& TinyJpeg() {
  static const std::string* const jpeg =
      new std::string("\xFF\xD8\xFF\xC0\x00\x08\x08\x00\x10\x00\x10\x03", 12);
  return *jpeg;
}

// A FrameModel of callables that records what it was asked.
struct FakeModel {
  // Token t scores scores[t]; an error instead when score_error is set.
  std::vector<float> scores = {0.1f, 0.9f, 0.3f, 0.8f, 0.2f, 0.7f, 0.0f, 0.4f};
  absl::Status score_error;
  int score_calls = 0;
  int passes = 0;
  float dropout_p = 0;
  std::optional<TokenScore> kind;
  std::vector<std::optional<uint64_t>> seeds;
  int jpeg_quality = 0;

  FrameModel Bind() {
    FrameModel m;
    m.scores = [this](int p, float rate, TokenScore k,
                      std::optional<uint64_t> seed) -> absl::StatusOr<std::vector<float>> {
      ++score_calls;
      passes = p;
      dropout_p = rate;
      kind = k;
      seeds.push_back(seed);
      if (!score_error.ok()) return score_error;
      return scores;
    };
    m.jpeg = [this](int quality) -> absl::StatusOr<std::string> {
      jpeg_quality = quality;
      return TinyJpeg();
    };
    return m;
  }
};

// Stage 1 keeps every answer: a fixed threshold no entropy is below.
SampleStepOptions KeepAll() {
  SampleStepOptions o;
  o.uts.keep_fraction = 0;
  o.uts.entropy_alpha = 0;
  return o;
}

// Sample ids IsHeldOutSample holds out (`held` true) or not, for device "dev" at `fraction`.
std::vector<uint64_t> Ids(double fraction, bool held, int n) {
  std::vector<uint64_t> ids;
  for (uint64_t id = 1; static_cast<int>(ids.size()) < n; ++id) {
    if (compress::IsHeldOutSample("dev", id, fraction) == held) ids.push_back(id);
  }
  return ids;
}

std::vector<uint16_t> AllTokens() { return {0, 1, 2, 3, 4, 5, 6, 7}; }

TEST(SampleStepTest, HeldOutSamplesGoUpWholeWithEveryTokenAndNoScores) {
  SampleStepOptions o;
  o.uts.keep_fraction = 0;
  o.uts.entropy_alpha = 1e9f;  // stage 1 keeps nothing
  o.device_id = "dev";
  o.holdout_fraction = 0.3;
  SampleStep step(o);
  FakeAnswer a;
  FakeModel m;
  const uint64_t held = Ids(0.3, true, 1)[0];
  SampleDecision d = step.Run(a.Frame(), m.Bind(), held);
  EXPECT_TRUE(d.held_out);
  EXPECT_FALSE(d.stage1_kept);
  ASSERT_OK(d.status);
  ASSERT_TRUE(d.uplinked());
  EXPECT_EQ(m.score_calls, 0);
  EXPECT_EQ(d.sample.sample_id, held);
  EXPECT_THAT(d.sample.kept_indices, ElementsAreArray(AllTokens()));
  EXPECT_THAT(d.sample.features, ElementsAreArray(a.features));
  EXPECT_THAT(d.sample.prompt_tokens, ElementsAre(5, 6, 7));
  EXPECT_THAT(d.sample.answer_tokens, ElementsAre(9));

  // An id outside the share, below the threshold: neither held out nor kept, nothing built.
  d = step.Run(a.Frame(), m.Bind(), Ids(0.3, false, 1)[0]);
  EXPECT_FALSE(d.chosen());
  EXPECT_FALSE(d.uplinked());
  EXPECT_EQ(d.ordinal, 1u);
  EXPECT_EQ(m.score_calls, 0);

  // No share (the default): no id is held out.
  SampleStepOptions none = o;
  none.holdout_fraction = 0;
  SampleStep without(none);
  EXPECT_FALSE(without.Run(a.Frame(), m.Bind(), held).held_out);
}

// The random share: of the answers stage 1 passes over, about `random_share` go up all the
// same, through stage 2 like a kept one; which ones is a hash of the device and the id, the
// same on every run and apart from the guard's choice.
TEST(SampleStepTest, TheRandomShareUplinksSomeOfWhatStageOnePassesOver) {
  SampleStepOptions o;
  o.uts.keep_fraction = 0;
  o.uts.entropy_alpha = 1e9f;  // stage 1 keeps nothing
  o.uts.random_share = 0.25f;
  o.device_id = "dev";
  SampleStep step(o);
  FakeAnswer a;
  FakeModel m;
  int kept = 0;
  const int n = 2000;
  for (uint64_t id = 1; id <= n; ++id) {
    SampleDecision d = step.Run(a.Frame(), m.Bind(), id);
    EXPECT_FALSE(d.stage1_kept);
    EXPECT_EQ(d.random_kept, IsRandomShareSample("dev", id, 0.25));
    if (!d.random_kept) {
      EXPECT_FALSE(d.chosen());
      continue;
    }
    ++kept;
    ASSERT_OK(d.status);
    ASSERT_TRUE(d.uplinked());
    EXPECT_THAT(d.sample.kept_indices, ElementsAre(1, 3, 5, 7));  // stage 2's top half
  }
  EXPECT_EQ(m.score_calls, kept);
  EXPECT_NEAR(kept, 0.25 * n, 4 * std::sqrt(0.25 * 0.75 * n));
  // Another device's share is another set of ids; the guard's choice is independent of it.
  int same = 0, both = 0;
  for (uint64_t id = 1; id <= n; ++id) {
    same += IsRandomShareSample("dev", id, 0.25) == IsRandomShareSample("other", id, 0.25);
    both += IsRandomShareSample("dev", id, 0.25) && compress::IsHeldOutSample("dev", id, 0.25);
  }
  EXPECT_LT(same, n * 0.7);
  EXPECT_NEAR(both, 0.0625 * n, 4 * std::sqrt(0.0625 * n));
  // No share: nothing passed over goes up.
  SampleStepOptions none = o;
  none.uts.random_share = 0;
  SampleStep without(none);
  for (uint64_t id = 1; id <= 50; ++id) EXPECT_FALSE(without.Run(a.Frame(), m.Bind(), id).chosen());
  // Out of range is refused.
  o.uts.random_share = 1.0f;
  EXPECT_THAT(CheckUtsOptions(o.uts),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("random_share")));
}

TEST(SampleStepTest, HeldOutSamplesThatAlsoPassStageOneStillKeepEveryToken) {
  SampleStepOptions o = KeepAll();
  o.device_id = "dev";
  o.holdout_fraction = 0.3;
  SampleStep step(o);
  FakeAnswer a;
  FakeModel m;
  SampleDecision d = step.Run(a.Frame(), m.Bind(), Ids(0.3, true, 1)[0]);
  EXPECT_TRUE(d.held_out);
  EXPECT_TRUE(d.stage1_kept);
  EXPECT_THAT(d.sample.kept_indices, ElementsAreArray(AllTokens()));
  EXPECT_EQ(m.score_calls, 0);
}

TEST(SampleStepTest, StageOneKeepsByTheRunningQuantileAndStartsOverOnANewVersion) {
  SampleStepOptions o;
  o.uts.keep_fraction = 0.5f;
  SampleStep step(o);
  FakeModel m;
  FakeAnswer a;
  auto run = [&](float entropy, uint64_t version) {
    a.entropy = entropy;
    a.version = version;
    return step.Run(a.Frame(), m.Bind(), 1);
  };
  // An empty window: the first answer passes.
  SampleDecision d = run(1.0f, 0);
  EXPECT_TRUE(d.stage1_kept);
  EXPECT_EQ(d.threshold, -std::numeric_limits<float>::infinity());
  // Window {1}: the median is 1.
  d = run(2.0f, 0);
  EXPECT_TRUE(d.stage1_kept);
  EXPECT_EQ(d.threshold, 1.0f);
  // Window {1, 2}: the (1 - 0.5) quantile is 2.
  d = run(0.5f, 0);
  EXPECT_FALSE(d.stage1_kept);
  EXPECT_EQ(d.threshold, 2.0f);
  EXPECT_FALSE(d.chosen());
  // Another model answered: its entropies are not compared with the old model's.
  d = run(0.1f, 1);
  EXPECT_TRUE(d.stage1_kept);
  EXPECT_EQ(d.threshold, -std::numeric_limits<float>::infinity());
  d = run(0.05f, 1);
  EXPECT_FALSE(d.stage1_kept);
  // New settings start it over too; the answer count goes on.
  step.Reconfigure(o.uts, 0);
  d = run(0.01f, 1);
  EXPECT_TRUE(d.stage1_kept);
  EXPECT_EQ(d.ordinal, 5u);
  EXPECT_EQ(step.next_ordinal(), 6u);
}

TEST(SampleStepTest, KeepFractionZeroOrOneMeansTheFixedAlphaStrictly) {
  for (float kf : {0.0f, 1.0f}) {
    SampleStepOptions o;
    o.uts.keep_fraction = kf;
    o.uts.entropy_alpha = 0.5f;
    SampleStep step(o);
    FakeModel m;
    FakeAnswer a;
    a.entropy = 0.5f;
    SampleDecision d = step.Run(a.Frame(), m.Bind(), 1);
    EXPECT_FALSE(d.stage1_kept) << kf;
    EXPECT_EQ(d.threshold, 0.5f) << kf;
    a.entropy = 0.51f;
    EXPECT_TRUE(step.Run(a.Frame(), m.Bind(), 2).stage1_kept) << kf;
  }
}

TEST(SampleStepTest, StageTwoKeepsTheTopTokenRatioByScoreWithTheAnswersFeatures) {
  SampleStepOptions o = KeepAll();
  o.uts.token_ratio = 0.5f;
  o.uts.mc_passes = 5;
  o.uts.dropout_p = 0.2f;
  o.uts.score = TokenScore::kAttentionVariance;
  o.uts.precision = compress::FeaturePrecision::kInt8;
  SampleStep step(o);
  FakeAnswer a;
  a.version = 3;
  FakeModel m;
  SampleDecision d = step.Run(a.Frame(), m.Bind(), 42);
  ASSERT_OK(d.status);
  ASSERT_TRUE(d.uplinked());
  EXPECT_EQ(m.score_calls, 1);
  EXPECT_EQ(m.passes, 5);
  EXPECT_EQ(m.dropout_p, 0.2f);
  EXPECT_EQ(m.kind, TokenScore::kAttentionVariance);
  // Scores 0.9, 0.8, 0.7, 0.4 at tokens 1, 3, 5, 7.
  EXPECT_THAT(d.sample.kept_indices, ElementsAre(1, 3, 5, 7));
  EXPECT_THAT(d.sample.features,
              ElementsAre(1, 1.5, 1.25, 3, 3.5, 3.25, 5, 5.5, 5.25, 7, 7.5, 7.25));
  EXPECT_EQ(d.sample.sample_id, 42u);
  EXPECT_EQ(d.sample.model_version, 3u);
  EXPECT_EQ(d.sample.entropy, a.entropy);
  EXPECT_EQ(d.sample.grid_tokens, static_cast<uint32_t>(kTokens));
  EXPECT_EQ(d.sample.feature_dim, static_cast<uint32_t>(kDim));
  EXPECT_TRUE(d.sample.frame.empty());
  EXPECT_OK(compress::EncodeUplinkBatch({d.sample}, o.uts.precision).status());
}

TEST(SampleStepTest, StageTwoSeedsAreTheScoreSeedsHashOfTheOrdinalOrTheModelsOwn) {
  SampleStepOptions o = KeepAll();
  o.score_seed = 77;
  SampleStep seeded(o);
  FakeAnswer a;
  FakeModel m;
  for (uint64_t id : {10, 11, 12}) seeded.Run(a.Frame(), m.Bind(), id);
  ASSERT_EQ(m.seeds.size(), 3u);
  for (uint64_t n = 0; n < 3; ++n) {
    const uint64_t key[2] = {77, n};
    EXPECT_EQ(m.seeds[n], compress::Hash64(key, sizeof(key))) << n;
  }
  FakeModel own;
  SampleStep unseeded(KeepAll());
  unseeded.Run(a.Frame(), own.Bind(), 1);
  EXPECT_THAT(own.seeds, ElementsAre(std::nullopt));
}

TEST(SampleStepTest, ATokenRatioOfOneKeepsEveryTokenWithoutScoring) {
  SampleStepOptions o = KeepAll();
  o.uts.token_ratio = 1.0f;
  SampleStep step(o);
  FakeAnswer a;
  SampleDecision d = step.Run(a.Frame(), FrameModel(), 3);  // a model that cannot score
  ASSERT_OK(d.status);
  ASSERT_TRUE(d.uplinked());
  EXPECT_THAT(d.sample.kept_indices, ElementsAreArray(AllTokens()));
  EXPECT_THAT(d.sample.features, ElementsAreArray(a.features));
  EXPECT_EQ(d.stage2_seconds, 0);
}

TEST(SampleStepTest, KeepEverySampleKeepsEveryAnswerWhateverItsEntropy) {
  SampleStepOptions o;
  o.uts.keep_fraction = 0.5f;
  KeepEverySample(&o.uts);
  SampleStep step(o);
  FakeAnswer a;
  FakeModel m;
  for (float e : {0.0f, 3.0f, 0.0f, 0.0f}) {
    a.entropy = e;
    SampleDecision d = step.Run(a.Frame(), m.Bind(), 1);
    EXPECT_TRUE(d.stage1_kept) << e;
    EXPECT_TRUE(d.uplinked()) << e;
  }
}

// An offline driver binds scores it computed before: the step keeps their top tokens.
TEST(SampleStepTest, PrecomputedScoresSelectAsTheModelsWouldWithTiesToTheLowerIndex) {
  SampleStepOptions o = KeepAll();
  o.uts.token_ratio = 0.375f;  // 3 of 8
  SampleStep step(o);
  const std::vector<float> scores = {0.2f, 0.5f, 0.5f, 0.1f, 0.5f, 0.5f, 0.0f, 0.3f};
  FrameModel precomputed;
  precomputed.scores = [&](int, float, TokenScore, std::optional<uint64_t>) {
    return absl::StatusOr<std::vector<float>>(scores);
  };
  FakeAnswer a;
  SampleDecision d = step.Run(a.Frame(), precomputed, 1);
  ASSERT_OK(d.status);
  EXPECT_THAT(d.sample.kept_indices, ElementsAre(1, 2, 4));
  EXPECT_EQ(d.sample.kept_indices, SelectTokens(scores, {}, 0.375f, 0));
}

TEST(SampleStepTest, ReconfigureKeepsTheRandomTokenGeneratorGoing) {
  SampleStepOptions o = KeepAll();
  o.uts.random_tokens = true;
  o.uts.token_ratio = 0.5f;
  o.token_seed = 9;
  SampleStep step(o);
  std::mt19937_64 reference(9);
  FakeAnswer a;
  FakeModel m;
  EXPECT_EQ(step.Run(a.Frame(), m.Bind(), 1).sample.kept_indices,
            RandomTokenSelection(kTokens, {}, 0.5f, reference));
  // A scored stretch between draws takes nothing from the generator.
  UtsOptions scored = o.uts;
  scored.random_tokens = false;
  step.Reconfigure(scored, 0);
  step.Run(a.Frame(), m.Bind(), 2);
  step.Reconfigure(o.uts, 0);
  EXPECT_EQ(step.Run(a.Frame(), m.Bind(), 3).sample.kept_indices,
            RandomTokenSelection(kTokens, {}, 0.5f, reference));
}

TEST(SampleStepTest, VarianceBetaKeepsTokensAboveItAndAnEmptyChoiceIsNotUplinked) {
  SampleStepOptions o = KeepAll();
  o.uts.token_ratio = 0;
  o.uts.variance_beta = 0.75f;
  SampleStep step(o);
  FakeAnswer a;
  FakeModel m;
  SampleDecision d = step.Run(a.Frame(), m.Bind(), 1);
  EXPECT_THAT(d.sample.kept_indices, ElementsAre(1, 3));
  EXPECT_TRUE(d.uplinked());
  m.scores.assign(kTokens, 0.0f);
  d = step.Run(a.Frame(), m.Bind(), 2);
  EXPECT_TRUE(d.chosen());
  EXPECT_OK(d.status);
  EXPECT_THAT(d.sample.kept_indices, IsEmpty());
  EXPECT_FALSE(d.uplinked());
}

TEST(SampleStepTest, RandomTokensDrawReproduciblyFromOneGeneratorWithoutScores) {
  SampleStepOptions o = KeepAll();
  o.uts.random_tokens = true;
  o.uts.token_ratio = 0.25f;
  FakeAnswer a;
  FakeModel m;
  std::mt19937_64 reference(0x5eed);  // the default token_seed
  SampleStep step(o);
  SampleStep again(o);
  for (uint64_t id = 1; id <= 4; ++id) {
    SampleDecision d = step.Run(a.Frame(), m.Bind(), id);
    ASSERT_TRUE(d.uplinked());
    EXPECT_EQ(d.sample.kept_indices.size(), 2u);
    EXPECT_EQ(d.sample.kept_indices, RandomTokenSelection(kTokens, {}, 0.25f, reference)) << id;
    EXPECT_EQ(again.Run(a.Frame(), m.Bind(), id).sample.kept_indices, d.sample.kept_indices);
  }
  EXPECT_EQ(m.score_calls, 0);
  // Another seed draws other tokens.
  o.token_seed = 1;
  SampleStep other(o);
  std::mt19937_64 reference_other(1);
  EXPECT_EQ(other.Run(a.Frame(), m.Bind(), 1).sample.kept_indices,
            RandomTokenSelection(kTokens, {}, 0.25f, reference_other));
}

TEST(SampleStepTest, JpegCarriesTheFrameAndTheKeptIndices) {
  SampleStepOptions o = KeepAll();
  o.uts.precision = compress::FeaturePrecision::kJpeg;
  SampleStep step(o);
  FakeAnswer a;
  FakeModel m;
  SampleDecision d = step.Run(a.Frame(), m.Bind(), 7);
  ASSERT_OK(d.status);
  ASSERT_TRUE(d.uplinked());
  EXPECT_EQ(m.jpeg_quality, kFrameJpegQuality);
  EXPECT_EQ(d.sample.frame, TinyJpeg());
  EXPECT_THAT(d.sample.features, IsEmpty());
  EXPECT_THAT(d.sample.kept_indices, ElementsAre(1, 3, 5, 7));
  EXPECT_OK(compress::EncodeUplinkBatch({d.sample}, o.uts.precision).status());

  // A model that cannot send frames: the sample is reported, not uplinked.
  FrameModel no_frames = m.Bind();
  no_frames.jpeg = nullptr;
  d = step.Run(a.Frame(), no_frames, 8);
  EXPECT_THAT(d.status, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_FALSE(d.uplinked());
}

TEST(SampleStepTest, AScoringErrorIsReportedNotUplinked) {
  SampleStep step(KeepAll());
  FakeAnswer a;
  FakeModel m;
  m.score_error = absl::InvalidArgumentError("dropout_p must be in (0, 1)");
  SampleDecision d = step.Run(a.Frame(), m.Bind(), 1);
  EXPECT_TRUE(d.stage1_kept);
  EXPECT_THAT(d.status, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dropout_p")));
  EXPECT_FALSE(d.uplinked());
  // A wrong number of scores is the model's fault, reported too.
  m.score_error = absl::OkStatus();
  m.scores.resize(3);
  d = step.Run(a.Frame(), m.Bind(), 2);
  EXPECT_THAT(d.status, StatusIs(absl::StatusCode::kInternal));
  EXPECT_FALSE(d.uplinked());
}

TEST(SampleStepTest, ASampleOverTheCodecsLimitsIsReportedNeverTruncated) {
  SampleStepOptions o = KeepAll();
  o.limits.max_prompt_tokens = 2;
  SampleStep step(o);
  FakeAnswer a;  // a 3-token question
  FakeModel m;
  SampleDecision d = step.Run(a.Frame(), m.Bind(), 1);
  EXPECT_THAT(d.status, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_FALSE(d.uplinked());
  // The default limits: an answer longer than 128 tokens.
  SampleStep defaults(KeepAll());
  a.answer.assign(129, 3);
  d = defaults.Run(a.Frame(), m.Bind(), 2);
  EXPECT_THAT(d.status, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_FALSE(d.uplinked());
}

TEST(SampleStepTest, MakeUplinkSampleRefusesFeaturesThatAreNotTheGrid) {
  FakeAnswer a;
  a.features.pop_back();
  EXPECT_THAT(MakeUplinkSample(a.Frame(), {0}, compress::FeaturePrecision::kFp16, "", 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace cdcca::device
