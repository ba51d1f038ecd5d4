// `cdcca pretrain` on the tiny family (real Fashion-MNIST scenes, a few steps per stage),
// the padding plan of its training steps, and the shipped family configs.
#include "model/family/pretrain.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/arch/multimodal_model.h"
#include "model/family/config.h"
#include "model/family/family_model.h"
#include "model/family/llava_family.h"
#include "model/hub/safetensors.h"
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

// ATC on the source data gives back the source accuracy, and on a shifted set the share of
// questions at least as sure as the source's threshold.
TEST(AtcTest, TheThresholdGivesBackTheSourceAccuracyAndEstimatesTheShiftedShare) {
  std::vector<double> source;
  for (int i = 0; i < 100; ++i) source.push_back((28 + i) / 128.0);  // exact in binary
  const double t = AtcThreshold(source, 0.8);
  EXPECT_DOUBLE_EQ(t, source[20]);  // 20 of 100 below it
  EXPECT_DOUBLE_EQ(AtcEstimate(source, t), 0.8);
  // Every question of a shifted set ten steps less sure: ten fewer clear it, in whatever
  // order the confidences come.
  std::vector<double> shifted;
  for (int i = 99; i >= 0; --i) shifted.push_back(source[i] - 10 / 128.0);
  EXPECT_DOUBLE_EQ(AtcEstimate(shifted, t), 0.7);
  // The ends: a perfect model's threshold is its least sure answer, a hopeless one's is
  // above every answer.
  EXPECT_DOUBLE_EQ(AtcThreshold(source, 1.0), source.front());
  EXPECT_DOUBLE_EQ(AtcEstimate(source, AtcThreshold(source, 0.0)), 0.0);
  EXPECT_DOUBLE_EQ(AtcEstimate({}, 0.5), 0.0);
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

TEST(PretrainScheduleTest, ReadsTheTeachersTokenMaskAndRejectsMoreThanHalf) {
  absl::StatusOr<PretrainSchedule> dflt = ParsePretrainSchedule(R"({"teacher": {"steps": 5}})");
  ASSERT_TRUE(dflt.ok()) << dflt.status();
  EXPECT_LT(dflt->teacher.token_mask, 0);  // the teacher domain's unless asked for
  absl::StatusOr<PretrainSchedule> off =
      ParsePretrainSchedule(R"({"teacher": {"steps": 5, "token_mask": 0}})");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_DOUBLE_EQ(off->teacher.token_mask, 0.0);
  absl::StatusOr<PretrainSchedule> bad =
      ParsePretrainSchedule(R"({"teacher": {"token_mask": 0.75}})");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("teacher.token_mask"));
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

// Every tensor of `a`'s model.safetensors equals the same-named one of `b`'s, bit for bit.
void ExpectSameWeights(const std::string& a, const std::string& b, const char* what) {
  absl::StatusOr<SafetensorsContents> wa = ReadSafetensors(a + "/model.safetensors");
  absl::StatusOr<SafetensorsContents> wb = ReadSafetensors(b + "/model.safetensors");
  ASSERT_TRUE(wa.ok()) << wa.status();
  ASSERT_TRUE(wb.ok()) << wb.status();
  ASSERT_EQ(wa->tensors.size(), wb->tensors.size()) << what;
  std::map<std::string, torch::Tensor> by_name(wb->tensors.begin(), wb->tensors.end());
  for (const auto& [name, t] : wa->tensors) {
    ASSERT_TRUE(by_name.count(name)) << what << " " << name;
    EXPECT_TRUE(torch::equal(t, by_name[name])) << what << " " << name;
  }
}

int64_t ParameterCount(torch::nn::Module& m) {
  int64_t n = 0;
  for (const torch::Tensor& p : m.parameters()) n += p.numel();
  return n;
}

// Every family under configs/models/ (tiny, small, base, the llava-* ones) parses with its
// pretraining schedule, builds, answers with the shapes its config says, and has a teacher
// with a wider, deeper LM than its student (and, in a BLIP-2 family, more Q-Former layers).
TEST(FamilyConfigsTest, EveryShippedFamilyBuildsWithATeacherLargerThanItsStudent) {
  std::vector<std::string> names;
  for (const auto& e :
       std::filesystem::directory_iterator(std::string(CDCCA_SOURCE_DIR) + "/configs/models")) {
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  }
  EXPECT_THAT(names,
              ::testing::IsSupersetOf({"tiny", "small", "base", "llava-tiny", "llava-small"}));
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    absl::StatusOr<FamilyConfig> f =
        LoadFamilyConfig(std::string(CDCCA_SOURCE_DIR) + "/configs/models/" + name + ".json");
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->name, name);
    absl::StatusOr<PretrainSchedule> s = ParsePretrainSchedule(f->pretrain_json);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_GT(s->teacher.steps, 0);
    EXPECT_GT(f->teacher.d_model, f->student.d_model);
    EXPECT_GT(f->teacher.lm_layers, f->student.lm_layers);
    torch::NoGradGuard no_grad;
    if (f->architecture == "llava") {
      absl::StatusOr<Llava> teacher = NewLlavaFamilyModel(f->vision, f->teacher);
      absl::StatusOr<Llava> student = NewLlavaFamilyModel(f->vision, f->student);
      ASSERT_TRUE(teacher.ok()) << teacher.status();
      ASSERT_TRUE(student.ok()) << student.status();
      EXPECT_GT(ParameterCount(**teacher), ParameterCount(**student));
      for (Llava* m : {&*teacher, &*student}) {
        std::unique_ptr<MultimodalModel> mm = LlavaFamilyMultimodalModel(*m, torch::kCPU);
        mm->module().eval();
        MultimodalInputs px;
        px.pixel_values = torch::rand({1, 3, f->vision.image_size, f->vision.image_size});
        absl::StatusOr<torch::Tensor> tokens = mm->EncodeImages(px);
        ASSERT_TRUE(tokens.ok()) << tokens.status();
        EXPECT_EQ(tokens->sizes(),
                  (std::vector<int64_t>{1, f->vision.NumPatches(), f->vision.d_vis}));
        TokenInputs in;
        in.visual_tokens = *tokens;
        const std::vector<int64_t> ids = mm->ExpandImageTokens({f->vocab_size - 1, 1, 5, 6, 7});
        in.input_ids = torch::tensor(ids, torch::kLong).unsqueeze(0);
        absl::StatusOr<TokenForward> out = mm->ForwardTokens(in);
        ASSERT_TRUE(out.ok()) << out.status();
        EXPECT_EQ(out->logits.sizes(),
                  (std::vector<int64_t>{1, static_cast<int64_t>(ids.size()), f->vocab_size}));
      }
      continue;
    }
    EXPECT_GT(f->teacher.qa_layers, f->student.qa_layers);
    absl::StatusOr<Blip2ForConditionalGeneration> teacher = NewFamilyModel(f->vision, f->teacher);
    absl::StatusOr<Blip2ForConditionalGeneration> student = NewFamilyModel(f->vision, f->student);
    ASSERT_TRUE(teacher.ok()) << teacher.status();
    ASSERT_TRUE(student.ok()) << student.status();
    EXPECT_GT(ParameterCount(**teacher), ParameterCount(**student));
    for (Blip2ForConditionalGeneration* m : {&*teacher, &*student}) {
      std::unique_ptr<MultimodalModel> mm = FamilyMultimodalModel(*m, torch::kCPU);
      mm->module().eval();
      MultimodalInputs px;
      px.pixel_values = torch::rand({1, 3, f->vision.image_size, f->vision.image_size});
      absl::StatusOr<torch::Tensor> tokens = mm->EncodeImages(px);
      ASSERT_TRUE(tokens.ok()) << tokens.status();
      EXPECT_EQ(tokens->sizes(), (std::vector<int64_t>{1, f->vision.NumTokens(), f->vision.d_vis}));
      TokenInputs in;
      in.visual_tokens = *tokens;
      const std::vector<int64_t> ids = mm->ExpandImageTokens({1, 5, 6, 7, 8});
      in.input_ids = torch::tensor(ids, torch::kLong).unsqueeze(0);
      absl::StatusOr<TokenForward> out = mm->ForwardTokens(in);
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(out->logits.sizes(),
                (std::vector<int64_t>{1, static_cast<int64_t>(ids.size()), f->vocab_size}));
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
  // The family is two model folders that load as any downloaded checkpoint does.
  for (const std::string& dir : {out, out + "/teacher"}) {
    absl::StatusOr<std::unique_ptr<MultimodalModel>> m = LoadModel(dir, ModelOptions{});
    ASSERT_TRUE(m.ok()) << dir << ": " << m.status();
    EXPECT_EQ((*m)->model_type(), "blip-2");
  }
  absl::StatusOr<FamilyConfig> config = LoadFamilyConfig(out + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->name, "tiny");
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
  const std::string first = out + "_first";
  std::filesystem::remove_all(first);
  std::filesystem::create_directories(first);
  std::filesystem::copy_file(out + "/model.safetensors", first + "/model.safetensors");
  ASSERT_TRUE(Pretrain(o).ok());
  nlohmann::json rerun;
  std::ifstream(out + "/pretrain_record.json") >> rerun;
  for (const char* stage : {"vision", "teacher", "student"}) {
    EXPECT_EQ(rerun[stage]["seconds"], record[stage]["seconds"]) << stage;
  }
  ExpectSameWeights(first, out, "student");
}

// The LLaVA-style family trains through the same stages, resumes from a stop inside a tower
// stage to the same weights, and ends as two LLaVA folders that answer (LoadModel) exactly
// as the in-memory student did when pretraining recorded its parity cases; model-eval reads
// them.
TEST(PretrainTest, LlavaTinyFamilyTrainsResumesAndLoadsAsItAnswered) {
  PretrainOptions o;
  o.config_path = std::string(CDCCA_SOURCE_DIR) + "/configs/models/llava-tiny.json";
  o.fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";
  o.force_cpu = true;
  o.out_dir = ::testing::TempDir() + "/pretrain_llava_tiny";
  std::filesystem::remove_all(o.out_dir);
  ASSERT_TRUE(Pretrain(o).ok());
  for (const std::string& dir : {o.out_dir, o.out_dir + "/teacher"}) {
    absl::StatusOr<std::unique_ptr<MultimodalModel>> m = LoadModel(dir, ModelOptions{});
    ASSERT_TRUE(m.ok()) << dir << ": " << m.status();
    EXPECT_EQ((*m)->model_type(), "llava");
    EXPECT_TRUE(std::filesystem::exists(dir + "/chat_template.jinja")) << dir;
  }
  absl::StatusOr<FamilyConfig> config = LoadFamilyConfig(o.out_dir + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->name, "llava-tiny");
  EXPECT_EQ(config->architecture, "llava");
  nlohmann::json record;
  std::ifstream(o.out_dir + "/pretrain_record.json") >> record;
  for (const char* stage : {"vision", "teacher", "student"}) {
    ASSERT_TRUE(record.contains(stage)) << stage;
    EXPECT_EQ(record[stage]["steps"].get<int>(), 3) << stage;
  }
  EXPECT_GE(record["student"]["source_test_da"].get<double>(), 0.0);

  // The student's parity cases (what the in-memory model answered, image tokens first) are
  // what the folder answers.
  nlohmann::json expected;
  std::ifstream(o.out_dir + "/cdcca_expected.json") >> expected;
  absl::StatusOr<SafetensorsContents> pixels =
      ReadSafetensors(o.out_dir + "/cdcca_pixels.safetensors");
  ASSERT_TRUE(pixels.ok()) << pixels.status();
  absl::StatusOr<std::unique_ptr<MultimodalModel>> student = LoadModel(o.out_dir, {});
  ASSERT_TRUE(student.ok()) << student.status();
  ASSERT_EQ(expected["cases"].size(), 2u);
  for (size_t i = 0; i < expected["cases"].size(); ++i) {
    const nlohmann::json& c = expected["cases"][i];
    const std::vector<int64_t> prompt = c["prompt_ids"].get<std::vector<int64_t>>();
    EXPECT_EQ(prompt.front(), config->vocab_size - 1) << "case " << i;
    EXPECT_EQ(prompt[1], 1) << "case " << i;  // <bos> after the image
    EXPECT_THAT(c["prompt"].get<std::string>(), ::testing::StartsWith("<image> <bos> "));
    MultimodalInputs in;
    in.pixel_values = pixels->tensors[i].second.unsqueeze(0);
    in.input_ids =
        torch::tensor(c["input_ids"].get<std::vector<int64_t>>(), torch::kLong).unsqueeze(0);
    GreedyOptions g;
    g.max_new_tokens = c["max_new_tokens"].get<int64_t>();
    g.eos_token_ids = (*student)->eos_token_ids();
    absl::StatusOr<GreedyResult> r = (*student)->Generate(in, g);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tokens[0], c["greedy_tokens"].get<std::vector<int64_t>>()) << "case " << i;
    const std::vector<float> first = c["first_logits"].get<std::vector<float>>();
    EXPECT_TRUE(torch::allclose(r->first_logits[0], torch::tensor(first), 1e-5, 1e-5));
  }

  AccuracyOptions a;
  a.checkpoint_dir = o.out_dir;
  a.fashion_mnist_dir = o.fashion_mnist_dir;
  a.scenes = 3;
  a.force_cpu = true;
  absl::StatusOr<std::string> table = AccuracyTable(a);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_THAT(*table, ::testing::HasSubstr("| source test (clean) |"));

  // Stopped inside the teacher's stage (3 vision steps, then 2) and continued: the same family.
  PretrainOptions split = o;
  split.out_dir = ::testing::TempDir() + "/pretrain_llava_tiny_split";
  std::filesystem::remove_all(split.out_dir);
  split.stop_after_steps = 5;
  absl::Status stopped = Pretrain(split);
  EXPECT_EQ(stopped.code(), absl::StatusCode::kAborted) << stopped;
  EXPECT_THAT(std::string(stopped.message()), ::testing::HasSubstr("teacher at step 2"));
  split.stop_after_steps = 0;
  ASSERT_TRUE(Pretrain(split).ok());
  ExpectSameWeights(o.out_dir + "/teacher", split.out_dir + "/teacher", "teacher");
  ExpectSameWeights(o.out_dir, split.out_dir, "student");
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
  EXPECT_FALSE(std::filesystem::exists(o.out_dir + "/stages/vision.safetensors"));
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

  ExpectSameWeights(o.out_dir + "/teacher", split.out_dir + "/teacher", "teacher");
  ExpectSameWeights(o.out_dir, split.out_dir, "student");
}

}  // namespace
}  // namespace cdcca::model
