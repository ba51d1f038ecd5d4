#include "model/arch/answerer.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "compress/uplink_codec.h"
#include "datasets/formats.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/chat_template.h"
#include "model/hub/image_processor.h"
#include "model/tokenizer/tokenizer.h"

namespace cdcca::model {
namespace {

struct PromptTemplate {
  const char* name;
  const char* format;  // {prompt} is replaced
};
// Conversation formats of the published checkpoints' model cards.
constexpr PromptTemplate kTemplates[] = {
    {"llava", "USER: <image>\n{prompt} ASSISTANT:"},
    {"vicuna",
     "A chat between a curious human and an artificial intelligence assistant. The "
     "assistant gives helpful, detailed, and polite answers to the human's questions. "
     "USER: <image>\n{prompt} ASSISTANT:"},
    {"chatml", "<|im_start|>user <image>\n{prompt}<|im_end|><|im_start|>assistant"},
};

}  // namespace

absl::StatusOr<torch::Device> ParseDevice(const std::string& name) {
  if (name == "cpu") return torch::Device(torch::kCPU);
  if (name == "cuda") {
    if (!torch::cuda::is_available()) {
      return absl::FailedPreconditionError("--device cuda: no CUDA device is available");
    }
    return torch::Device(torch::kCUDA);
  }
  return absl::InvalidArgumentError(absl::StrCat("--device ", name, ": not cpu or cuda"));
}

absl::StatusOr<std::string> ApplyPromptTemplate(const std::string& name,
                                                const std::string& prompt) {
  if (name.empty()) return prompt;
  std::string known;
  for (const PromptTemplate& t : kTemplates) {
    if (name == t.name) return absl::StrReplaceAll(t.format, {{"{prompt}", prompt}});
    absl::StrAppend(&known, known.empty() ? "" : ", ", t.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--template ", name, ": unknown (known: ", known, ")"));
}

absl::StatusOr<std::string> ResolvePromptTemplate(const std::string& name,
                                                  const std::string& model_type) {
  std::string resolved = name;
  if (name == "auto") resolved = model_type == "llava" ? "llava" : "";
  if (name == "none") resolved = "";
  if (absl::StatusOr<std::string> t = ApplyPromptTemplate(resolved, "q"); !t.ok()) {
    return t.status();
  }
  return resolved;
}

absl::StatusOr<PromptFormat> PromptFormat::Named(const std::string& name) {
  if (absl::StatusOr<std::string> t = ApplyPromptTemplate(name, "q"); !t.ok()) return t.status();
  PromptFormat f;
  f.name_ = name;
  return f;
}

absl::StatusOr<PromptFormat> PromptFormat::Chat(ChatTemplate chat) {
  PromptFormat f;
  f.chat_ = std::make_shared<const ChatTemplate>(std::move(chat));
  if (absl::StatusOr<std::string> t = f.Apply("q"); !t.ok()) return t.status();
  return f;
}

absl::StatusOr<std::string> PromptFormat::Apply(const std::string& text) const {
  if (chat_ != nullptr) {
    return RenderChatTemplate(*chat_, OneImageUserTurn(text), /*add_generation_prompt=*/true);
  }
  return ApplyPromptTemplate(name_, text);
}

std::string PromptFormat::Describe() const {
  if (chat_ != nullptr) return absl::StrCat("chat template ", chat_->source);
  return name_.empty() ? "none" : absl::StrCat("template ", name_);
}

absl::StatusOr<PromptFormat> ResolvePromptFormat(const std::string& name,
                                                 const std::string& model_type,
                                                 const std::string& model_dir) {
  if (name == "auto" || name == "chat") {
    absl::StatusOr<std::optional<ChatTemplate>> chat = LoadChatTemplate(model_dir);
    if (!chat.ok()) return chat.status();
    if (chat->has_value()) return PromptFormat::Chat(**std::move(chat));
    if (name == "chat") {
      return absl::FailedPreconditionError(
          absl::StrCat("--template chat: ", model_dir, " has no chat template"));
    }
  }
  absl::StatusOr<std::string> resolved = ResolvePromptTemplate(name, model_type);
  if (!resolved.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(resolved.status().message(), "; or auto, chat, none"));
  }
  return PromptFormat::Named(*resolved);
}

absl::StatusOr<std::unique_ptr<Answerer>> Answerer::Load(const std::string& model_dir,
                                                         const std::string& precision,
                                                         const std::string& device_name) {
  absl::StatusOr<torch::Device> device = ParseDevice(device_name);
  if (!device.ok()) return device.status();
  ModelOptions options;
  options.precision = precision;
  options.device = *device;
  auto a = std::unique_ptr<Answerer>(new Answerer());
  absl::StatusOr<std::unique_ptr<MultimodalModel>> model = LoadModel(model_dir, options);
  if (!model.ok()) return model.status();
  a->model_ = *std::move(model);
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tok =
      tokenizer::Tokenizer::FromFolder(model_dir);
  if (!tok.ok()) return tok.status();
  a->tokenizer_ = *std::move(tok);
  const std::string qformer_dir = model_dir + "/qformer_tokenizer";
  if (std::filesystem::is_directory(qformer_dir)) {
    absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> qtok =
        tokenizer::Tokenizer::FromFolder(qformer_dir);
    if (!qtok.ok()) return qtok.status();
    a->qformer_tokenizer_ = *std::move(qtok);
  }
  absl::StatusOr<ImageProcessorConfig> proc = LoadImageProcessorConfig(model_dir);
  if (!proc.ok()) return proc.status();
  // transformers 5's AutoProcessor (what the model's processor uses) runs the torchvision
  // backend; its pixels are what the checkpoints are checked against.
  proc->backend = ImageBackend::kTorchvision;
  a->processor_ = std::make_unique<ImageProcessorConfig>(*std::move(proc));
  a->tower_input_size_ = FixedOutputSize(*a->processor_);
  return a;
}

Answerer::~Answerer() = default;

absl::StatusOr<GenerateReply> Answerer::Answer(const std::string& image_path,
                                               const std::string& prompt, int64_t max_new_tokens) {
  absl::StatusOr<datasets::Image> image = datasets::LoadImageRgb(image_path);
  if (!image.ok()) return image.status();
  return AnswerRgb(image->pixels.data(), image->width, image->height, image_path, prompt,
                   max_new_tokens);
}

std::string Answerer::model_type() const { return model_->model_type(); }

absl::StatusOr<std::pair<int, int>> Answerer::TowerInputSize() const { return tower_input_size_; }

absl::StatusOr<std::pair<int, int>> Answerer::FixedOutputSize(
    const ImageProcessorConfig& processor) {
  // Two probes of opposite aspect: a fixed output size gives the same size for both.
  std::pair<int, int> sizes[2];
  const int shapes[2][2] = {{640, 480}, {480, 640}};
  for (int i = 0; i < 2; ++i) {
    const std::vector<uint8_t> probe(static_cast<size_t>(shapes[i][0]) * shapes[i][1] * 3, 0);
    absl::StatusOr<RgbImage> resized =
        ResizeAndCrop(processor, probe.data(), shapes[i][0], shapes[i][1]);
    if (!resized.ok()) return resized.status();
    sizes[i] = {resized->width, resized->height};
  }
  if (sizes[0] != sizes[1]) {
    return absl::FailedPreconditionError(
        absl::StrCat("the image processor's output size depends on the image (", sizes[0].first,
                     "x", sizes[0].second, " and ", sizes[1].first, "x", sizes[1].second,
                     "): the jpeg uplink needs a fixed tower input"));
  }
  return sizes[0];
}

absl::StatusOr<std::string> Answerer::TowerInputJpeg(const uint8_t* rgb, int width, int height,
                                                     int quality) const {
  absl::StatusOr<RgbImage> resized = ResizeAndCrop(*processor_, rgb, width, height);
  if (!resized.ok()) return resized.status();
  datasets::Image image;
  image.width = resized->width;
  image.height = resized->height;
  image.pixels = std::move(resized->pixels);
  return datasets::EncodeJpeg(image, quality);
}

absl::StatusOr<datasets::Image> Answerer::DecodeTowerFrame(absl::string_view jpeg,
                                                           const std::string& source) const {
  absl::StatusOr<std::pair<int, int>> expected = TowerInputSize();
  if (!expected.ok()) return expected.status();
  absl::StatusOr<compress::JpegSize> declared = compress::ReadJpegSize(jpeg);
  if (!declared.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", declared.status().message()));
  }
  if (declared->width != expected->first || declared->height != expected->second) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": a ", declared->width, "x",
                                                   declared->height, " frame, but the tower takes ",
                                                   expected->first, "x", expected->second));
  }
  absl::StatusOr<datasets::Image> image = datasets::DecodeImageRgb(jpeg, source);
  if (!image.ok()) return image.status();
  if (image->width != expected->first || image->height != expected->second) {
    return absl::DataLossError(absl::StrCat(source, ": decoded to another size than declared"));
  }
  return image;
}

absl::StatusOr<PixelValues> Answerer::TowerPixelsOfJpeg(absl::string_view jpeg,
                                                        const std::string& source) const {
  absl::StatusOr<datasets::Image> image = DecodeTowerFrame(jpeg, source);
  if (!image.ok()) return image.status();
  RgbImage rgb;
  rgb.width = image->width;
  rgb.height = image->height;
  rgb.pixels = std::move(image->pixels);
  return RescaleNormalizePad(*processor_, rgb);
}

absl::StatusOr<VisualTokenReply> Answerer::TowerTokensOfJpeg(absl::string_view jpeg,
                                                             const std::string& source) {
  absl::StatusOr<PixelValues> pixels = TowerPixelsOfJpeg(jpeg, source);
  if (!pixels.ok()) return pixels.status();
  const auto start = std::chrono::steady_clock::now();
  MultimodalInputs in;
  in.pixel_values =
      torch::from_blob(pixels->data.data(), {1, pixels->channels, pixels->height, pixels->width},
                       torch::kFloat)
          .clone();
  absl::StatusOr<torch::Tensor> tokens = model_->EncodeImages(in);
  if (!tokens.ok()) return tokens.status();
  torch::Tensor v = tokens->select(0, 0).contiguous();
  VisualTokenReply reply;
  reply.tokens = v.size(0);
  reply.dim = v.size(1);
  reply.features.assign(v.data_ptr<float>(), v.data_ptr<float>() + v.numel());
  reply.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return reply;
}

absl::Status Answerer::Prepare(const uint8_t* rgb, int width, int height, const std::string& source,
                               const std::string& prompt, MultimodalInputs* in,
                               GenerateReply* ids_out) {
  absl::StatusOr<PixelValues> pixels = PreprocessImage(*processor_, rgb, width, height);
  if (!pixels.ok()) {
    return absl::Status(pixels.status().code(),
                        absl::StrCat(source, ": ", pixels.status().message()));
  }
  in->pixel_values =
      torch::from_blob(pixels->data.data(), {1, pixels->channels, pixels->height, pixels->width},
                       torch::kFloat)
          .clone();
  return PrepareText(prompt, in, ids_out);
}

absl::Status Answerer::PrepareText(const std::string& prompt, MultimodalInputs* in,
                                   GenerateReply* ids_out) {
  // Tokenize, then expand the image placeholder on ids: LLaVA's one `<image>` token becomes
  // one per image feature, BLIP-2 / InstructBLIP get their query tokens in front, as the
  // processors of transformers 5 lay out input_ids.
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(prompt);
  if (!ids.ok()) return ids.status();
  ids_out->prompt_ids.assign(ids->begin(), ids->end());
  ids_out->input_ids = model_->ExpandImageTokens(ids_out->prompt_ids);
  in->input_ids = torch::tensor(ids_out->input_ids, torch::kLong).unsqueeze(0);
  if (qformer_tokenizer_ != nullptr) {
    absl::StatusOr<std::vector<int32_t>> q = qformer_tokenizer_->Encode(prompt);
    if (!q.ok()) return q.status();
    in->qformer_input_ids =
        torch::tensor(std::vector<int64_t>(q->begin(), q->end()), torch::kLong).unsqueeze(0);
    in->qformer_attention_mask = torch::ones_like(in->qformer_input_ids);
  }
  return absl::OkStatus();
}

absl::StatusOr<VisualTokenReply> Answerer::VisualTokenVarianceRgb(
    const uint8_t* rgb, int width, int height, const std::string& source, const std::string& prompt,
    int passes, double dropout_p, uint64_t seed) {
  MultimodalInputs in;
  GenerateReply ids;
  if (absl::Status s = Prepare(rgb, width, height, source, prompt, &in, &ids); !s.ok()) return s;
  return VisualTokenPassesOn(in, passes, dropout_p, seed);
}

absl::StatusOr<VisualTokenReply> Answerer::VisualTokenVarianceFromTokens(
    const std::vector<float>& tokens, int64_t count, int64_t dim, const std::string& prompt,
    int passes, double dropout_p, uint64_t seed) {
  if (count <= 0 || dim <= 0 || tokens.size() != static_cast<size_t>(count * dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("UTS stage 2: ", tokens.size(), " token values are not ", count, " x ", dim));
  }
  MultimodalInputs in;
  GenerateReply ids;
  if (absl::Status s = PrepareText(prompt, &in, &ids); !s.ok()) return s;
  in.visual_tokens =
      torch::from_blob(const_cast<float*>(tokens.data()), {1, count, dim}, torch::kFloat).clone();
  return VisualTokenPassesOn(in, passes, dropout_p, seed);
}

absl::StatusOr<VisualTokenReply> Answerer::VisualTokenPassesOn(const MultimodalInputs& in,
                                                               int passes, double dropout_p,
                                                               uint64_t seed) {
  VisualTokenPassOptions o;
  o.passes = passes;
  o.dropout_p = dropout_p;
  o.seed = seed;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<VisualTokenPasses> passes_out = model_->StochasticVisualTokens(in, o);
  if (!passes_out.ok()) return passes_out.status();
  VisualTokenReply reply;
  reply.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  torch::Tensor tokens = passes_out->tokens.contiguous();
  reply.tokens = tokens.size(0);
  reply.dim = tokens.size(1);
  reply.features.assign(tokens.data_ptr<float>(), tokens.data_ptr<float>() + tokens.numel());
  torch::Tensor variance = passes_out->variance.to(torch::kFloat).contiguous();
  reply.variance.assign(variance.data_ptr<float>(), variance.data_ptr<float>() + variance.numel());
  for (auto [out, t] : {std::pair{&reply.relative_variance, passes_out->relative_variance},
                        std::pair{&reply.attention_mass, passes_out->mass.mean(0)},
                        std::pair{&reply.attention_variance, PassVariance(passes_out->mass)}}) {
    torch::Tensor c = t.to(torch::kFloat).contiguous();
    out->assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return reply;
}

absl::StatusOr<GenerateReply> Answerer::AnswerRgb(const uint8_t* rgb, int width, int height,
                                                  const std::string& source,
                                                  const std::string& prompt, int64_t max_new_tokens,
                                                  bool with_entropy) {
  GenerateReply reply;
  MultimodalInputs in;
  if (absl::Status s = Prepare(rgb, width, height, source, prompt, &in, &reply); !s.ok()) {
    return s;
  }
  GreedyOptions g;
  g.max_new_tokens = max_new_tokens;
  g.eos_token_ids = model_->eos_token_ids();
  g.keep_step_logits = with_entropy;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<GreedyResult> result = model_->Generate(in, g);
  if (!result.ok()) return result.status();
  reply.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Finish(*result, &reply);
  return reply;
}

absl::StatusOr<GenerateReply> Answerer::AnswerRgbFromTokens(const uint8_t* rgb, int width,
                                                            int height, const std::string& source,
                                                            const std::string& prompt,
                                                            int64_t max_new_tokens,
                                                            VisualTokenReply* visual) {
  GenerateReply reply;
  MultimodalInputs in;
  if (absl::Status s = Prepare(rgb, width, height, source, prompt, &in, &reply); !s.ok()) {
    return s;
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<torch::Tensor> tokens = model_->EncodeImages(in);
  if (!tokens.ok()) return tokens.status();
  TokenInputs t;
  t.visual_tokens = *tokens;
  t.input_ids = in.input_ids;
  t.qformer_input_ids = in.qformer_input_ids;
  t.qformer_attention_mask = in.qformer_attention_mask;
  GreedyOptions g;
  g.max_new_tokens = max_new_tokens;
  g.eos_token_ids = model_->eos_token_ids();
  g.keep_step_logits = true;
  absl::StatusOr<GreedyResult> result = model_->GenerateFromTokens(t, g);
  if (!result.ok()) return result.status();
  reply.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Finish(*result, &reply);
  if (visual != nullptr) {
    torch::Tensor v = tokens->select(0, 0).contiguous();
    visual->tokens = v.size(0);
    visual->dim = v.size(1);
    visual->features.assign(v.data_ptr<float>(), v.data_ptr<float>() + v.numel());
    visual->variance.clear();
    visual->seconds = 0;
  }
  return reply;
}

void Answerer::Finish(const GreedyResult& result, GenerateReply* reply) const {
  reply->tokens = result.tokens.empty() ? std::vector<int64_t>{} : result.tokens[0];
  const std::vector<int32_t> tokens32(reply->tokens.begin(), reply->tokens.end());
  reply->text = tokenizer_->Decode(tokens32, /*skip_special_tokens=*/true);
  if (result.first_logits.defined()) {
    torch::Tensor f = result.first_logits[0].contiguous();
    reply->first_logits.assign(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
  }
  reply->mean_entropy = MeanStepEntropy(result, 0);
}

}  // namespace cdcca::model
