#include "model/arch/generate_command.h"

#include <cctype>
#include <chrono>
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
#include "datasets/formats.h"
#include "model/arch/answerer.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/adapter_state.h"
#include "nlohmann/json.hpp"

// --model is defined by `cdcca tokenize` (model/tokenizer/tokenize_command.cc).
ABSL_DECLARE_FLAG(std::string, model);
ABSL_FLAG(std::string, image, "", "generate: the image file");
ABSL_FLAG(std::string, prompt, "",
          "generate: the text the processor receives (LLaVA: contains <image>); answer --task "
          "caption: the instruction (default: the architecture's); adapt: the question asked "
          "about every image");
ABSL_FLAG(int64_t, max_new_tokens, 32, "generate/answer: most tokens generated");
// --precision (precision_flag.cc): the model's weights; empty = fp32.
ABSL_DECLARE_FLAG(std::string, precision);
ABSL_FLAG(std::string, device, "cpu",
          "generate, answer, adapt, adapt-eval: where the models run, cpu or cuda");
ABSL_FLAG(bool, json, false, "generate: print {input_ids, tokens, text, first_logits}");
// --questions, --annotations and --out are defined by `cdcca eval` / `cdcca render`
// (datasets/commands.cc).
ABSL_DECLARE_FLAG(std::string, questions);
ABSL_DECLARE_FLAG(std::string, annotations);
ABSL_DECLARE_FLAG(std::string, out);
ABSL_FLAG(std::string, images, "",
          "answer: the folder of the images (found by the id in their file names; by "
          "file_name for --task caption); adapt: a folder of images or a comma list of files");
ABSL_FLAG(std::string, task, "vqa",
          "answer: vqa (--questions: VQAv2 questions), aokvqa (--questions: an A-OKVQA split) "
          "or caption (--annotations: COCO captions)");
ABSL_FLAG(int64_t, limit, 0, "answer: answer at most this many questions or images (0 = all)");
ABSL_FLAG(std::string, adapter_state, "",
          "generate/answer: apply this adapted state (cdcca adapt --out DIR) to --model first");
ABSL_FLAG(std::string, template, "",
          "generate/answer: prompt format: llava, vicuna, chatml, chat (the folder's chat "
          "template), auto (the folder's chat template, else llava for LLaVA and none for "
          "BLIP-2 / InstructBLIP) or none; empty = the prompt as given (generate), auto (answer)");

namespace cdcca::model {
namespace {

// The adapted state in `dir` applied to the answerer's freshly loaded base; "" = none.
absl::Status ApplyAdapterState(const std::string& dir, Answerer& answerer) {
  if (dir.empty()) return absl::OkStatus();
  absl::StatusOr<AdapterState> state = LoadHfAdapterState(dir);
  if (!state.ok()) return state.status();
  if (absl::Status s = ApplyHfAdapterState(*state, answerer.model()); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(dir, ": ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GenerateReply> RunGenerate(const GenerateRequest& request) {
  absl::StatusOr<std::unique_ptr<Answerer>> answerer =
      Answerer::Load(request.model_dir, request.precision, request.device);
  if (!answerer.ok()) return answerer.status();
  absl::StatusOr<std::string> prompt = request.prompt;
  if (!request.template_name.empty()) {
    absl::StatusOr<PromptFormat> format =
        ResolvePromptFormat(request.template_name, (*answerer)->model_type(), request.model_dir);
    if (!format.ok()) return format.status();
    prompt = format->Apply(request.prompt);
  }
  if (!prompt.ok()) return prompt.status();
  if (absl::Status s = ApplyAdapterState(request.adapter_state, **answerer); !s.ok()) return s;
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

// One thing to answer: a question about an image, or an image to caption.
struct AnswerItem {
  std::string id;  // VQAv2: the integer as text; A-OKVQA: the string id; caption: the image id
  int64_t image_id = 0;
  std::string image_path;
  std::string question;              // "" for a caption
  std::vector<std::string> choices;  // A-OKVQA
};

absl::StatusOr<std::vector<AnswerItem>> ReadItems(const AnswerRequest& r) {
  std::vector<AnswerItem> items;
  if (r.task == "vqa") {
    absl::StatusOr<std::vector<datasets::VqaQuestion>> qs =
        datasets::LoadVqaQuestions(r.input_path);
    if (!qs.ok()) return qs.status();
    for (const datasets::VqaQuestion& q : *qs) {
      items.push_back({std::to_string(q.question_id), q.image_id, "", q.question, {}});
    }
  } else if (r.task == "aokvqa") {
    absl::StatusOr<std::vector<datasets::AokvqaRecord>> qs = datasets::LoadAokvqa(r.input_path);
    if (!qs.ok()) return qs.status();
    for (const datasets::AokvqaRecord& q : *qs) {
      items.push_back({q.question_id, q.image_id, "", q.question, q.choices});
    }
  } else if (r.task == "caption") {
    absl::StatusOr<std::vector<datasets::CaptionImage>> images =
        datasets::LoadCaptionAnnotations(r.input_path);
    if (!images.ok()) return images.status();
    for (const datasets::CaptionImage& img : *images) {
      items.push_back({std::to_string(img.id),
                       img.id,
                       (std::filesystem::path(r.images_dir) / img.file_name).string(),
                       "",
                       {}});
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--task ", r.task, ": not vqa, aokvqa or caption"));
  }
  if (r.limit > 0 && static_cast<int64_t>(items.size()) > r.limit) items.resize(r.limit);
  if (r.task == "caption") return items;
  const std::map<int64_t, std::string> images = IndexImages(r.images_dir);
  for (AnswerItem& item : items) {
    auto image = images.find(item.image_id);
    if (image == images.end()) {
      return absl::NotFoundError(absl::StrCat(r.images_dir, ": no image for image_id ",
                                              item.image_id, " (question ", item.id, ")"));
    }
    item.image_path = image->second;
  }
  return items;
}

}  // namespace

const char* const kGenerateFlags[] = {"model",          "image",     "prompt", "template",
                                      "max_new_tokens", "precision", "device", "adapter_state",
                                      "json",           nullptr};

const char* const kAnswerFlags[] = {
    "model",  "task",          "questions", "annotations",    "images",    "out",    "template",
    "prompt", "adapter_state", "limit",     "max_new_tokens", "precision", "device", nullptr};

std::string AnswerInstruction(const std::string& model_type, const std::string& task,
                              const std::string& question) {
  const bool llava = model_type == "llava";
  if (task == "caption") {
    return llava ? "Provide a one-sentence caption for the provided image." : "";
  }
  return llava ? question + "\nAnswer the question using a single word or phrase." : question;
}

absl::StatusOr<AnswerSummary> RunAnswer(const AnswerRequest& request) {
  absl::StatusOr<std::vector<AnswerItem>> items = ReadItems(request);
  if (!items.ok()) return items.status();
  absl::StatusOr<std::unique_ptr<Answerer>> answerer =
      Answerer::Load(request.model_dir, request.precision, request.device);
  if (!answerer.ok()) return answerer.status();
  if (absl::Status s = ApplyAdapterState(request.adapter_state, **answerer); !s.ok()) return s;
  const std::string model_type = (*answerer)->model_type();
  absl::StatusOr<PromptFormat> format =
      ResolvePromptFormat(request.template_name, model_type, request.model_dir);
  if (!format.ok()) return format.status();
  AnswerSummary summary;
  summary.prompt_format = format->Describe();
  const bool caption = request.task == "caption";
  nlohmann::json results =
      request.task == "aokvqa" ? nlohmann::json::object() : nlohmann::json::array();
  for (const AnswerItem& item : *items) {
    const std::string text = caption && !request.caption_prompt.empty()
                                 ? request.caption_prompt
                                 : AnswerInstruction(model_type, request.task, item.question);
    absl::StatusOr<std::string> prompt = format->Apply(text);
    if (!prompt.ok()) return prompt.status();
    absl::StatusOr<GenerateReply> reply =
        (*answerer)->Answer(item.image_path, *prompt, request.max_new_tokens);
    if (!reply.ok()) {
      return absl::Status(
          reply.status().code(),
          absl::StrCat(caption ? "image " : "question ", item.id, ": ", reply.status().message()));
    }
    std::string answer(absl::StripAsciiWhitespace(reply->text));
    summary.seconds += reply->seconds;
    if (caption) {
      results.push_back({{"image_id", item.image_id}, {"caption", answer}});
    } else {
      while (!answer.empty() && answer.back() == '.') answer.pop_back();
      if (request.task == "aokvqa") {
        results[item.id] = {{"multiple_choice", PickChoice(answer, item.choices)},
                            {"direct_answer", answer}};
      } else {
        results.push_back({{"question_id", std::stoll(item.id)}, {"answer", answer}});
      }
    }
    ++summary.answered;
  }
  std::ofstream out(request.out_path);
  out << results.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", request.out_path));
  return summary;
}

int AnswerCommand(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "answer: unexpected argument %s\n", args[0].c_str());
    return 2;
  }
  AnswerRequest r;
  r.model_dir = absl::GetFlag(FLAGS_model);
  r.task = absl::GetFlag(FLAGS_task);
  r.input_path =
      r.task == "caption" ? absl::GetFlag(FLAGS_annotations) : absl::GetFlag(FLAGS_questions);
  r.images_dir = absl::GetFlag(FLAGS_images);
  r.out_path = absl::GetFlag(FLAGS_out);
  r.template_name = absl::GetFlag(FLAGS_template).empty() ? "auto" : absl::GetFlag(FLAGS_template);
  r.caption_prompt = absl::GetFlag(FLAGS_prompt);
  r.limit = absl::GetFlag(FLAGS_limit);
  r.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  r.precision = absl::GetFlag(FLAGS_precision).empty() ? "fp32" : absl::GetFlag(FLAGS_precision);
  r.device = absl::GetFlag(FLAGS_device);
  r.adapter_state = absl::GetFlag(FLAGS_adapter_state);
  if (r.model_dir.empty() || r.input_path.empty() || r.images_dir.empty() || r.out_path.empty()) {
    std::fprintf(stderr,
                 "answer: --model, --questions (--annotations with --task caption), --images "
                 "and --out are required\n");
    return 2;
  }
  if (r.task != "vqa" && r.task != "aokvqa" && r.task != "caption") {
    std::fprintf(stderr, "answer: --task %s: not vqa, aokvqa or caption\n", r.task.c_str());
    return 2;
  }
  if (!r.caption_prompt.empty() && r.task != "caption") {
    std::fprintf(stderr, "answer: --prompt is the caption instruction (--task caption)\n");
    return 2;
  }
  absl::StatusOr<AnswerSummary> summary = RunAnswer(r);
  if (!summary.ok()) {
    std::fprintf(stderr, "answer: %s\n", std::string(summary.status().message()).c_str());
    return 1;
  }
  std::fprintf(stderr, "answer: %lld %s, %s, %.2f s generating, wrote %s\n",
               static_cast<long long>(summary->answered),
               r.task == "caption" ? "images" : "questions", summary->prompt_format.c_str(),
               summary->seconds, r.out_path.c_str());
  return 0;
}

const char* const kPackFlags[] = {"model", "precision", "device", nullptr};

int PackCommand(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "pack: unexpected argument %s\n", args[0].c_str());
    return 2;
  }
  ModelOptions options;
  const std::string dir = absl::GetFlag(FLAGS_model);
  options.precision = absl::GetFlag(FLAGS_precision);
  if (dir.empty() || (options.precision != "int8" && options.precision != "int4")) {
    std::fprintf(stderr, "pack: --model DIR and --precision int8|int4 are required\n");
    return 2;
  }
  absl::StatusOr<torch::Device> device = ParseDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "pack: %s\n", std::string(device.status().message()).c_str());
    return 2;
  }
  options.device = *device;
  options.weight_pack = ModelOptions::WeightPackUse::kWrite;
  ModelOptions::WeightPackReport report;
  options.weight_pack_report = &report;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<MultimodalModel>> model = LoadModel(dir, options);
  if (!model.ok()) {
    std::fprintf(stderr, "pack: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!report.read.empty()) {
    std::printf("%s is up to date (loaded through it in %.1f s)\n", report.read.c_str(), seconds);
  } else {
    std::printf("wrote %s: %lld packed tensors, %.1f MB, in %.1f s\n", report.written.c_str(),
                static_cast<long long>(report.written_tensors), report.written_bytes / 1e6,
                seconds);
  }
  return 0;
}

}  // namespace cdcca::model
