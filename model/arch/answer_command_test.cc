// `cdcca answer` on every family, run as the program: the tiny LLaVA, BLIP-2 and InstructBLIP
// fixtures, the project's tiny family fixture and its committed families models/small and
// models/llava-small (prompted through its chat template), each
// with and without --adapter_state. Each writes the official VQAv2 results file, which
// `cdcca eval vqa` scores; A-OKVQA and COCO captions results likewise on one fixture each.
// The answers are the library's greedy answers for the architecture's prompt (LLaVA-1.5's
// evaluation prompt in its template; BLIP-2 / InstructBLIP: the question as it is).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "datasets/domain.h"
#include "datasets/formats.h"
#include "model/arch/generate_command.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/adapter_state.h"
#include "nlohmann/json.hpp"
#include "tests/testing/child_process.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::model {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;
namespace fs = std::filesystem;

std::string Source(const std::string& path) { return std::string(CDCCA_SOURCE_DIR) + "/" + path; }

struct Outcome {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs the `cdcca` program with `args`; its stderr goes to `log`, its stdout next to it.
Outcome Cdcca(const std::vector<std::string>& args, const std::string& log) {
  std::vector<std::string> argv = {CDCCA_TOOL_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  testing::Child child(argv, log, /*fault=*/"", log + ".stdout");
  Outcome r;
  r.exit_code = child.Wait(absl::Minutes(5));
  r.out = testing::ReadText(log + ".stdout");
  r.err = testing::ReadText(log);
  return r;
}

void WriteJson(const std::string& path, const json& j) { std::ofstream(path) << j.dump(); }

fs::path FreshDir(const std::string& name) {
  const fs::path d = fs::path(::testing::TempDir()) / ("answer_command_" + name);
  fs::remove_all(d);
  fs::create_directories(d / "images");
  return d;
}

// A VQAv2 question set on disk: questions file, images named as COCO's, and (for scenes) the
// real annotations.
struct VqaSet {
  std::string questions, images;
  std::vector<json> questions_list;  // {question_id, image_id, question}
  json annotations;                  // {"annotations": [...]} or null
};

// Questions about the fixture images (tests/fixtures/hf/images), copied under COCO names.
VqaSet FixtureQuestions(const fs::path& dir) {
  VqaSet s;
  s.images = (dir / "images").string();
  const std::vector<std::string> images = {"checker_40x40.png", "gradient_97x61.png",
                                           "noise_123x77.png"};
  const std::vector<std::string> questions = {"What is shown?", "Is it a coat?"};
  int64_t id = 1;
  for (size_t i = 0; i < images.size(); ++i) {
    const int64_t image_id = static_cast<int64_t>(i) + 42;
    fs::copy_file(Source("tests/fixtures/hf/images/" + images[i]),
                  fs::path(s.images) / datasets::CocoFileName("COCO_val2014_", image_id));
    for (const std::string& q : questions) {
      s.questions_list.push_back({{"question_id", id++}, {"image_id", image_id}, {"question", q}});
    }
  }
  s.questions = (dir / "questions.json").string();
  WriteJson(s.questions, {{"questions", s.questions_list}});
  return s;
}

// Source-domain test scenes (what models/small was trained for), with their annotations.
absl::StatusOr<VqaSet> SceneQuestions(const fs::path& dir, const datasets::ImageSet& fmnist) {
  absl::StatusOr<datasets::SampleGenerator> gen = datasets::SampleGenerator::Create(
      &fmnist, datasets::StudentSourceDomain(datasets::Split::kTest), /*seed=*/7);
  if (!gen.ok()) return gen.status();
  VqaSet s;
  s.images = (dir / "images").string();
  json annotations = json::array();
  int64_t id = 1;
  for (uint64_t i = 0; i < 6; ++i) {
    const datasets::Sample sample = gen->Generate(i);
    const int64_t image_id = static_cast<int64_t>(i) + 100;
    if (absl::Status st = datasets::WritePng(
            sample.image, (fs::path(s.images) / absl::StrFormat("%012d.png", image_id)).string());
        !st.ok()) {
      return st;
    }
    for (const datasets::VqaItem& q : sample.questions) {
      s.questions_list.push_back(
          {{"question_id", id}, {"image_id", image_id}, {"question", q.question}});
      json answers = json::array();
      for (size_t k = 0; k < q.direct_answers.size(); ++k) {
        answers.push_back({{"answer", q.direct_answers[k]}, {"answer_id", k + 1}});
      }
      annotations.push_back({{"question_id", id},
                             {"image_id", image_id},
                             {"question_type", std::string(datasets::QuestionTypeName(q.type))},
                             {"answer_type", std::string(datasets::AnswerTypeName(q.answer_type))},
                             {"multiple_choice_answer", q.answer},
                             {"answers", answers}});
      ++id;
    }
  }
  s.questions = (dir / "questions.json").string();
  WriteJson(s.questions, {{"questions", s.questions_list}});
  s.annotations = {{"annotations", annotations}};
  return s;
}

// An adapted state of the folder whose every trainable tensor is moved well off its start, so
// that the adapted model answers differently.
std::string WriteAdaptedState(const std::string& model_dir, const fs::path& dir) {
  absl::StatusOr<std::unique_ptr<MultimodalModel>> m = LoadModel(model_dir, {});
  EXPECT_TRUE(m.ok()) << m.status();
  AdapterState state;
  state.base_model = model_dir;
  state.precision = "fp32";
  state.adapters.lora_rank = 4;
  state.adapters.seed = 3;
  EXPECT_TRUE((*m)->AddAdapters(state.adapters).ok());
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  for (auto& [name, t] : (*m)->TrainableParameters()) {
    t.add_(0.5 * torch::randn_like(t));
    state.trainable.emplace_back(name, t.clone());
  }
  const std::string out = (dir / "state").string();
  EXPECT_TRUE(SaveHfAdapterState(state, out).ok());
  return out;
}

// What the library answers for each question: the folder (with the state applied, if any),
// the architecture's prompt in the folder's format, greedy, as `cdcca answer` post-processes
// it (trimmed, trailing periods dropped).
std::vector<std::string> LibraryAnswers(const std::string& model_dir, const std::string& state,
                                        const VqaSet& set, int64_t max_new_tokens) {
  absl::StatusOr<std::unique_ptr<Answerer>> a = Answerer::Load(model_dir, "fp32", "cpu");
  EXPECT_TRUE(a.ok()) << a.status();
  if (!state.empty()) {
    absl::StatusOr<AdapterState> s = LoadHfAdapterState(state);
    EXPECT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(ApplyHfAdapterState(*s, (*a)->model()).ok());
  }
  absl::StatusOr<PromptFormat> format = ResolvePromptFormat("auto", (*a)->model_type(), model_dir);
  EXPECT_TRUE(format.ok()) << format.status();
  std::vector<std::string> out;
  for (const json& q : set.questions_list) {
    const int64_t image_id = q["image_id"].get<int64_t>();
    std::string image;
    for (const auto& e : fs::directory_iterator(set.images)) {
      if (e.path().stem().string().find(absl::StrFormat("%012d", image_id)) != std::string::npos) {
        image = e.path().string();
      }
    }
    absl::StatusOr<std::string> prompt = format->Apply(
        AnswerInstruction((*a)->model_type(), "vqa", q["question"].get<std::string>()));
    EXPECT_TRUE(prompt.ok()) << prompt.status();
    absl::StatusOr<GenerateReply> reply = (*a)->Answer(image, *prompt, max_new_tokens);
    EXPECT_TRUE(reply.ok()) << reply.status();
    std::string text(absl::StripAsciiWhitespace(reply->text));
    while (!text.empty() && text.back() == '.') text.pop_back();
    out.push_back(text);
  }
  return out;
}

// question_id -> answer of a VQAv2 results file, in the questions' order.
std::vector<std::string> ResultAnswers(const std::string& path, const VqaSet& set) {
  const json results = testing::ReadJson(path);
  EXPECT_TRUE(results.is_array()) << path;
  EXPECT_EQ(results.size(), set.questions_list.size());
  std::map<int64_t, std::string> by_id;
  for (const json& r : results) {
    by_id[r["question_id"].get<int64_t>()] = r["answer"].get<std::string>();
  }
  std::vector<std::string> out;
  for (const json& q : set.questions_list) out.push_back(by_id[q["question_id"].get<int64_t>()]);
  return out;
}

// Annotations under which exactly `answers` are right (each one's ten annotators agree on it).
json AnnotationsOf(const VqaSet& set, const std::vector<std::string>& answers) {
  json annotations = json::array();
  for (size_t i = 0; i < set.questions_list.size(); ++i) {
    // The official evaluation turns a prediction's newlines and tabs into spaces.
    const std::string a = absl::StrReplaceAll(answers[i], {{"\n", " "}, {"\t", " "}});
    json ten = json::array();
    for (int k = 0; k < 10; ++k) ten.push_back({{"answer", a}, {"answer_id", k + 1}});
    annotations.push_back({{"question_id", set.questions_list[i]["question_id"]},
                           {"image_id", set.questions_list[i]["image_id"]},
                           {"question_type", "what"},
                           {"answer_type", "other"},
                           {"multiple_choice_answer", a},
                           {"answers", ten}});
  }
  return {{"annotations", annotations}};
}

// `cdcca eval vqa`'s overall accuracy of a results file.
double EvalVqa(const VqaSet& set, const json& annotations, const std::string& results,
               const fs::path& dir, const std::string& name) {
  const std::string path = (dir / (name + "_annotations.json")).string();
  WriteJson(path, annotations);
  const Outcome e = Cdcca({"eval", "vqa", "--questions=" + set.questions, "--annotations=" + path,
                           "--results=" + results},
                          (dir / (name + "_eval.log")).string());
  EXPECT_EQ(e.exit_code, 0) << e.err;
  const json scores = json::parse(e.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_TRUE(scores.is_object()) << e.out << e.err;
  return scores.is_object() ? scores.value("overall", -1.0) : -1.0;
}

class AnswerEveryFamilyTest : public ::testing::TestWithParam<std::string> {};

TEST_P(AnswerEveryFamilyTest, WritesVqaResultsThatEvalScoresWithAndWithoutAdapterState) {
  const std::string model_dir = Source(GetParam());
  const bool scenes = GetParam().rfind("models/", 0) == 0;  // a committed family
  const fs::path dir = FreshDir(fs::path(GetParam()).filename().string());
  VqaSet set;
  if (scenes) {
    absl::StatusOr<datasets::ImageSet> fmnist = datasets::LoadFashionMnist(datasets::Split::kTest);
    ASSERT_TRUE(fmnist.ok()) << fmnist.status();
    ASSERT_OK_AND_ASSIGN(set, SceneQuestions(dir, *fmnist));
  } else {
    set = FixtureQuestions(dir);
  }
  const int64_t max_new = 6;
  const std::string state = WriteAdaptedState(model_dir, dir);
  auto answer = [&](const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"answer",
                                     "--model=" + model_dir,
                                     "--questions=" + set.questions,
                                     "--images=" + set.images,
                                     "--max_new_tokens=" + std::to_string(max_new),
                                     "--out=" + (dir / (name + ".json")).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    const Outcome r = Cdcca(args, (dir / (name + ".log")).string());
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return (dir / (name + ".json")).string();
  };
  const std::string plain = answer("plain", {});
  const std::string adapted = answer("adapted", {"--adapter_state=" + state});
  const std::vector<std::string> plain_answers = ResultAnswers(plain, set);
  const std::vector<std::string> adapted_answers = ResultAnswers(adapted, set);
  EXPECT_EQ(plain_answers, LibraryAnswers(model_dir, "", set, max_new));
  EXPECT_EQ(adapted_answers, LibraryAnswers(model_dir, state, set, max_new));
  size_t same = 0;
  for (size_t i = 0; i < plain_answers.size(); ++i) same += plain_answers[i] == adapted_answers[i];
  EXPECT_LT(same, plain_answers.size()) << "the adapted state changed no answer";

  // `cdcca eval vqa` scores the files written: under annotations that hold the plain answers,
  // the plain results score 100 and the adapted ones the share they keep.
  const json self = AnnotationsOf(set, plain_answers);
  EXPECT_DOUBLE_EQ(EvalVqa(set, self, plain, dir, "self_plain"), 100.0);
  EXPECT_NEAR(EvalVqa(set, self, adapted, dir, "self_adapted"),
              100.0 * static_cast<double>(same) / static_cast<double>(plain_answers.size()), 0.005);
  if (scenes) {
    // The committed family answers its own benchmark's questions.
    const double accuracy = EvalVqa(set, set.annotations, plain, dir, "real");
    std::fprintf(stderr, "%s: VQA accuracy %.2f on %zu source-domain questions\n",
                 GetParam().c_str(), accuracy, set.questions_list.size());
    EXPECT_GE(accuracy, 50.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, AnswerEveryFamilyTest,
                         ::testing::Values("tests/fixtures/hf/models/llava_clip_llama",
                                           "tests/fixtures/hf/models/llava_siglip_qwen2",
                                           "tests/fixtures/hf/models/blip2_llama",
                                           "tests/fixtures/hf/models/instructblip_llama",
                                           "tests/fixtures/hf/models/blip2_opt",
                                           "tests/fixtures/hf/models/blip2_flan_t5",
                                           "tests/fixtures/hf/models/instructblip_flan_t5",
                                           "tests/fixtures/family/blip2_family_tiny",
                                           "models/small", "models/llava-small"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = fs::path(info.param).filename().string();
                           if (info.param.rfind("models/", 0) == 0) name = "models_" + name;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// The prompt each architecture gets by default, and a folder's chat template over it.
TEST(AnswerPromptTest, ArchitectureDefaultsAndTheFoldersChatTemplate) {
  ASSERT_OK_AND_ASSIGN(
      PromptFormat llava,
      ResolvePromptFormat("auto", "llava", Source("tests/fixtures/hf/models/llava_clip_llama")));
  EXPECT_EQ(*llava.Apply(AnswerInstruction("llava", "vqa", "What is shown?")),
            "USER: <image>\nWhat is shown?\nAnswer the question using a single word or "
            "phrase. ASSISTANT:");
  for (const char* blip : {"blip-2", "instructblip"}) {
    ASSERT_OK_AND_ASSIGN(PromptFormat f, ResolvePromptFormat("auto", blip, Source("models/small")));
    EXPECT_EQ(f.Describe(), "none");
    EXPECT_EQ(*f.Apply(AnswerInstruction(blip, "vqa", "what is it?")), "what is it?");
    EXPECT_EQ(*f.Apply(AnswerInstruction(blip, "caption", "")), "");
  }
  // A folder with a chat template answers through it; `chat` insists on one.
  const fs::path dir = FreshDir("chat_template");
  for (const auto& e : fs::directory_iterator(Source("tests/fixtures/hf/models/blip2_llama"))) {
    fs::copy(e.path(), dir / e.path().filename());
  }
  EXPECT_THAT(
      ResolvePromptFormat("chat", "blip-2", dir.string()).status(),
      testing::StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("has no chat template")));
  std::ofstream(dir / "chat_template.jinja")
      << "{% for m in messages %}{% for c in m['content'] | selectattr('type', 'equalto', "
         "'text') %}Question: {{ c['text'] }} Answer:{% endfor %}{% endfor %}\n";
  ASSERT_OK_AND_ASSIGN(PromptFormat chat, ResolvePromptFormat("auto", "blip-2", dir.string()));
  EXPECT_EQ(*chat.Apply("what is it?"), "Question: what is it? Answer:");
  const VqaSet set = FixtureQuestions(dir);
  const Outcome r =
      Cdcca({"answer", "--model=" + dir.string(), "--questions=" + set.questions,
             "--images=" + set.images, "--max_new_tokens=3", "--out=" + (dir / "r.json").string()},
            (dir / "answer.log").string());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("chat template " + (dir / "chat_template.jinja").string()));
  // A template the renderer cannot render is refused before anything is answered.
  std::ofstream(dir / "chat_template.jinja") << "{% macro m() %}{% endmacro %}";
  const Outcome refused =
      Cdcca({"answer", "--model=" + dir.string(), "--questions=" + set.questions,
             "--images=" + set.images, "--out=" + (dir / "r2.json").string()},
            (dir / "refused.log").string());
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_THAT(refused.err, HasSubstr("'macro' is not supported"));
  EXPECT_FALSE(fs::exists(dir / "r2.json"));
}

TEST(AnswerTasksTest, AokvqaAndCaptionResultsThatEvalScores) {
  const fs::path dir = FreshDir("tasks");
  const std::string llava = Source("tests/fixtures/hf/models/llava_clip_llama");
  const VqaSet set = FixtureQuestions(dir);
  // A-OKVQA: the split's questions with four choices each.
  json split = json::array();
  for (const json& q : set.questions_list) {
    split.push_back({{"question_id", absl::StrCat("q", q["question_id"].get<int64_t>())},
                     {"image_id", q["image_id"]},
                     {"question", q["question"]},
                     {"choices", {"red", "coat", "two", "yes"}}});
  }
  WriteJson((dir / "aokvqa_val.json").string(), split);
  const Outcome a =
      Cdcca({"answer", "--model=" + llava, "--task=aokvqa",
             "--questions=" + (dir / "aokvqa_val.json").string(), "--images=" + set.images,
             "--max_new_tokens=4", "--out=" + (dir / "predictions.json").string()},
            (dir / "aokvqa.log").string());
  ASSERT_EQ(a.exit_code, 0) << a.err;
  const json predictions = testing::ReadJson((dir / "predictions.json").string());
  ASSERT_TRUE(predictions.is_object());
  ASSERT_EQ(predictions.size(), split.size());
  // Annotate the split with the predictions as the right answers: MC and DA must be 100.
  for (json& q : split) {
    const json& p = predictions[q["question_id"].get<std::string>()];
    const auto choices = q["choices"].get<std::vector<std::string>>();
    const auto it =
        std::find(choices.begin(), choices.end(), p["multiple_choice"].get<std::string>());
    ASSERT_NE(it, choices.end()) << p.dump();
    q["correct_choice_idx"] = it - choices.begin();
    q["direct_answers"] = std::vector<std::string>(10, p["direct_answer"].get<std::string>());
  }
  WriteJson((dir / "aokvqa_annotated.json").string(), split);
  const Outcome e =
      Cdcca({"eval", "aokvqa", "--annotations=" + (dir / "aokvqa_annotated.json").string(),
             "--predictions=" + (dir / "predictions.json").string()},
            (dir / "aokvqa_eval.log").string());
  ASSERT_EQ(e.exit_code, 0) << e.err;
  const json scores = json::parse(e.out);
  EXPECT_DOUBLE_EQ(scores["MC"].get<double>(), 100.0);

  // COCO captions on the BLIP-2 fixture (no text: BLIP-2's captioning) and LLaVA.
  json images = json::array(), captions = json::array();
  int64_t cid = 1;
  for (const auto& e2 : fs::directory_iterator(set.images)) {
    const int64_t id = std::stoll(e2.path().stem().string().substr(13));
    images.push_back({{"id", id}, {"file_name", e2.path().filename().string()}});
    captions.push_back(
        {{"id", cid++}, {"image_id", id}, {"caption", "a coat on a plain background"}});
  }
  WriteJson((dir / "captions_val.json").string(), {{"images", images}, {"annotations", captions}});
  for (const std::string model : {Source("tests/fixtures/hf/models/blip2_llama"), llava}) {
    SCOPED_TRACE(model);
    const Outcome c =
        Cdcca({"answer", "--model=" + model, "--task=caption",
               "--annotations=" + (dir / "captions_val.json").string(), "--images=" + set.images,
               "--max_new_tokens=5", "--out=" + (dir / "captions.json").string()},
              (dir / "caption.log").string());
    ASSERT_EQ(c.exit_code, 0) << c.err;
    const json results = testing::ReadJson((dir / "captions.json").string());
    ASSERT_TRUE(results.is_array());
    EXPECT_EQ(results.size(), images.size());
    for (const json& r : results) EXPECT_TRUE(r["caption"].is_string()) << r.dump();
    const Outcome ce =
        Cdcca({"eval", "caption", "--annotations=" + (dir / "captions_val.json").string(),
               "--results=" + (dir / "captions.json").string()},
              (dir / "caption_eval.log").string());
    ASSERT_EQ(ce.exit_code, 0) << ce.err;
    EXPECT_TRUE(json::parse(ce.out).contains("CIDEr")) << ce.out;
  }
}

TEST(AnswerHelpTest, ListsOnlyItsOwnFlags) {
  const fs::path dir = FreshDir("help");
  const Outcome r = Cdcca({"answer", "--help"}, (dir / "help.log").string());
  EXPECT_EQ(r.exit_code, 0);
  for (const char* flag : {"--model", "--task", "--questions", "--annotations", "--images", "--out",
                           "--template", "--adapter_state", "--precision", "--limit"}) {
    EXPECT_THAT(r.out, HasSubstr(std::string("\n  ") + flag + "  ")) << flag;
  }
  for (const char* other : {"--render_seed", "--results", "--teacher", "--json", "--image "}) {
    EXPECT_THAT(r.out, ::testing::Not(HasSubstr(other))) << other;
  }
}

}  // namespace
}  // namespace cdcca::model
