#include "datasets/formats.h"

#include <filesystem>
#include <fstream>

#include "absl/flags/flag.h"
#include "datasets/commands.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"

ABSL_DECLARE_FLAG(std::string, questions);
ABSL_DECLARE_FLAG(std::string, annotations);
ABSL_DECLARE_FLAG(std::string, results);
ABSL_DECLARE_FLAG(std::string, predictions);

namespace cdcca::datasets {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class FormatsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           (std::string("cdcca_formats_") +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const char* name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }
  std::string Vqa10(const std::string& a, int n, const std::string& b) {
    nlohmann::json arr = nlohmann::json::array();
    for (int i = 0; i < 10; ++i) arr.push_back({{"answer", i < n ? a : b}, {"answer_id", i + 1}});
    return arr.dump();
  }
  std::filesystem::path dir_;
};

TEST_F(FormatsTest, VqaV2LoadAndEval) {
  const std::string q = Write("q.json", R"({"questions": [
      {"question_id": 1, "image_id": 7, "question": "Is it red?"},
      {"question_id": 2, "image_id": 7, "question": "How many?"}]})");
  const std::string a = Write("a.json", R"({"annotations": [
      {"question_id": 1, "image_id": 7, "question_type": "is it", "answer_type": "yes/no",
       "multiple_choice_answer": "yes", "answers": )" +
                                            Vqa10("yes", 10, "") + R"(},
      {"question_id": 2, "image_id": 7, "question_type": "how many", "answer_type": "number",
       "multiple_choice_answer": "2", "answers": )" +
                                            Vqa10("2", 2, "3") + "}]}");
  ASSERT_OK_AND_ASSIGN(std::vector<VqaRecord> recs, LoadVqaV2(q, a));
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_EQ(recs[0].question, "Is it red?");
  EXPECT_EQ(recs[1].answers.size(), 10u);
  EXPECT_EQ(recs[1].answer_type, "number");

  const std::string r = Write("r.json", R"([{"question_id": 1, "answer": "Yes"},
                                            {"question_id": 2, "answer": "two"}])");
  absl::SetFlag(&FLAGS_questions, q);
  absl::SetFlag(&FLAGS_annotations, a);
  absl::SetFlag(&FLAGS_results, r);
  ::testing::internal::CaptureStdout();
  ASSERT_EQ(EvalCommand({"vqa"}), 0);
  const nlohmann::json out = nlohmann::json::parse(::testing::internal::GetCapturedStdout());
  // q1: ten identical "yes", so the prediction "Yes" is not lower-cased (official 2021
  // code): 0. q2: the annotators differ, "two" -> "2" matches 2 of 10: 60. (0 + 60) / 2.
  EXPECT_DOUBLE_EQ(out["overall"].get<double>(), 30.0);
  EXPECT_DOUBLE_EQ(out["perAnswerType"]["yes/no"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(out["perAnswerType"]["number"].get<double>(), 60.0);
  EXPECT_DOUBLE_EQ(out["perQuestionType"]["how many"].get<double>(), 60.0);
}

TEST_F(FormatsTest, MalformedFilesNameFileAndField) {
  const std::string q = Write("q.json", R"({"questions": [{"question_id": 1, "image_id": 7}]})");
  const std::string a = Write("a.json", R"({"annotations": []})");
  EXPECT_THAT(LoadVqaV2(q, a), StatusIs(absl::StatusCode::kInvalidArgument,
                                        HasSubstr("q.json: questions[0].question: missing")));
  const std::string a2 = Write("a2.json", R"({"annotations": [{"question_id": 1, "image_id": 7,
      "question_type": "x", "answer_type": "other", "multiple_choice_answer": "x",
      "answers": "yes"}]})");
  const std::string q2 = Write("q2.json", R"({"questions": []})");
  EXPECT_THAT(LoadVqaV2(q2, a2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a2.json: annotations[0].answers: expected an array")));
  EXPECT_THAT(LoadVqaV2((dir_ / "none.json").string(), a), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(LoadAokvqa(Write("bad.json", "{not json")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not valid JSON")));
  EXPECT_THAT(
      LoadAokvqa(Write("k.json", R"([{"question_id": "a", "image_id": 1, "question": "q",
      "choices": ["x", "y"], "correct_choice_idx": 5}])")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("k.json: [0].correct_choice_idx")));
  EXPECT_THAT(LoadCaptionAnnotations(Write("c.json", R"({"images": [{"id": 1, "file_name": "a"}],
      "annotations": [{"image_id": 2, "caption": "x"}]})")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("annotations[0].image_id: 2 is not in images")));
  EXPECT_THAT(LoadCaptionResults(Write("cr.json", R"([{"image_id": 1, "caption": "a"},
      {"image_id": 1, "caption": "b"}])")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than one caption")));
}

TEST_F(FormatsTest, AokvqaLoadAndEval) {
  const std::string d = Write("d.json", R"([
    {"question_id": "q1", "image_id": 5, "question": "Which would you wear on your feet?",
     "choices": ["bag", "sandal", "coat", "dress"], "correct_choice_idx": 1,
     "direct_answers": ["sandal","sandal","sandals","sandal","flip flop","sandal","sandal",
                        "sandals","sandal","sandal"],
     "difficult_direct_answer": false, "rationales": ["..."]},
    {"question_id": "q2", "image_id": 6, "question": "Hard?",
     "choices": ["a", "b", "c", "d"], "correct_choice_idx": 0,
     "direct_answers": ["a","a","a","a","a","a","a","a","a","a"],
     "difficult_direct_answer": true}])");
  ASSERT_OK_AND_ASSIGN(std::vector<AokvqaRecord> recs, LoadAokvqa(d));
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_EQ(recs[0].correct_choice_idx, 1);
  EXPECT_TRUE(recs[1].difficult_direct_answer);
  const std::string p = Write("p.json", R"({"q1": {"multiple_choice": "sandal",
      "direct_answer": "sandals"}, "q2": {"multiple_choice": "b", "direct_answer": "b"}})");
  absl::SetFlag(&FLAGS_annotations, d);
  absl::SetFlag(&FLAGS_predictions, p);
  ::testing::internal::CaptureStdout();
  ASSERT_EQ(EvalCommand({"aokvqa"}), 0);
  const nlohmann::json out = nlohmann::json::parse(::testing::internal::GetCapturedStdout());
  EXPECT_DOUBLE_EQ(out["MC"].get<double>(), 50.0);
  // q2 is difficult: only q1, 2 of 10 -> 2/3, unrounded as the official code reports it.
  EXPECT_NEAR(out["DA"].get<double>(), 200.0 / 3, 1e-9);
}

TEST_F(FormatsTest, CaptionsLoadAndEval) {
  const std::string a = Write("caps.json", R"({"images": [
      {"id": 1, "file_name": "x.png", "domain": "out-domain"}, {"id": 2, "file_name": "y.png"}],
      "annotations": [{"image_id": 1, "id": 10, "caption": "A b."},
                      {"image_id": 2, "id": 11, "caption": "c d"}]})");
  ASSERT_OK_AND_ASSIGN(std::vector<CaptionImage> imgs, LoadCaptionAnnotations(a));
  ASSERT_EQ(imgs.size(), 2u);
  EXPECT_EQ(imgs[0].domain, "out-domain");
  EXPECT_THAT(imgs[1].captions, ElementsAre("c d"));
  const std::string r = Write("res.json", R"([{"image_id": 1, "caption": "a b"},
                                              {"image_id": 2, "caption": "c d"}])");
  absl::SetFlag(&FLAGS_annotations, a);
  absl::SetFlag(&FLAGS_results, r);
  ::testing::internal::CaptureStdout();
  ASSERT_EQ(EvalCommand({"caption"}), 0);
  const nlohmann::json out = nlohmann::json::parse(::testing::internal::GetCapturedStdout());
  EXPECT_NEAR(out["CIDEr"].get<double>(), 5.0, 1e-9);  // see metrics_test CiderDHandComputed
  EXPECT_NEAR(out["BLEU-1"].get<double>(), 1.0, 1e-6);
  EXPECT_EQ(EvalCommand({"nope"}), 2);
}

TEST_F(FormatsTest, PngRoundTripThroughOpenCv) {
  Image img(5, 4);
  for (size_t i = 0; i < img.pixels.size(); ++i) img.pixels[i] = static_cast<uint8_t>(i * 7);
  ASSERT_OK(WritePng(img, (dir_ / "t.png").string()));
  ASSERT_OK_AND_ASSIGN(Image back, LoadImageFile(dir_.string(), "t.png"));
  EXPECT_EQ(back.pixels, img.pixels);  // PNG is lossless and channel order is kept
  EXPECT_THAT(LoadImageFile(dir_.string(), "missing.png"), StatusIs(absl::StatusCode::kNotFound));
  Write("junk.png", "not an image");
  EXPECT_THAT(LoadImageFile(dir_.string(), "junk.png"), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(CocoFileName("COCO_val2014_", 42), "COCO_val2014_000000000042.jpg");
}

}  // namespace
}  // namespace cdcca::datasets
