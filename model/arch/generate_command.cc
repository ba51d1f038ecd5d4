#include "model/arch/generate_command.h"

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "model/hub/hf_adapter_state.h"
#include "model/arch/hf_answerer.h"
#include "nlohmann/json.hpp"

// --model is defined by `cdcca tokenize` (model/tokenizer/tokenize_command.cc).
ABSL_DECLARE_FLAG(std::string, model);
ABSL_FLAG(std::string, image, "", "generate: the image file");
ABSL_FLAG(std::string, prompt, "",
          "generate: the text the processor receives (LLaVA: contains <image>)");
ABSL_FLAG(int64_t, max_new_tokens, 32, "generate/answer: most tokens generated");
// --precision is shared with `cdcca adapt-eval` (precision_flag.cc); empty = fp32 here.
ABSL_DECLARE_FLAG(std::string, precision);
ABSL_FLAG(std::string, device, "cpu", "generate/answer: cpu or cuda");
ABSL_FLAG(bool, json, false, "generate: print {input_ids, tokens, text, first_logits}");
// --questions and --out are defined by `cdcca eval` / `cdcca render` (datasets/commands.cc).
ABSL_DECLARE_FLAG(std::string, questions);
ABSL_DECLARE_FLAG(std::string, out);
ABSL_FLAG(std::string, images, "", "answer: the folder of the question file's images");
ABSL_FLAG(int64_t, limit, 0, "answer: answer at most this many questions (0 = all)");
ABSL_FLAG(std::string, adapter_state, "",
          "generate: apply this adapted state (cdcca hf-adapt --out DIR) to --model first");
ABSL_FLAG(std::string, template, "",
          "generate/answer: prompt template (llava, vicuna, chatml); empty = prompt as given");

namespace cdcca::model {

absl::StatusOr<GenerateReply> RunGenerate(const GenerateRequest& request) {
  absl::StatusOr<std::string> prompt = ApplyPromptTemplate(request.template_name, request.prompt);
  if (!prompt.ok()) return prompt.status();
  absl::StatusOr<std::unique_ptr<HfAnswerer>> answerer =
      HfAnswerer::Load(request.model_dir, request.precision, request.device);
  if (!answerer.ok()) return answerer.status();
  if (!request.adapter_state.empty()) {
    absl::StatusOr<HfAdapterState> state = LoadHfAdapterState(request.adapter_state);
    if (!state.ok()) return state.status();
    if (absl::Status s = ApplyHfAdapterState(*state, (*answerer)->model()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(request.adapter_state, ": ", s.message()));
    }
  }
  return (*answerer)->Answer(request.image_path, *prompt, request.max_new_tokens);
}

int GenerateCommand(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "generate: unexpected argument %s\n", args[0].c_str());
    return 2;
  }
  GenerateRequest r;
  r.model_dir = absl::GetFlag(FLAGS_model);
  r.image_path = absl::GetFlag(FLAGS_image);
  r.prompt = absl::GetFlag(FLAGS_prompt);
  r.template_name = absl::GetFlag(FLAGS_template);
  r.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  r.precision = absl::GetFlag(FLAGS_precision).empty() ? "fp32" : absl::GetFlag(FLAGS_precision);
  r.device = absl::GetFlag(FLAGS_device);
  r.adapter_state = absl::GetFlag(FLAGS_adapter_state);
  if (r.model_dir.empty() || r.image_path.empty()) {
    std::fprintf(stderr, "generate: --model DIR and --image FILE are required\n");
    return 2;
  }
  absl::StatusOr<GenerateReply> reply = RunGenerate(r);
  if (!reply.ok()) {
    std::fprintf(stderr, "generate: %s\n", std::string(reply.status().message()).c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json out = {{"input_ids", reply->input_ids},
                          {"tokens", reply->tokens},
                          {"text", reply->text},
                          {"first_logits", reply->first_logits}};
    std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("%s\n", reply->text.c_str());
    std::fprintf(stderr, "%zu tokens in %.3f s\n", reply->tokens.size(), reply->seconds);
  }
  return 0;
}

namespace {

struct Question {
  std::string id;  // VQAv2: the integer as text; A-OKVQA: the string id
  int64_t image_id = 0;
  std::string question;
  std::vector<std::string> choices;  // A-OKVQA
};

// VQAv2 questions ({"questions": [...]}) or an A-OKVQA split (a list). Sets *aokvqa.
absl::StatusOr<std::vector<Question>> ReadQuestions(const std::string& path, bool* aokvqa) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": bad JSON: ", e.what()));
  }
  *aokvqa = j.is_array();
  const nlohmann::json& list = *aokvqa ? j : j.value("questions", nlohmann::json());
  if (!list.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": neither a VQAv2 file (questions: [...]) nor an A-OKVQA list"));
  }
  std::vector<Question> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& q = list[i];
    Question r;
    try {
      r.id = q.at("question_id").is_string() ? q.at("question_id").get<std::string>()
                                             : std::to_string(q.at("question_id").get<int64_t>());
      r.image_id = q.at("image_id").get<int64_t>();
      r.question = q.at("question").get<std::string>();
      if (q.contains("choices")) r.choices = q["choices"].get<std::vector<std::string>>();
    } catch (const nlohmann::json::exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", *aokvqa ? "" : "questions", "[", i, "]: ", e.what()));
    }
    out.push_back(std::move(r));
  }
  return out;
}

// image id -> file, from the trailing digits of each file's stem (COCO_val2014_000000000042.jpg,
// 000000000042.jpg).
std::map<int64_t, std::string> IndexImages(const std::string& dir) {
  std::map<int64_t, std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string stem = e.path().stem().string();
    size_t start = stem.size();
    while (start > 0 && std::isdigit(static_cast<unsigned char>(stem[start - 1]))) --start;
    if (start == stem.size() || stem.size() - start > 18) continue;
    out.emplace(std::stoll(stem.substr(start)), e.path().string());
  }
  return out;
}

// The choice the free answer names (case-insensitive), else the one sharing most words.
std::string PickChoice(const std::string& answer, const std::vector<std::string>& choices) {
  if (choices.empty()) return "";
  const std::string a = absl::AsciiStrToLower(answer);
  std::set<std::string> words = absl::StrSplit(a, ' ', absl::SkipEmpty());
  size_t best = 0;
  int best_overlap = -1;
  for (size_t i = 0; i < choices.size(); ++i) {
    const std::string c = absl::AsciiStrToLower(choices[i]);
    if (c == a) return choices[i];
    int overlap = 0;
    for (absl::string_view w : absl::StrSplit(c, ' ', absl::SkipEmpty())) {
      overlap += words.count(std::string(w)) > 0 ? 1 : 0;
    }
    if (overlap > best_overlap) {
      best = i;
      best_overlap = overlap;
    }
  }
  return choices[best];
}

}  // namespace

int AnswerCommand(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "answer: unexpected argument %s\n", args[0].c_str());
    return 2;
  }
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  const std::string questions_path = absl::GetFlag(FLAGS_questions);
  const std::string images_dir = absl::GetFlag(FLAGS_images);
  const std::string out_path = absl::GetFlag(FLAGS_out);
  if (model_dir.empty() || questions_path.empty() || images_dir.empty() || out_path.empty()) {
    std::fprintf(stderr, "answer: --model, --questions, --images and --out are required\n");
    return 2;
  }
  bool aokvqa = false;
  absl::StatusOr<std::vector<Question>> questions = ReadQuestions(questions_path, &aokvqa);
  if (!questions.ok()) {
    std::fprintf(stderr, "answer: %s\n", std::string(questions.status().message()).c_str());
    return 1;
  }
  const std::map<int64_t, std::string> images = IndexImages(images_dir);
  const std::string precision =
      absl::GetFlag(FLAGS_precision).empty() ? "fp32" : absl::GetFlag(FLAGS_precision);
  absl::StatusOr<std::unique_ptr<HfAnswerer>> answerer =
      HfAnswerer::Load(model_dir, precision, absl::GetFlag(FLAGS_device));
  if (!answerer.ok()) {
    std::fprintf(stderr, "answer: %s\n", std::string(answerer.status().message()).c_str());
    return 1;
  }
  const std::string template_name =
      absl::GetFlag(FLAGS_template).empty() ? "llava" : absl::GetFlag(FLAGS_template);
  const int64_t limit = absl::GetFlag(FLAGS_limit);
  nlohmann::json results = aokvqa ? nlohmann::json::object() : nlohmann::json::array();
  int64_t done = 0;
  double seconds = 0;
  for (const Question& q : *questions) {
    if (limit > 0 && done >= limit) break;
    auto image = images.find(q.image_id);
    if (image == images.end()) {
      std::fprintf(stderr, "answer: %s: no image for image_id %lld (question %s)\n",
                   images_dir.c_str(), static_cast<long long>(q.image_id), q.id.c_str());
      return 1;
    }
    // LLaVA-1.5's short-answer instruction for VQA benchmarks.
    absl::StatusOr<std::string> prompt = ApplyPromptTemplate(
        template_name, q.question + "\nAnswer the question using a single word or phrase.");
    if (!prompt.ok()) {
      std::fprintf(stderr, "answer: %s\n", std::string(prompt.status().message()).c_str());
      return 2;
    }
    absl::StatusOr<GenerateReply> reply =
        (*answerer)->Answer(image->second, *prompt, absl::GetFlag(FLAGS_max_new_tokens));
    if (!reply.ok()) {
      std::fprintf(stderr, "answer: question %s: %s\n", q.id.c_str(),
                   std::string(reply.status().message()).c_str());
      return 1;
    }
    std::string answer(absl::StripAsciiWhitespace(reply->text));
    while (!answer.empty() && answer.back() == '.') answer.pop_back();
    seconds += reply->seconds;
    if (aokvqa) {
      results[q.id] = {{"multiple_choice", PickChoice(answer, q.choices)},
                       {"direct_answer", answer}};
    } else {
      results.push_back({{"question_id", std::stoll(q.id)}, {"answer", answer}});
    }
    ++done;
  }
  std::ofstream out(out_path);
  out << results.dump() << "\n";
  if (!out) {
    std::fprintf(stderr, "answer: cannot write %s\n", out_path.c_str());
    return 1;
  }
  std::fprintf(stderr, "answer: %lld questions, %.2f s generating, wrote %s\n",
               static_cast<long long>(done), seconds, out_path.c_str());
  return 0;
}

}  // namespace cdcca::model
