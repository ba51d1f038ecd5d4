#include "device/inference_runtime.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "compress/named_tensors.h"
#include "datasets/tokenizer.h"
#include "device/internal/hub_student.h"
#include "model/family/checkpoint.h"
#include "model/family/token_probe.h"
#include "model/family/token_scores.h"
#include "model/family/trainable.h"
#include "model/hub/safetensors.h"
#include "model/runtime/threads.h"
#include "nlohmann/json.hpp"

namespace cdcca::device {

struct InferenceRuntime::Impl {
  RuntimeOptions options;
  datasets::Tokenizer tokenizer = datasets::Tokenizer::SceneLanguage();
  model::VisionEncoder encoder{nullptr};
  model::Blip2Tower student{nullptr};
  model::TokenProbe probe{nullptr};  // null when the checkpoint has no probe.safetensors
  int image_size = 64;
  // A Hugging Face folder's student instead of the family's encoder and student.
  std::unique_ptr<internal::HubStudent> hub;
  uint64_t hub_draws ABSL_GUARDED_BY(mu) = 0;  // unseeded stage-2 draws so far

  // Guards the student's trainable tensors and `version`: readers answer, writers apply.
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

torch::Tensor ImagesToTensor(const std::vector<Frame>& frames, int size) {
  torch::Tensor batch =
      torch::empty({static_cast<int64_t>(frames.size()), size, size, 3}, torch::kUInt8);
  for (size_t i = 0; i < frames.size(); ++i) {
    const datasets::Image& src = frames[i].image;
    datasets::Image img =
        (src.width == size && src.height == size)
            ? src
            : datasets::Resize(src, size, size, datasets::Interpolation::kBilinear);
    std::memcpy(batch[static_cast<int64_t>(i)].data_ptr<uint8_t>(), img.pixels.data(),
                img.pixels.size());
  }
  return batch.permute({0, 3, 1, 2}).to(torch::kFloat32).div_(255.0f).contiguous();
}

}  // namespace

namespace internal {

bool IsHubFolder(const std::string& dir, bool family_as_hub) {
  std::ifstream in(dir + "/config.json");
  if (!in) return false;
  nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object() || !config.contains("model_type") || !config["model_type"].is_string()) {
    return false;
  }
  if (!family_as_hub && config.contains("cdcca") && config["cdcca"].is_object() &&
      config["cdcca"].contains("family")) {
    return false;
  }
  const std::string type = config["model_type"].get<std::string>();
  return type == "llava" || type == "blip-2" || type == "instructblip";
}

#ifndef CDCCA_RUNTIME_HF
absl::StatusOr<std::unique_ptr<HubStudent>> LoadHubStudent(const RuntimeOptions& options) {
  return absl::UnimplementedError(absl::StrCat(
      options.checkpoint_dir,
      " is a Hugging Face folder, and this build has no Hugging Face tokenizers (PCRE2/ICU "
      "missing at configure time)"));
}
#endif

}  // namespace internal

InferenceRuntime::InferenceRuntime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
InferenceRuntime::~InferenceRuntime() = default;

absl::StatusOr<std::unique_ptr<InferenceRuntime>> InferenceRuntime::Load(
    const RuntimeOptions& options) {
  absl::StatusOr<model::Precision> precision = model::ParsePrecision(options.precision);
  if (!precision.ok()) return precision.status();
  if (options.max_answer_tokens < 1 || options.max_answer_tokens > 64) {
    return absl::InvalidArgumentError("max_answer_tokens must be in 1-64");
  }
  model::SetIntraOpThreads(options.threads);
  if (internal::IsHubFolder(options.checkpoint_dir, options.family_as_hub)) {
    absl::StatusOr<std::unique_ptr<internal::HubStudent>> hub = internal::LoadHubStudent(options);
    if (!hub.ok()) return hub.status();
    auto impl = std::make_unique<Impl>();
    impl->options = options;
    impl->hub = *std::move(hub);
    absl::MutexLock lock(&impl->mu);
    impl->trainable = impl->hub->Trainable();
    return std::unique_ptr<InferenceRuntime>(new InferenceRuntime(std::move(impl)));
  }
  absl::StatusOr<model::FamilyCheckpoint> family =
      model::LoadFamily(options.checkpoint_dir, *precision);
  if (!family.ok()) return family.status();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  absl::StatusOr<datasets::Tokenizer> tokenizer =
      datasets::Tokenizer::Load(options.checkpoint_dir + "/tokenizer.json");
  if (tokenizer.ok()) {
    impl->tokenizer = *std::move(tokenizer);
  } else if (!absl::IsNotFound(tokenizer.status())) {
    return tokenizer.status();
  }
  impl->encoder = family->encoder;
  impl->student = family->student;
  absl::StatusOr<model::TokenProbe> probe =
      model::LoadTokenProbe(options.checkpoint_dir + "/probe.safetensors");
  if (probe.ok()) {
    impl->probe = *probe;
  } else if (!absl::IsNotFound(probe.status())) {
    return probe.status();
  }
  impl->encoder->eval();
  impl->student->eval();
  impl->image_size = family->config.vision.image_size;
  {
    absl::MutexLock lock(&impl->mu);
    for (auto& [name, t] : model::TrainableParameters(*impl->student)) {
      impl->trainable.emplace_back(name, t);
    }
  }
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
  if (impl_->hub != nullptr) {
    // One frame at a time; the model is not thread-safe, so answers exclude each other (and
    // updates).
    std::vector<AnswerResult> out;
    for (const Frame& f : frames) {
      absl::MutexLock lock(&impl_->mu);
      absl::StatusOr<AnswerResult> r = CatchTorch("answer", [&]() -> absl::StatusOr<AnswerResult> {
        torch::NoGradGuard no_grad;
        return impl_->hub->Answer(f);
      });
      if (!r.ok()) return r.status();
      out.push_back(*std::move(r));
    }
    return out;
  }
  return CatchTorch("answer", [&]() -> absl::StatusOr<std::vector<AnswerResult>> {
    torch::NoGradGuard no_grad;
    const auto start = std::chrono::steady_clock::now();
    const int64_t b = static_cast<int64_t>(frames.size());
    std::vector<std::vector<int>> prompts;
    int64_t longest = 1;
    for (const Frame& f : frames) {
      prompts.push_back(impl_->tokenizer.Encode(f.question, /*add_bos=*/true));
      longest = std::max<int64_t>(longest, static_cast<int64_t>(prompts.back().size()));
    }
    // Left-padded prompts: the answer starts at the same position in every row.
    torch::Tensor ids = torch::zeros({b, longest}, torch::kLong);
    torch::Tensor valid = torch::zeros({b, longest}, torch::kBool);
    for (int64_t i = 0; i < b; ++i) {
      const auto& p = prompts[static_cast<size_t>(i)];
      const int64_t off = longest - static_cast<int64_t>(p.size());
      for (size_t j = 0; j < p.size(); ++j) {
        ids[i][off + static_cast<int64_t>(j)] = p[j];
        valid[i][off + static_cast<int64_t>(j)] = true;
      }
    }
    torch::Tensor images = ImagesToTensor(frames, impl_->image_size);
    torch::Tensor visual = impl_->encoder->forward(images).contiguous();
    model::GenerateResult gen;
    {
      absl::ReaderMutexLock lock(&impl_->mu);
      gen = impl_->student->Generate(visual, torch::Tensor(), ids, valid,
                                     impl_->options.max_answer_tokens, datasets::Tokenizer::kEos);
    }
    torch::Tensor entropy = model::MeanTokenEntropy(gen).contiguous();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::vector<AnswerResult> out(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i) {
      AnswerResult& r = out[static_cast<size_t>(i)];
      const int64_t len = gen.lengths[i].item<int64_t>();
      std::vector<int> answer;
      for (int64_t t = 0; t < len; ++t)
        answer.push_back(static_cast<int>(gen.tokens[i][t].item<int64_t>()));
      r.text = impl_->tokenizer.Decode(answer);
      r.answer_ids.assign(answer.begin(), answer.end());
      r.prompt_ids.assign(prompts[static_cast<size_t>(i)].begin(),
                          prompts[static_cast<size_t>(i)].end());
      r.entropy = entropy[i].item<float>();
      r.latency_ms = ms;
      torch::Tensor v = visual[i];
      r.visual.tokens = static_cast<int>(v.size(0));
      r.visual.dim = static_cast<int>(v.size(1));
      r.visual.values.assign(v.data_ptr<float>(), v.data_ptr<float>() + v.numel());
    }
    return out;
  });
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
  if (impl_->hub != nullptr) {
    const TokenScore kind = EffectiveScore(score);
    if (kind != TokenScore::kVis && kind != TokenScore::kAttentionVariance &&
        kind != TokenScore::kAttentionMass) {
      return absl::FailedPreconditionError(absl::StrCat(
          "token score ", model::TokenScoreName(score),
          ": a Hugging Face folder scores visual tokens by vis (Eq. 3), attention_variance or "
          "attention_mass"));
    }
    if (!(dropout_p > 0 && dropout_p < 1)) {
      return absl::InvalidArgumentError("dropout_p must be in (0, 1) on a Hugging Face folder");
    }
    absl::MutexLock lock(&impl_->mu);
    const uint64_t draw = seed.has_value() ? *seed : impl_->hub_draws++;
    return CatchTorch("token scores", [&]() -> absl::StatusOr<std::vector<float>> {
      torch::NoGradGuard no_grad;
      return impl_->hub->Scores(visual, passes, dropout_p, draw, kind);
    });
  }
  // Seeded calls hold this for their whole draw (TokenScores' `seed`).
  static absl::Mutex seeded_draws(absl::kConstInit);
  std::optional<absl::MutexLock> seeded;
  if (seed.has_value()) seeded.emplace(&seeded_draws);
  return CatchTorch("token scores", [&]() -> absl::StatusOr<std::vector<float>> {
    torch::NoGradGuard no_grad;
    if (seed.has_value()) torch::manual_seed(*seed);
    torch::Tensor tokens = torch::from_blob(const_cast<float*>(visual.values.data()),
                                            {1, visual.tokens, visual.dim}, torch::kFloat32)
                               .clone();
    const model::TokenScoreKind kind = EffectiveScore(score);
    torch::Tensor probe_entropy;
    if (model::UsesProbe(kind)) {  // the probe is frozen: no lock needed
      if (!impl_->probe) {
        return absl::FailedPreconditionError(absl::StrCat(
            "token score ", model::TokenScoreName(kind), " needs ", impl_->options.checkpoint_dir,
            "/probe.safetensors (cdcca pretrain on the family's directory adds it)"));
      }
      probe_entropy = model::ProbeEntropyFor(*impl_->probe, tokens, kind, passes, dropout_p);
    }
    model::StochasticStats stats;
    if (model::UsesAttention(kind)) {
      absl::ReaderMutexLock lock(&impl_->mu);
      stats = impl_->student->StochasticAttention(tokens, torch::Tensor(), passes, dropout_p);
    }
    // One definition with the offline experiment (cdcca adapt-eval).
    torch::Tensor s = model::VisualTokenScores(&stats, probe_entropy, kind)[0].contiguous();
    return std::vector<float>(s.data_ptr<float>(), s.data_ptr<float>() + s.numel());
  });
}

TokenScore InferenceRuntime::EffectiveScore(TokenScore score) const {
  if (impl_->hub != nullptr && score == TokenScore::kVarianceProbe) {
    return TokenScore::kAttentionVariance;
  }
  if (score == TokenScore::kVarianceProbe && !has_probe()) return TokenScore::kAttentionVariance;
  return score;
}

bool InferenceRuntime::has_probe() const { return static_cast<bool>(impl_->probe); }

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
        "the jpeg uplink needs a Hugging Face folder whose image processor has a fixed output "
        "size (a cdcca family's cloud takes visual tokens only)");
  }
  if (visual.source == nullptr) {
    return absl::InvalidArgumentError("the jpeg uplink needs the frame the tokens came from");
  }
  absl::MutexLock lock(&impl_->mu);
  return impl_->hub->FrameJpeg(*visual.source, quality);
}

bool InferenceRuntime::CanSendFrames() const {
  return impl_->hub != nullptr && impl_->hub->CanSendFrames();
}

uint64_t InferenceRuntime::version() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return impl_->version;
}

uint64_t InferenceRuntime::StateDigest() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return compress::StateDigest(impl_->trainable);
}

uint64_t InferenceRuntime::VisionFingerprint() const {
  if (impl_->hub != nullptr) return impl_->hub->VisionFingerprint();
  return model::ModuleFingerprint(*impl_->encoder);
}

uint64_t InferenceRuntime::BaseFingerprint() const {
  if (impl_->hub != nullptr) return impl_->hub->BaseFingerprint();
  return model::BaseFingerprint(impl_->student);
}

int64_t InferenceRuntime::TrainableParameters() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  int64_t n = 0;
  for (const auto& [name, t] : impl_->trainable) n += t.numel();
  return n;
}

int64_t InferenceRuntime::BaseBytes() const {
  if (impl_->hub != nullptr) {
    absl::MutexLock lock(&impl_->mu);
    return impl_->hub->BaseBytes();
  }
  return model::LinearBaseBytes(impl_->student);
}

}  // namespace cdcca::device
