#include "device/inference_runtime.h"

#include <torch/torch.h>

#include <fstream>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "compress/named_tensors.h"
#include "device/internal/student.h"
#include "model/hub/safetensors.h"
#include "model/runtime/threads.h"
#include "nlohmann/json.hpp"

namespace cdcca::device {

struct InferenceRuntime::Impl {
  RuntimeOptions options;
  std::unique_ptr<internal::Student> student;
  uint64_t stage2_draws ABSL_GUARDED_BY(mu) = 0;  // unseeded stage-2 draws so far

  // Guards the student (the model is not thread-safe: answers, scores and updates exclude
  // each other), its trainable tensors and `version`.
  mutable absl::Mutex mu;
  compress::NamedTensors trainable ABSL_GUARDED_BY(mu);
  uint64_t version ABSL_GUARDED_BY(mu) = 0;
};

namespace {

template <typename Fn>
auto CatchTorch(const char* what, Fn fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

}  // namespace

InferenceRuntime::InferenceRuntime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
InferenceRuntime::~InferenceRuntime() = default;

absl::StatusOr<std::unique_ptr<InferenceRuntime>> InferenceRuntime::Load(
    const RuntimeOptions& options) {
  if (options.max_answer_tokens < 1 || options.max_answer_tokens > 64) {
    return absl::InvalidArgumentError("max_answer_tokens must be in 1-64");
  }
  model::SetIntraOpThreads(options.threads);
  if (!internal::IsModelFolder(options.checkpoint_dir)) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.checkpoint_dir,
        " is not a model folder: its config.json must name a llava, blip-2 or instructblip "
        "model_type (a Hugging Face folder, or a cdcca family's, which cdcca pretrain writes "
        "as one)"));
  }
  absl::StatusOr<std::unique_ptr<internal::Student>> student = internal::Student::Load(options);
  if (!student.ok()) return student.status();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->student = *std::move(student);
  absl::MutexLock lock(&impl->mu);
  impl->trainable = impl->student->Trainable();
  return std::unique_ptr<InferenceRuntime>(new InferenceRuntime(std::move(impl)));
}

absl::StatusOr<std::vector<AnswerResult>> InferenceRuntime::Answer(
    const std::vector<Frame>& frames) {
  if (frames.empty()) return std::vector<AnswerResult>();
  for (size_t i = 0; i < frames.size(); ++i) {
    if (frames[i].image.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("frame ", i, " has no image"));
    }
  }
  // One frame at a time; the model is not thread-safe, so answers exclude each other (and
  // updates).
  std::vector<AnswerResult> out;
  for (const Frame& f : frames) {
    absl::MutexLock lock(&impl_->mu);
    absl::StatusOr<AnswerResult> r = CatchTorch("answer", [&]() -> absl::StatusOr<AnswerResult> {
      torch::NoGradGuard no_grad;
      return impl_->student->Answer(f);
    });
    if (!r.ok()) return r.status();
    out.push_back(*std::move(r));
  }
  return out;
}

absl::StatusOr<std::vector<float>> InferenceRuntime::TokenScores(const VisualTokens& visual,
                                                                 int passes, float dropout_p,
                                                                 TokenScore score,
                                                                 std::optional<uint64_t> seed) {
  if (visual.tokens <= 0 || visual.dim <= 0 ||
      visual.values.size() != static_cast<size_t>(visual.tokens) * visual.dim) {
    return absl::InvalidArgumentError("visual tokens do not hold tokens x dim values");
  }
  if (passes < 1 || passes > 64) return absl::InvalidArgumentError("passes must be in 1-64");
  const TokenScore kind = EffectiveScore(score);
  if (!model::DeviceComputes(kind)) {
    return absl::FailedPreconditionError(absl::StrCat("token score ", model::TokenScoreName(score),
                                                      ": the device scores visual tokens by ",
                                                      model::DeviceScoreNames()));
  }
  if (!(dropout_p > 0 && dropout_p < 1)) {
    return absl::InvalidArgumentError("dropout_p must be in (0, 1)");
  }
  absl::MutexLock lock(&impl_->mu);
  const uint64_t draw = seed.has_value() ? *seed : impl_->stage2_draws++;
  return CatchTorch("token scores", [&]() -> absl::StatusOr<std::vector<float>> {
    torch::NoGradGuard no_grad;
    return impl_->student->Scores(visual, passes, dropout_p, draw, kind);
  });
}

TokenScore InferenceRuntime::EffectiveScore(TokenScore score) const {
  return score == TokenScore::kVarianceProbe ? TokenScore::kAttentionVariance : score;
}

absl::Status InferenceRuntime::ApplyUpdate(absl::string_view payload) {
  absl::MutexLock lock(&impl_->mu);
  torch::NoGradGuard no_grad;
  absl::StatusOr<uint64_t> version =
      compress::ApplyUpdate(payload, impl_->version, impl_->trainable);
  if (!version.ok()) return version.status();
  impl_->version = *version;
  return absl::OkStatus();
}

absl::StatusOr<std::string> InferenceRuntime::SaveTrainableState() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return model::EncodeSafetensors(impl_->trainable, {{"version", std::to_string(impl_->version)}});
}

absl::Status InferenceRuntime::LoadTrainableState(absl::string_view bytes, uint64_t version) {
  absl::StatusOr<model::SafetensorsContents> contents = model::DecodeSafetensors(bytes);
  if (!contents.ok()) return contents.status();
  absl::MutexLock lock(&impl_->mu);
  if (contents->tensors.size() != impl_->trainable.size()) {
    return absl::InvalidArgumentError(absl::StrCat("trainable state holds ",
                                                   contents->tensors.size(), " tensors, the model ",
                                                   impl_->trainable.size()));
  }
  std::map<std::string, torch::Tensor> by_name(contents->tensors.begin(), contents->tensors.end());
  // Check everything before touching any weight.
  for (const auto& [name, live] : impl_->trainable) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(absl::StrCat("trainable state lacks tensor ", name));
    }
    if (it->second.sizes() != live.sizes() || it->second.scalar_type() != torch::kFloat32) {
      return absl::InvalidArgumentError(
          absl::StrCat("trainable state tensor ", name, " has the wrong shape or dtype"));
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, live] : impl_->trainable) live.copy_(by_name[name]);
  impl_->version = version;
  return absl::OkStatus();
}

absl::StatusOr<std::string> InferenceRuntime::FrameJpeg(const VisualTokens& visual, int quality) {
  if (!CanSendFrames()) {
    return absl::FailedPreconditionError(
        "the jpeg uplink needs a model folder whose image processor has a fixed output size");
  }
  if (visual.source == nullptr) {
    return absl::InvalidArgumentError("the jpeg uplink needs the frame the tokens came from");
  }
  absl::MutexLock lock(&impl_->mu);
  return impl_->student->FrameJpeg(*visual.source, quality);
}

bool InferenceRuntime::CanSendFrames() const { return impl_->student->CanSendFrames(); }

uint64_t InferenceRuntime::version() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return impl_->version;
}

uint64_t InferenceRuntime::StateDigest() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return compress::StateDigest(impl_->trainable);
}

uint64_t InferenceRuntime::VisionFingerprint() const { return impl_->student->VisionFingerprint(); }

uint64_t InferenceRuntime::BaseFingerprint() const { return impl_->student->BaseFingerprint(); }

int64_t InferenceRuntime::TrainableParameters() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  int64_t n = 0;
  for (const auto& [name, t] : impl_->trainable) n += t.numel();
  return n;
}

int64_t InferenceRuntime::BaseBytes() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->student->BaseBytes();
}

AnsweredFrame AnsweredFrameOf(const AnswerResult& answer, uint64_t version) {
  AnsweredFrame f;
  f.entropy = answer.entropy;
  f.tokens = answer.visual.tokens;
  f.dim = answer.visual.dim;
  f.features = answer.visual.values;
  f.question_ids = answer.prompt_ids;
  f.answer_ids = answer.answer_ids;
  f.model_version = version;
  return f;
}

FrameModel FrameModelOf(InferenceRuntime* runtime, const AnswerResult& answer) {
  const VisualTokens* visual = &answer.visual;
  FrameModel m;
  m.scores = [runtime, visual](int passes, float dropout_p, TokenScore score,
                               std::optional<uint64_t> seed) {
    return runtime->TokenScores(*visual, passes, dropout_p, score, seed);
  };
  m.jpeg = [runtime, visual](int quality) { return runtime->FrameJpeg(*visual, quality); };
  return m;
}

}  // namespace cdcca::device
