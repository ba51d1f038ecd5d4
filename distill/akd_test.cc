// The learner specs of `cdcca adapt-eval --learners`: a preset with
// overrides, refused with INVALID_ARGUMENT when malformed; the distillation settings files.
#include "distill/akd.h"

#include <gtest/gtest.h>

#include "gmock/gmock.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::distill {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::HasSubstr;

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

// configs/distill/akd.json is what the experiments name; a cloud started without
// --distill_config trains with the presets. Both must be the defaults table.
TEST(DistillSettingsTest, TheCommittedFileIsTheDefaultsTable) {
  ASSERT_OK_AND_ASSIGN(DistillSettings file, LoadDistillSettings(std::string(CDCCA_SOURCE_DIR) +
                                                                 "/configs/distill/akd.json"));
  ASSERT_OK_AND_ASSIGN(DistillConfig preset, PresetDistillConfig("akd"));
  EXPECT_EQ(file.learner.feature_loss, preset.feature_loss);
  EXPECT_EQ(file.learner.l_ce, preset.l_ce);
  EXPECT_EQ(file.learner.l_query, preset.l_query);
  EXPECT_EQ(file.learner.l_repr, preset.l_repr);
  EXPECT_EQ(file.learner.l_kl, preset.l_kl);
  EXPECT_EQ(file.learner.temperature, preset.temperature);
  EXPECT_EQ(file.learner.normalize, preset.normalize);
  EXPECT_EQ(file.learner.repr_answer_only, preset.repr_answer_only);
  EXPECT_EQ(file.learner.ridge_init, preset.ridge_init);
  EXPECT_EQ(file.learner.ridge_lambda, preset.ridge_lambda);
  const JobOptions defaults;
  EXPECT_EQ(file.job.max_steps, defaults.max_steps);
  EXPECT_EQ(file.job.batch_size, defaults.batch_size);
  EXPECT_EQ(file.job.lr, defaults.lr);
  EXPECT_EQ(file.job.weight_decay, defaults.weight_decay);
  EXPECT_EQ(file.job.replay_fraction, defaults.replay_fraction);
  EXPECT_EQ(file.job.max_answer_tokens, defaults.max_answer_tokens);
  EXPECT_EQ(file.job.seed, defaults.seed);
  EXPECT_EQ(file.job.prepare_batch, defaults.prepare_batch);
  // Every baseline keeps the same CE and logit KL; only its feature term differs.
  for (const char* name : {"pl", "pkd", "cwd"}) {
    ASSERT_OK_AND_ASSIGN(DistillConfig baseline, PresetDistillConfig(name));
    EXPECT_EQ(baseline.l_ce, preset.l_ce) << name;
    EXPECT_EQ(baseline.l_kl, preset.l_kl) << name;
    EXPECT_EQ(baseline.temperature, preset.temperature) << name;
  }
}

TEST(DistillSettingsTest, TheCommittedFileLoadsAndKeysNoJobHonoursAreRefused) {
  ASSERT_OK_AND_ASSIGN(DistillSettings s, LoadDistillSettings(std::string(CDCCA_SOURCE_DIR) +
                                                              "/configs/distill/akd.json"));
  EXPECT_EQ(s.learner.name, "akd");
  EXPECT_EQ(s.job.max_steps, 200);
  EXPECT_EQ(s.job.time_budget_s, 0.0);
  ASSERT_OK_AND_ASSIGN(DistillSettings b, ParseDistillSettings(R"({"job": {"time_budget_s": 30,
                                                                 "num_threads": 2}})"));
  EXPECT_EQ(b.job.time_budget_s, 30.0);
  EXPECT_EQ(b.job.num_threads, 2);
  // Keys a job once read and then ignored: a clear refusal, not silence.
  EXPECT_THAT(ParseDistillSettings(R"({"job": {"use_cuda": true}})").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--device")));
  EXPECT_THAT(ParseDistillSettings(R"({"job": {"student_dropout": false}})").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("eval mode")));
  // fp8_base: one of its three modes, or true / false for on / off.
  for (const auto& [text, mode] : std::vector<std::pair<std::string, std::string>>{
           {R"("native")", "native"}, {R"("off")", "off"}, {"true", "on"}, {"false", "off"}}) {
    ASSERT_OK_AND_ASSIGN(DistillSettings f,
                         ParseDistillSettings(R"({"job": {"fp8_base": )" + text + "}}"));
    EXPECT_EQ(f.job.fp8_base, mode) << text;
  }
  EXPECT_THAT(ParseDistillSettings(R"({"job": {"fp8_base": "fp8"}})").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fp8_base")));
  ASSERT_OK_AND_ASSIGN(DistillSettings p, ParseDistillSettings(R"({"job": {"prepare_batch": 4}})"));
  EXPECT_EQ(p.job.prepare_batch, 4);
  EXPECT_THAT(ParseDistillSettings(R"({"job": {"prepare_batch": -1}})").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prepare_batch")));
  EXPECT_THAT(ParseDistillSettings(R"({"job": {"max_stepz": 3}})").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_stepz")));
}

}  // namespace
}  // namespace cdcca::distill
