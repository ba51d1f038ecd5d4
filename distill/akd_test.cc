// The learner specs of `cdcca adapt-eval --learners`: a preset with
// overrides, refused with INVALID_ARGUMENT when malformed.
#include "distill/akd.h"

#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace cdcca::distill {
namespace {

using ::cdcca::testing::StatusIs;

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

}  // namespace
}  // namespace cdcca::distill
