// `cdcca adapt-eval` on a Hugging Face pair (sim/adapt_eval_pair.h), on the tiny LLaVA fixture
// and a few fog scenes: every (arm, learner) row is measured from the same starting student,
// stage 1 and the arms keep what they must, and a pair with two towers is refused.
#include "sim/adapt_eval_pair.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "datasets/domain.h"
#include "datasets/shifts.h"
#include "gmock/gmock.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::sim {
namespace {

using ::cdcca::testing::StatusIs;

std::string Fixture(const std::string& name) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + name;
}

AdaptEvalOptions SmallRun() {
  AdaptEvalOptions o;
  o.domain = datasets::ImageShiftDomain(datasets::ImageShift::kFog, 4);
  o.domain.name = "fog severity 4";
  o.stream_scenes = 2;
  o.test_scenes = 1;
  o.mc_passes = 4;
  o.keep_fraction = 0.5f;
  o.arms = {{"all", TokenSelection::kAll, 1.0f, ""},
            {"uts-variance_probe-50", TokenSelection::kUts, 0.5f, "variance_probe"},
            {"random-50", TokenSelection::kRandom, 0.5f, ""}};
  o.learners = {"pl", "akd"};
  o.job.max_steps = 3;
  o.job.batch_size = 2;
  o.job.max_answer_tokens = 4;
  o.max_answer_tokens = 4;
  o.precision = "int8";
  o.progress = [](const std::string&) {};
  return o;
}

EvalPairOptions Pair(const std::string& teacher, const std::string& student) {
  EvalPairOptions p;
  p.teacher_dir = Fixture(teacher);
  p.student_base_dir = Fixture(student);
  p.student_template = "llava";
  p.adapters.lora_rank = 4;
  p.adapters.lora_alpha = 8;
  return p;
}

TEST(AdaptEvalPairTest, EveryArmAndLearnerIsMeasuredFromTheSameStudent) {
  absl::StatusOr<AdaptReport> r =
      RunHubAdaptEval(SmallRun(), Pair("llava_clip_llama", "llava_clip_llama"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stream_samples, 10);  // five questions a scene
  EXPECT_GT(r->stage1_samples, 0);
  EXPECT_LT(r->stage1_samples, r->stream_samples);
  EXPECT_GT(r->test_questions, 0);
  ASSERT_EQ(r->rows.size(), 6u);
  // The UTS arm scores by VIS, and says so.
  EXPECT_EQ(r->rows[2].arm, "uts-vis-50");
  for (const AdaptRow& row : r->rows) {
    EXPECT_EQ(row.samples, r->stage1_samples) << row.arm;
    if (row.arm == "all") {
      EXPECT_DOUBLE_EQ(row.tokens_kept, 1.0);
    } else {
      EXPECT_NEAR(row.tokens_kept, 0.5, 0.05) << row.arm;
    }
    EXPECT_GE(row.accuracy, 0.0);
    EXPECT_LE(row.accuracy, 100.0);
    EXPECT_DOUBLE_EQ(row.gain, row.accuracy - r->source_accuracy);
    EXPECT_FALSE(row.terms.empty());
  }
  // Each job starts from the same student: the same arm and learner again gives the same row.
  AdaptEvalOptions again = SmallRun();
  again.arms = {again.arms[0]};
  again.learners = {"pl"};
  absl::StatusOr<AdaptReport> r2 =
      RunHubAdaptEval(again, Pair("llava_clip_llama", "llava_clip_llama"));
  ASSERT_TRUE(r2.ok()) << r2.status();
  ASSERT_EQ(r2->rows.size(), 1u);
  EXPECT_DOUBLE_EQ(r2->rows[0].accuracy, r->rows[0].accuracy);
  ASSERT_EQ(r2->rows[0].terms.size(), r->rows[0].terms.size());
  EXPECT_DOUBLE_EQ(r2->rows[0].terms[0].last, r->rows[0].terms[0].last);
}

// A teacher-all arm (the teacher labels from every token, the student trains on the kept
// ones) runs beside its kept-tokens twin.
TEST(AdaptEvalPairTest, ATeacherAllArmRunsBesideItsTwin) {
  AdaptEvalOptions o = SmallRun();
  UplinkArm twin = o.arms[1];
  twin.teacher_all_tokens = true;
  o.arms = {o.arms[0], o.arms[1], twin};
  o.learners = {"pl", "akd"};
  absl::StatusOr<AdaptReport> r = RunHubAdaptEval(o, Pair("llava_clip_llama", "llava_clip_llama"));
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<std::string> rows;
  for (const AdaptRow& row : r->rows) rows.push_back(row.arm + " / " + row.learner);
  EXPECT_EQ(rows, (std::vector<std::string>{"all / pl", "all / akd", "uts-vis-50 / pl",
                                            "uts-vis-50 / akd", "uts-vis-50+teacher-all / pl",
                                            "uts-vis-50+teacher-all / akd"}));
  for (const AdaptRow& row : r->rows) {
    EXPECT_EQ(row.samples, r->stage1_samples) << row.arm;
    if (row.arm != "all") EXPECT_NEAR(row.tokens_kept, 0.5, 0.05) << row.arm;
  }
}

// A ground-truth arm trains on the benchmark's answers: its "teacher DA on the uplink" is
// that of the answers themselves (every scene question holds its answer at least five times
// in ten, so 100), and it runs on the same samples as its twin. The report has the clean
// accuracies of the same test questions beside the shifted ones.
TEST(AdaptEvalPairTest, AGroundTruthArmTrainsOnTheBenchmarksAnswers) {
  AdaptEvalOptions o = SmallRun();
  UplinkArm truth = o.arms[0];
  truth.name += "+ground-truth";
  truth.ground_truth = true;
  o.arms = {o.arms[0], truth};
  o.learners = {"pl"};
  absl::StatusOr<AdaptReport> r = RunHubAdaptEval(o, Pair("llava_clip_llama", "llava_clip_llama"));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->rows.size(), 2u);
  EXPECT_EQ(r->rows[1].arm, "all+ground-truth");
  EXPECT_EQ(r->rows[1].samples, r->rows[0].samples);
  EXPECT_DOUBLE_EQ(r->rows[1].teacher_uplink_accuracy, 100.0);
  for (double a : {r->clean_source_accuracy, r->clean_teacher_accuracy}) {
    EXPECT_GE(a, 0.0);
    EXPECT_LE(a, 100.0);
  }
  EXPECT_THAT(r->Markdown(), ::testing::HasSubstr("the shift makes"));
  EXPECT_THAT(r->Json(), ::testing::HasSubstr("shift_induced_lead"));
}

// With the vision side trainable, every job trains the student's tower from the frames the
// device would uplink: each arm runs and the adapted student answers the test scenes.
TEST(AdaptEvalPairTest, AVisionSideStudentTrainsFromTheFrames) {
  AdaptEvalOptions o = SmallRun();
  o.arms = {o.arms[0], o.arms[1]};
  o.learners = {"pl"};
  EvalPairOptions pair = Pair("llava_clip_llama", "llava_clip_llama");
  pair.adapters.lora_vision = true;
  absl::StatusOr<AdaptReport> r = RunHubAdaptEval(o, pair);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->rows.size(), 2u);
  for (const AdaptRow& row : r->rows) {
    EXPECT_EQ(row.samples, r->stage1_samples) << row.arm;
    EXPECT_FALSE(row.terms.empty()) << row.arm;
  }
}

TEST(AdaptEvalPairTest, RefusesAPairWithTwoTowersAndBadOptions) {
  EXPECT_THAT(RunHubAdaptEval(SmallRun(), Pair("llava_siglip_qwen2", "llava_clip_llama")).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  AdaptEvalOptions no_learner = SmallRun();
  no_learner.learners.clear();
  EXPECT_THAT(RunHubAdaptEval(no_learner, Pair("llava_clip_llama", "llava_clip_llama")).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace cdcca::sim
