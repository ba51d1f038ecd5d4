#include "distill/adapt_eval.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <set>

#include "datasets/tokenizer.h"
#include "model/family/checkpoint.h"
#include "model/family/config.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::distill {
namespace {

using ::cdcca::testing::StatusIs;

TEST(TopTokensTest, KeepsTheHighestScoresWithTiesToTheLowerIndex) {
  const std::vector<float> scores = {0.1f, 0.9f, 0.5f, 0.5f, 0.2f, 0.5f};
  EXPECT_EQ(TopTokens(scores, 0.5f), (std::vector<uint16_t>{1, 2, 3}));
  EXPECT_EQ(TopTokens(scores, 0.01f), (std::vector<uint16_t>{1}));  // at least one
  EXPECT_EQ(TopTokens(scores, 1.0f).size(), scores.size());
}

TEST(ParseLearnerSpecTest, AppliesOverridesToThePreset) {
  ASSERT_OK_AND_ASSIGN(DistillConfig akd, ParseLearnerSpec("akd+l_query=0+normalize=false"));
  EXPECT_EQ(akd.name, "akd+l_query=0+normalize=false");
  EXPECT_EQ(akd.feature_loss, FeatureLoss::kMse);
  EXPECT_EQ(akd.l_query, 0.0);
  EXPECT_FALSE(akd.normalize);
  ASSERT_OK_AND_ASSIGN(DistillConfig pl, ParseLearnerSpec("pl"));
  EXPECT_EQ(pl.feature_loss, FeatureLoss::kNone);
  EXPECT_THAT(ParseLearnerSpec("akd+l_query").status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseLearnerSpec("akd+bogus=1").status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseLearnerSpec("nope").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

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

TEST(BuildArmUplinkTest, ArmsKeepWhatTheyMust) {
  const StreamObservation obs = SmallObservation();
  std::mt19937_64 rng(3);
  ASSERT_OK_AND_ASSIGN(auto all,
                       BuildArmUplink(obs, {}, {"all", TokenSelection::kAll, 1, ""}, rng));
  ASSERT_EQ(all.size(), 3u);
  for (const auto& s : all) {
    EXPECT_EQ(s.kept_indices.size(), 8u);
    EXPECT_EQ(s.features, obs.samples[0].features);
  }
  ASSERT_OK_AND_ASSIGN(
      auto uts, BuildArmUplink(obs, {}, {"uts", TokenSelection::kUts, 0.5f, "attention_cv"}, rng));
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
        auto random, BuildArmUplink(obs, {}, {"random", TokenSelection::kRandom, 0.5f, ""}, rng));
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
                                                 {"all", TokenSelection::kAll, 1, ""}, rng));
  ASSERT_EQ(some.size(), 2u);
  EXPECT_EQ(some[1].sample_id, 2u);
  EXPECT_THAT(
      BuildArmUplink(obs, {}, {"uts", TokenSelection::kUts, 0.5f, "magnitude"}, rng).status(),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(BuildArmUplink(obs, {}, {"r", TokenSelection::kRandom, 0.0f, ""}, rng).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The whole pipeline on an untrained tiny family: every (arm, learner) gets a job and an
// evaluation, the arms uplink what they say, and the run is deterministic.
TEST(RunAdaptEvalTest, RunsEndToEndOnTinyModels) {
  ASSERT_OK_AND_ASSIGN(
      model::FamilyConfig family,
      model::LoadFamilyConfig(std::string(CDCCA_SOURCE_DIR) + "/configs/models/tiny.json"));
  torch::manual_seed(4);
  model::VisionEncoder encoder(family.vision);
  model::Blip2Tower teacher(family.teacher), student(family.student);
  const std::string dir = ::testing::TempDir() + "/adapt_eval_tiny";
  std::filesystem::remove_all(dir);
  ASSERT_OK(model::SaveFamily(dir, family, encoder, teacher, student, "",
                              datasets::Tokenizer::SceneLanguage().tokens()));

  AdaptEvalOptions o;
  o.checkpoint_dir = dir;
  o.precision = "fp32";
  o.domain = datasets::ImageShiftDomain(datasets::ImageShift::kFog, 4);
  o.domain.name = "fog 4";
  o.stream_scenes = 6;
  o.test_scenes = 3;
  o.mc_passes = 4;
  o.keep_fraction = 0.5f;
  o.arms = {{"all", TokenSelection::kAll, 1, ""},
            {"uts-50", TokenSelection::kUts, 0.5f, "attention_cv"},
            {"random-50", TokenSelection::kRandom, 0.5f, ""}};
  o.learners = {"pl", "akd"};
  o.job.max_steps = 2;
  o.job.batch_size = 4;
  o.threads = 1;
  o.force_cpu = true;
  std::vector<std::string> lines;
  o.progress = [&](const std::string& line) { lines.push_back(line); };

  ASSERT_OK_AND_ASSIGN(AdaptReport report, RunAdaptEval(o));
  EXPECT_EQ(report.stream_samples, 6 * 5);
  EXPECT_GE(report.stage1_samples, 15);  // ties at the quantile are kept
  EXPECT_LT(report.stage1_samples, 30);
  EXPECT_EQ(report.test_questions, 3 * 5);
  ASSERT_EQ(report.rows.size(), 6u);
  for (const AdaptRow& r : report.rows) {
    EXPECT_EQ(r.samples, report.stage1_samples);
    EXPECT_DOUBLE_EQ(r.gain, r.accuracy - report.source_accuracy);
    EXPECT_FALSE(r.terms.empty());
  }
  EXPECT_EQ(report.rows[0].arm, "all");
  EXPECT_EQ(report.rows[0].learner, "pl");
  EXPECT_DOUBLE_EQ(report.rows[0].tokens_kept, 1.0);
  // Half of the tiny family's 65 visual tokens (class + 8 x 8 patches), rounded up.
  EXPECT_DOUBLE_EQ(report.rows[2].tokens_kept, 33.0 / 65.0);  // uts-50, pl
  EXPECT_DOUBLE_EQ(report.rows[4].tokens_kept, 33.0 / 65.0);  // random-50, pl
  // AKD's job carries its alignment terms; PL's only cross-entropy.
  EXPECT_EQ(report.rows[0].terms.size(), 2u);  // total, ce
  EXPECT_EQ(report.rows[1].terms.size(), 4u);  // total, ce, query, repr
  EXPECT_GE(lines.size(), 2u + 6u);
  EXPECT_NE(report.Markdown().find("| uts-50 | akd |"), std::string::npos);
  EXPECT_NE(report.Json().find("\"arm\": \"random-50\""), std::string::npos);

  ASSERT_OK_AND_ASSIGN(AdaptReport again, RunAdaptEval(o));
  for (size_t i = 0; i < report.rows.size(); ++i) {
    EXPECT_DOUBLE_EQ(again.rows[i].accuracy, report.rows[i].accuracy) << report.rows[i].arm;
    EXPECT_DOUBLE_EQ(again.rows[i].terms[0].last, report.rows[i].terms[0].last);
  }

  // A teacher that reads all tokens is the Hugging Face pairs' (sim/hub_adapt_eval.h): a
  // family's learner refuses it before any work.
  AdaptEvalOptions teacher_all = o;
  teacher_all.arms[1].teacher_all_tokens = true;
  EXPECT_THAT(RunAdaptEval(teacher_all).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace cdcca::distill
