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
  EXPECT_THAT(ParseDistillSettings(R"({"job": {"max_stepz": 3}})").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_stepz")));
}

}  // namespace
}  // namespace cdcca::distill
