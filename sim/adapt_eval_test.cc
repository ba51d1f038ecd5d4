#include "sim/adapt_eval.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

#include "device/uts.h"
#include "gmock/gmock.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::sim {
namespace {

using ::cdcca::testing::StatusIs;

// An observation of 3 samples over 2 scenes, 8 tokens of width 2, feature = token index.
StreamObservation SmallObservation() {
  StreamObservation obs;
  obs.num_tokens = 8;
  for (int i = 0; i < 3; ++i) {
    compress::UplinkSample s;
    s.sample_id = i;
    s.grid_tokens = 8;
    s.feature_dim = 2;
    for (int k = 0; k < 8; ++k) {
      s.kept_indices.push_back(k);
      s.features.push_back(static_cast<float>(k));
      s.features.push_back(static_cast<float>(-k));
    }
    s.prompt_tokens = {1, 7};
    obs.samples.push_back(s);
    obs.scene_of_sample.push_back(i == 2 ? 1 : 0);
  }
  obs.scene_scores.emplace_back(
      "attention_cv",
      std::vector<std::vector<float>>{{0, 1, 2, 3, 4, 5, 6, 7}, {7, 6, 5, 4, 3, 2, 1, 0}});
  return obs;
}

// The ground-truth arm's answer is the most frequent of a question's answers (the first of
// those tied); a question without answers (a benchmark without them) refuses the arm.
TEST(GroundTruthAnswerTest, TheMostFrequentAnswerOrAClearRefusal) {
  ASSERT_OK_AND_ASSIGN(std::string a,
                       GroundTruthAnswer({"red", "blue", "blue", "red", "blue"}, "q"));
  EXPECT_EQ(a, "blue");
  ASSERT_OK_AND_ASSIGN(a, GroundTruthAnswer({"two", "three", "three", "two"}, "q"));
  EXPECT_EQ(a, "two");
  EXPECT_THAT(GroundTruthAnswer({}, "question 3 of stream scene 1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(::testing::HasSubstr("question 3 of stream scene 1"),
                                        ::testing::HasSubstr("needs a benchmark that has them"))));
}

TEST(BuildArmUplinkTest, ArmsKeepWhatTheyMust) {
  const StreamObservation obs = SmallObservation();
  device::SampleStepOptions step_options;
  step_options.token_seed = 3;
  device::SampleStep step(step_options);
  ASSERT_OK_AND_ASSIGN(auto all,
                       BuildArmUplink(obs, {}, {"all", TokenSelection::kAll, 1, ""}, step));
  ASSERT_EQ(all.size(), 3u);
  for (const auto& s : all) {
    EXPECT_EQ(s.kept_indices.size(), 8u);
    EXPECT_EQ(s.features, obs.samples[0].features);
  }
  ASSERT_OK_AND_ASSIGN(
      auto uts, BuildArmUplink(obs, {}, {"uts", TokenSelection::kUts, 0.5f, "attention_cv"}, step));
  // Scene 0 scores rise with the index, scene 1's fall: each keeps its own top half, and
  // the features travel with the kept indices.
  EXPECT_EQ(uts[0].kept_indices, (std::vector<uint16_t>{4, 5, 6, 7}));
  EXPECT_EQ(uts[2].kept_indices, (std::vector<uint16_t>{0, 1, 2, 3}));
  EXPECT_EQ(uts[0].features, (std::vector<float>{4, -4, 5, -5, 6, -6, 7, -7}));
  // Random at the same ratio: the same count, not the UTS choice every time, and
  // different draws for different samples.
  std::set<std::vector<uint16_t>> draws;
  bool differs_from_uts = false;
  for (int round = 0; round < 4; ++round) {
    ASSERT_OK_AND_ASSIGN(
        auto random, BuildArmUplink(obs, {}, {"random", TokenSelection::kRandom, 0.5f, ""}, step));
    for (size_t i = 0; i < random.size(); ++i) {
      EXPECT_EQ(random[i].kept_indices.size(), 4u);
      differs_from_uts |= random[i].kept_indices != uts[i].kept_indices;
      draws.insert(random[i].kept_indices);
      for (size_t j = 0; j < random[i].kept_indices.size(); ++j) {
        EXPECT_EQ(random[i].features[2 * j], static_cast<float>(random[i].kept_indices[j]));
      }
    }
  }
  EXPECT_TRUE(differs_from_uts);
  EXPECT_GT(draws.size(), 3u);
  // Stage 1 drops the samples it does not keep.
  ASSERT_OK_AND_ASSIGN(auto some, BuildArmUplink(obs, {true, false, true},
                                                 {"all", TokenSelection::kAll, 1, ""}, step));
  ASSERT_EQ(some.size(), 2u);
  EXPECT_EQ(some[1].sample_id, 2u);
  EXPECT_THAT(
      BuildArmUplink(obs, {}, {"uts", TokenSelection::kUts, 0.5f, "magnitude"}, step).status(),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(BuildArmUplink(obs, {}, {"r", TokenSelection::kRandom, 0.0f, ""}, step).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Each arm is the device's step: the same tokens as device::SampleStep run on the sample with
// the arm's settings, the random arm drawing on from the step's one generator across arms.
TEST(BuildArmUplinkTest, ArmsChooseAsTheDevicesStepWithOneGeneratorAcrossArms) {
  const StreamObservation obs = SmallObservation();
  device::SampleStepOptions step_options;
  step_options.token_seed = 11;
  device::SampleStep step(step_options);
  std::mt19937_64 reference(11);
  for (int arm = 0; arm < 2; ++arm) {
    ASSERT_OK_AND_ASSIGN(
        auto random,
        BuildArmUplink(obs, {}, {"random", TokenSelection::kRandom, 0.375f, ""}, step));
    ASSERT_OK_AND_ASSIGN(
        auto uts,
        BuildArmUplink(obs, {}, {"uts", TokenSelection::kUts, 0.375f, "attention_cv"}, step));
    for (size_t i = 0; i < obs.samples.size(); ++i) {
      EXPECT_EQ(random[i].kept_indices, device::RandomTokenSelection(8, {}, 0.375f, reference));
      EXPECT_EQ(
          uts[i].kept_indices,
          device::SelectTokens(obs.scene_scores[0].second[obs.scene_of_sample[i]], {}, 0.375f, 0));
    }
  }
}

}  // namespace
}  // namespace cdcca::sim
