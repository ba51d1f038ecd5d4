// `cdcca eval vqa` and `cdcca eval aokvqa` on the fixtures in tests/fixtures/eval/, whose
// expected figures were derived by hand from the official evaluation code (each
// question's derivation is in the *_expected.json file next to it).
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "datasets/commands.h"
#include "datasets/formats.h"
#include "datasets/metrics.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"

ABSL_DECLARE_FLAG(std::string, questions);
ABSL_DECLARE_FLAG(std::string, annotations);
ABSL_DECLARE_FLAG(std::string, results);
ABSL_DECLARE_FLAG(std::string, predictions);

namespace cdcca::datasets {
namespace {

using Json = nlohmann::json;

std::string Fixture(const std::string& name) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/eval/" + name;
}

Json ReadJson(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return Json::parse(in);
}

// Runs `cdcca eval <benchmark>` and returns the JSON it prints on stdout.
Json RunEval(const std::string& benchmark) {
  ::testing::internal::CaptureStdout();
  const int rc = EvalCommand({benchmark});
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(rc, 0);
  return Json::parse(out);
}

TEST(EvalFixtureTest, VqaPerQuestionAccuracyMatchesHandDerivation) {
  ASSERT_OK_AND_ASSIGN(std::vector<VqaRecord> records,
                       LoadVqaV2(Fixture("vqa_questions.json"), Fixture("vqa_annotations.json")));
  ASSERT_OK_AND_ASSIGN(auto results, LoadVqaResults(Fixture("vqa_results.json")));
  const Json expected = ReadJson(Fixture("vqa_expected.json"));
  ASSERT_EQ(records.size(), expected["questions"].size());
  for (size_t i = 0; i < records.size(); ++i) {
    const Json& e = expected["questions"][i];
    ASSERT_EQ(records[i].question_id, e["question_id"].get<int64_t>());
    EXPECT_NEAR(VqaAccuracy(results.at(records[i].question_id), records[i].answers),
                e["accuracy"].get<double>(), 1e-12)
        << "question " << records[i].question_id << ": " << e["derivation"].get<std::string>();
  }
}

TEST(EvalFixtureTest, VqaCommandReportsOfficialBreakdowns) {
  absl::SetFlag(&FLAGS_questions, Fixture("vqa_questions.json"));
  absl::SetFlag(&FLAGS_annotations, Fixture("vqa_annotations.json"));
  absl::SetFlag(&FLAGS_results, Fixture("vqa_results.json"));
  const Json out = RunEval("vqa");
  const Json expected = ReadJson(Fixture("vqa_expected.json"));
  EXPECT_DOUBLE_EQ(out["overall"].get<double>(), expected["overall"].get<double>());
  for (const char* key : {"perAnswerType", "perQuestionType"}) {
    ASSERT_EQ(out[key].size(), expected[key].size()) << key;
    for (const auto& [type, value] : expected[key].items()) {
      ASSERT_TRUE(out[key].contains(type)) << key << " lacks " << type;
      EXPECT_DOUBLE_EQ(out[key][type].get<double>(), value.get<double>()) << key << " " << type;
    }
  }
}

TEST(EvalFixtureTest, AokvqaCommandDoesNotRound) {
  absl::SetFlag(&FLAGS_annotations, Fixture("aokvqa_annotations.json"));
  absl::SetFlag(&FLAGS_predictions, Fixture("aokvqa_predictions.json"));
  const Json out = RunEval("aokvqa");
  const Json expected = ReadJson(Fixture("aokvqa_expected.json"));
  EXPECT_NEAR(out["MC"].get<double>(), expected["MC"].get<double>(), 1e-9);
  // 66.666..., not 66.67.
  EXPECT_NEAR(out["DA"].get<double>(), expected["DA"].get<double>(), 1e-9);
  EXPECT_NEAR(out["DA"].get<double>(), 200.0 / 3, 1e-9);
}

}  // namespace
}  // namespace cdcca::datasets
