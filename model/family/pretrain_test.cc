// `cdcca pretrain` on the tiny family (real Fashion-MNIST scenes, a few steps per stage),
// the padding plan of its training steps, and the shipped family configs.
#include "model/family/pretrain.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/family/blip2_tower.h"
#include "model/family/checkpoint.h"
#include "model/family/config.h"
#include "model/family/vision_encoder.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {
namespace {

using ::testing::ElementsAre;

size_t PaddedPositions(const std::vector<std::pair<size_t, size_t>>& lengths,
                       const std::vector<size_t>& starts) {
  size_t total = 0;
  for (size_t g = 0; g < starts.size(); ++g) {
    const size_t end = g + 1 < starts.size() ? starts[g + 1] : lengths.size();
    size_t tp = 0, ta = 0;
    for (size_t i = starts[g]; i < end; ++i) {
      tp = std::max(tp, lengths[i].first);
      ta = std::max(ta, lengths[i].second);
    }
    total += (end - starts[g]) * (tp + ta);
  }
  return total;
}

TEST(PaddingGroupsTest, EqualLengthsStayOneGroup) {
  EXPECT_THAT(PaddingGroups({{5, 2}, {5, 2}, {5, 2}}, 3), ElementsAre(0));
  EXPECT_TRUE(PaddingGroups({}, 3).empty());
}

TEST(PaddingGroupsTest, SplitsWhereTheLengthJumps) {
  // Six template questions and two knowledge questions twice as long.
  std::vector<std::pair<size_t, size_t>> lengths = {{6, 2}, {6, 2}, {7, 2},  {7, 2},
                                                    {7, 3}, {7, 3}, {14, 2}, {15, 3}};
  EXPECT_THAT(PaddingGroups(lengths, 2), ElementsAre(0, 6));
  const std::vector<size_t> three = PaddingGroups(lengths, 3);
  EXPECT_LE(three.size(), 3u);
  EXPECT_LT(PaddedPositions(lengths, three), PaddedPositions(lengths, {0, 6}));
  EXPECT_LT(PaddedPositions(lengths, {0, 6}), PaddedPositions(lengths, {0}));
  EXPECT_THAT(PaddingGroups(lengths, 1), ElementsAre(0));
}

TEST(PaddingGroupsTest, NoOtherSplitPadsLess) {
  std::vector<std::pair<size_t, size_t>> lengths = {{3, 4}, {4, 1}, {4, 2}, {5, 1},
                                                    {8, 1}, {8, 5}, {9, 1}};
  const size_t best = PaddedPositions(lengths, PaddingGroups(lengths, 2));
  for (size_t cut = 1; cut < lengths.size(); ++cut) {
    EXPECT_LE(best, PaddedPositions(lengths, {0, cut})) << "cut at " << cut;
  }
}

TEST(PretrainScheduleTest, ReadsTheQueryAuxiliaryWeightAndRejectsANegativeOne) {
  absl::StatusOr<PretrainSchedule> s = ParsePretrainSchedule(
      R"({"teacher": {"steps": 5, "query_aux": 0.25}, "student": {"steps": 7}})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FLOAT_EQ(s->teacher.query_aux, 0.25f);
  EXPECT_FLOAT_EQ(s->student.query_aux, 0.0f);  // off unless asked for
  EXPECT_EQ(s->student.steps, 7);
  absl::StatusOr<PretrainSchedule> bad = ParsePretrainSchedule(R"({"student": {"query_aux": -1}})");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("student.query_aux"));
}

TEST(PretrainScheduleTest, ReadsTheTasks) {
  absl::StatusOr<PretrainSchedule> vqa = ParsePretrainSchedule(R"({"seed": 1})");
  ASSERT_TRUE(vqa.ok()) << vqa.status();
  EXPECT_TRUE(vqa->questions);  // VQA only unless asked
  EXPECT_FALSE(vqa->captions);
  absl::StatusOr<PretrainSchedule> cap = ParsePretrainSchedule(R"({"tasks": ["caption"]})");
  ASSERT_TRUE(cap.ok()) << cap.status();
  EXPECT_FALSE(cap->questions);
  EXPECT_TRUE(cap->captions);
  absl::StatusOr<PretrainSchedule> both = ParsePretrainSchedule(R"({"tasks": ["vqa", "caption"]})");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_TRUE(both->questions && both->captions);
  absl::StatusOr<PretrainSchedule> unknown = ParsePretrainSchedule(R"({"tasks": ["ocr"]})");
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(std::string(unknown.status().message()), ::testing::HasSubstr("\"ocr\""));
  EXPECT_FALSE(ParsePretrainSchedule(R"({"tasks": []})").ok());
}

// Every parameter of `a` equals the same-named one of `b`, bit for bit.
void ExpectSameParameters(torch::nn::Module& a, torch::nn::Module& b, const char* what) {
  auto pa = a.named_parameters();
  auto pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size()) << what;
  for (const auto& p : pa) {
    EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << what << " " << p.key();
  }
}

int64_t ParameterCount(torch::nn::Module& m) {
  int64_t n = 0;
  for (const torch::Tensor& p : m.parameters()) n += p.numel();
  return n;
}

// Every family under configs/models/ (tiny, small, base) parses with its pretraining
// schedule, builds, answers with the shapes its config says, and has a teacher with more
// query-adapter layers and a wider, deeper LM than its student.
TEST(FamilyConfigsTest, EveryShippedFamilyBuildsWithATeacherLargerThanItsStudent) {
  std::vector<std::string> names;
  for (const auto& e :
       std::filesystem::directory_iterator(std::string(CDCCA_SOURCE_DIR) + "/configs/models")) {
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  }
  EXPECT_THAT(names, ::testing::IsSupersetOf({"tiny", "small", "base"}));
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    absl::StatusOr<FamilyConfig> f =
        LoadFamilyConfig(std::string(CDCCA_SOURCE_DIR) + "/configs/models/" + name + ".json");
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->name, name);
    absl::StatusOr<PretrainSchedule> s = ParsePretrainSchedule(f->pretrain_json);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_GT(s->teacher.steps, 0);
    EXPECT_GT(f->teacher.qa_layers, f->student.qa_layers);
    EXPECT_GT(f->teacher.d_model, f->student.d_model);
    EXPECT_GT(f->teacher.lm_layers, f->student.lm_layers);
    torch::NoGradGuard no_grad;
    VisionEncoder enc(f->vision);
    enc->eval();
    const torch::Tensor tokens =
        enc->forward(torch::rand({1, 3, f->vision.image_size, f->vision.image_size}));
    EXPECT_EQ(tokens.sizes(), (std::vector<int64_t>{1, f->vision.NumTokens(), f->vision.d_vis}));
    Blip2Tower teacher(f->teacher), student(f->student);
    EXPECT_GT(ParameterCount(*teacher), ParameterCount(*student));
    for (Blip2Tower* m : {&teacher, &student}) {
      (*m)->eval();
      const torch::Tensor text = torch::randint(1, f->vocab_size, {1, 5}, torch::kLong);
      MllmOutput out = (*m)->Forward({tokens, torch::Tensor(), text, torch::Tensor()});
      EXPECT_EQ(out.logits.sizes(), (std::vector<int64_t>{1, 5, f->vocab_size}));
    }
  }
}

TEST(PretrainTest, TinyFamilyTrainsAndARerunLoadsTheFinishedStages) {
  const std::string out = ::testing::TempDir() + "/pretrain_tiny";
  std::filesystem::remove_all(out);
  PretrainOptions o;
  o.config_path = std::string(CDCCA_SOURCE_DIR) + "/configs/models/tiny.json";
  o.out_dir = out;
  o.fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";
  o.force_cpu = true;
  ASSERT_TRUE(Pretrain(o).ok());
  absl::StatusOr<FamilyCheckpoint> family = LoadFamily(out, Precision::kFp32);
  ASSERT_TRUE(family.ok()) << family.status();
  nlohmann::json record;
  std::ifstream(out + "/pretrain_record.json") >> record;
  for (const char* stage : {"vision", "teacher", "student"}) {
    ASSERT_TRUE(record.contains(stage)) << stage;
    EXPECT_EQ(record[stage]["steps"].get<int>(), 3) << stage;
  }
  // tiny.json trains both towers with the query-adapter auxiliary heads.
  EXPECT_FLOAT_EQ(record["teacher"]["query_aux"].get<float>(), 0.5f);
  EXPECT_FLOAT_EQ(record["student"]["query_aux"].get<float>(), 0.5f);
  EXPECT_GE(record["teacher"]["source_test_da"].get<double>(), 0.0);
  EXPECT_LE(record["student"]["source_test_da"].get<double>(), 100.0);
  EXPECT_FALSE(std::filesystem::exists(out + "/resume_teacher_step.txt"));

  // A second run finds every stage done: it trains nothing and writes the same weights.
  ASSERT_TRUE(Pretrain(o).ok());
  nlohmann::json rerun;
  std::ifstream(out + "/pretrain_record.json") >> rerun;
  for (const char* stage : {"vision", "teacher", "student"}) {
    EXPECT_EQ(rerun[stage]["seconds"], record[stage]["seconds"]) << stage;
  }
  absl::StatusOr<FamilyCheckpoint> again = LoadFamily(out, Precision::kFp32);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectSameParameters(*family->student, *again->student, "student");
}

// tiny.json with pretrain.tasks replaced, written to `path`.
std::string TinyConfigWithTasks(const std::string& path, const nlohmann::json& tasks,
                                int max_positions = 64) {
  nlohmann::json j;
  std::ifstream(std::string(CDCCA_SOURCE_DIR) + "/configs/models/tiny.json") >> j;
  j["pretrain"]["tasks"] = tasks;
  j["teacher"]["max_positions"] = max_positions;
  j["student"]["max_positions"] = max_positions;
  std::ofstream(path) << j.dump();
  return path;
}

// With "tasks": ["vqa", "caption"] the towers learn both, each is scored on both after its
// stage, and model-eval's captioning table has the paper's rows (in/near/out/all).
TEST(PretrainTest, CaptionTasksTrainScoreAndEvaluate) {
  PretrainOptions o;
  o.config_path = TinyConfigWithTasks(::testing::TempDir() + "/tiny_caption.json",
                                      nlohmann::json::array({"vqa", "caption"}));
  o.fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";
  o.force_cpu = true;
  o.out_dir = ::testing::TempDir() + "/pretrain_caption";
  std::filesystem::remove_all(o.out_dir);
  ASSERT_TRUE(Pretrain(o).ok());
  nlohmann::json record;
  std::ifstream(o.out_dir + "/pretrain_record.json") >> record;
  for (const char* tower : {"teacher", "student"}) {
    SCOPED_TRACE(tower);
    ASSERT_TRUE(record[tower].contains("source_test_da"));
    ASSERT_TRUE(record[tower].contains("source_test_cider"));
    EXPECT_GE(record[tower]["source_test_bleu4"].get<double>(), 0.0);
    EXPECT_LE(record[tower]["source_test_bleu4"].get<double>(), 100.0);
  }
  AccuracyOptions a;
  a.checkpoint_dir = o.out_dir;
  a.fashion_mnist_dir = o.fashion_mnist_dir;
  a.scenes = 3;
  a.force_cpu = true;
  absl::StatusOr<std::string> table = CaptionTable(a);
  ASSERT_TRUE(table.ok()) << table.status();
  for (const char* row : {"| in-domain |", "| near-domain |", "| out-domain |", "| all |"}) {
    EXPECT_THAT(*table, ::testing::HasSubstr(row));
  }
  EXPECT_THAT(*table, ::testing::HasSubstr("student int4"));
}

// A family whose towers cannot hold the longest caption is refused before any training.
TEST(PretrainTest, CaptionsNeedRoomForTheLongestCaption) {
  PretrainOptions o;
  o.config_path = TinyConfigWithTasks(::testing::TempDir() + "/tiny_caption_short.json",
                                      nlohmann::json::array({"caption"}), 32);
  o.fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";
  o.force_cpu = true;
  o.out_dir = ::testing::TempDir() + "/pretrain_caption_short";
  absl::Status s = Pretrain(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("max_positions is 32"));
  EXPECT_FALSE(std::filesystem::exists(o.out_dir + "/stages/encoder.safetensors"));
}

// A run stopped mid-stage (stop_after_steps) and continued writes the same weights as an
// uninterrupted one: the resume checkpoints carry model, optimizer and the auxiliary query
// heads, and every step reseeds.
TEST(PretrainTest, StoppedRunsContinueToTheSameWeights) {
  PretrainOptions o;
  o.config_path = std::string(CDCCA_SOURCE_DIR) + "/configs/models/tiny.json";
  o.fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";
  o.force_cpu = true;
  o.out_dir = ::testing::TempDir() + "/pretrain_whole";
  std::filesystem::remove_all(o.out_dir);
  ASSERT_TRUE(Pretrain(o).ok());

  PretrainOptions split = o;
  split.out_dir = ::testing::TempDir() + "/pretrain_split";
  std::filesystem::remove_all(split.out_dir);
  // tiny.json: 3 steps a stage. 2 steps stop inside the vision stage; 3 more finish it and
  // stop inside the teacher's; the last run finishes.
  split.stop_after_steps = 2;
  absl::Status first = Pretrain(split);
  EXPECT_EQ(first.code(), absl::StatusCode::kAborted) << first;
  EXPECT_THAT(std::string(first.message()), ::testing::HasSubstr("vision at step 2"));
  EXPECT_TRUE(std::filesystem::exists(split.out_dir + "/resume_vision_step.txt"));
  split.stop_after_steps = 3;
  absl::Status second = Pretrain(split);
  EXPECT_EQ(second.code(), absl::StatusCode::kAborted) << second;
  EXPECT_THAT(std::string(second.message()), ::testing::HasSubstr("teacher at step 2"));
  EXPECT_TRUE(std::filesystem::exists(split.out_dir + "/resume_teacher_extra.pt"));
  split.stop_after_steps = 0;
  ASSERT_TRUE(Pretrain(split).ok());
  EXPECT_FALSE(std::filesystem::exists(split.out_dir + "/resume_teacher_step.txt"));

  absl::StatusOr<FamilyCheckpoint> whole = LoadFamily(o.out_dir, Precision::kFp32);
  absl::StatusOr<FamilyCheckpoint> parts = LoadFamily(split.out_dir, Precision::kFp32);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(parts.ok()) << parts.status();
  ExpectSameParameters(*whole->encoder, *parts->encoder, "encoder");
  ExpectSameParameters(*whole->teacher, *parts->teacher, "teacher");
  ExpectSameParameters(*whole->student, *parts->student, "student");
}

}  // namespace
}  // namespace cdcca::model
