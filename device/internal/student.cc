// The device runtime's student (device/internal/student.h).
#include "device/internal/student.h"

#include <torch/torch.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "compress/named_tensors.h"
#include "datasets/image.h"
#include "model/arch/answerer.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/adapter_state.h"
#include "model/runtime/generation.h"
#include "model/runtime/threads.h"
#include "model/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace cdcca::device::internal {
Student::Student(std::unique_ptr<model::Answerer> answerer, model::PromptFormat format,
                 int max_new_tokens)
    : answerer_(std::move(answerer)), format_(std::move(format)), max_new_tokens_(max_new_tokens) {}

model::AdapterOptions AdaptersOf(const RuntimeOptions& options) {
  model::AdapterOptions adapters;
  adapters.lora_rank = options.lora_rank;
  adapters.lora_alpha = options.lora_alpha;
  adapters.lora_mlp = options.lora_mlp;
  adapters.lora_qformer = options.lora_qformer;
  adapters.lora_projector = options.lora_projector;
  adapters.lora_vision = options.lora_vision;
  return adapters;
}

absl::Status Student::Init(const RuntimeOptions& options) {
  const model::AdapterOptions adapters = AdaptersOf(options);
  if (absl::Status s = answerer_->model().AddAdapters(adapters); !s.ok()) return s;
  answerer_->model().module().eval();
  absl::StatusOr<uint64_t> folder = model::FolderFingerprint(options.checkpoint_dir);
  if (!folder.ok()) return folder.status();
  absl::StatusOr<uint64_t> vision = model::TowerFingerprint(options.checkpoint_dir);
  if (!vision.ok()) return vision.status();
  vision_fingerprint_ = *vision;
  base_fingerprint_ = model::StudentBaseFingerprint(*folder, options.precision, adapters,
                                                    compress::StateDigest(Trainable()));
  return absl::OkStatus();
}

absl::StatusOr<AnswerResult> Student::Answer(const Frame& frame) {
  absl::StatusOr<std::string> prompt = format_.Apply(frame.question);
  if (!prompt.ok()) return prompt.status();
  model::VisualTokenReply visual;
  absl::StatusOr<model::GenerateReply> reply = answerer_->AnswerRgbFromTokens(
      frame.image.pixels.data(), frame.image.width, frame.image.height, "frame", *prompt,
      max_new_tokens_, &visual);
  if (!reply.ok()) return reply.status();
  AnswerResult r;
  r.text = reply->text;
  absl::StatusOr<std::vector<int32_t>> question =
      answerer_->tokenizer().Encode(frame.question, /*add_special_tokens=*/false);
  if (!question.ok()) return question.status();
  r.prompt_ids.assign(question->begin(), question->end());
  for (int64_t id : model::AnswerIds(reply->tokens, answerer_->model().eos_token_ids())) {
    r.answer_ids.push_back(static_cast<uint32_t>(id));
  }
  r.entropy = static_cast<float>(reply->mean_entropy);
  r.latency_ms = reply->seconds * 1000.0;
  r.visual.tokens = static_cast<int>(visual.tokens);
  r.visual.dim = static_cast<int>(visual.dim);
  r.visual.values = std::move(visual.features);
  r.visual.source = std::make_shared<const Frame>(frame);
  return r;
}

absl::StatusOr<std::vector<float>> Student::Scores(const VisualTokens& visual, int passes,
                                                   float dropout_p, uint64_t seed,
                                                   TokenScore kind) {
  if (visual.source == nullptr) {
    return absl::InvalidArgumentError(
        "UTS stage 2 needs the frame the tokens came from (its question)");
  }
  const Frame& frame = *visual.source;
  absl::StatusOr<std::string> prompt = format_.Apply(frame.question);
  if (!prompt.ok()) return prompt.status();
  // The passes start from the tokens the answer computed: the tower does not run again.
  absl::StatusOr<model::VisualTokenReply> reply = answerer_->VisualTokenVarianceFromTokens(
      visual.values, visual.tokens, visual.dim, *prompt, passes, dropout_p, seed);
  if (!reply.ok()) return reply.status();
  if (kind == TokenScore::kAttentionVariance) return std::move(reply->attention_variance);
  if (kind == TokenScore::kAttentionMass) return std::move(reply->attention_mass);
  if (kind == TokenScore::kVisRelative) return std::move(reply->relative_variance);
  return std::move(reply->variance);
}

absl::StatusOr<std::string> Student::FrameJpeg(const Frame& frame, int quality) {
  if (!CanSendFrames()) {
    return absl::FailedPreconditionError(
        "this folder's image processor has no fixed output size: the jpeg uplink needs one");
  }
  return answerer_->TowerInputJpeg(frame.image.pixels.data(), frame.image.width, frame.image.height,
                                   quality);
}
bool Student::CanSendFrames() const { return answerer_->TowerInputSize().ok(); }

compress::NamedTensors Student::Trainable() {
  compress::NamedTensors out;
  for (auto& [name, t] : answerer_->model().TrainableParameters()) out.emplace_back(name, t);
  return out;
}

int64_t Student::BaseBytes() { return answerer_->model().ResidentBytes(); }

absl::StatusOr<std::unique_ptr<Student>> Student::Load(const RuntimeOptions& options) {
  try {
    absl::StatusOr<std::unique_ptr<model::Answerer>> answerer =
        model::Answerer::Load(options.checkpoint_dir, options.precision, "cpu");
    if (!answerer.ok()) return answerer.status();
    absl::StatusOr<model::PromptFormat> format = model::ResolvePromptFormat(
        options.student_template, (*answerer)->model_type(), options.checkpoint_dir);
    if (!format.ok()) return format.status();
    auto student = std::unique_ptr<Student>(
        new Student(*std::move(answerer), *std::move(format), options.max_answer_tokens));
    if (absl::Status s = student->Init(options); !s.ok()) return s;
    return student;
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("loading ", options.checkpoint_dir, ": ", e.what_without_backtrace()));
  }
}

bool IsModelFolder(const std::string& dir) {
  std::ifstream in(dir + "/config.json");
  if (!in) return false;
  nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object() || !config.contains("model_type") || !config["model_type"].is_string()) {
    return false;
  }
  const std::string type = config["model_type"].get<std::string>();
  return type == "llava" || type == "blip-2" || type == "instructblip";
}

}  // namespace cdcca::device::internal
