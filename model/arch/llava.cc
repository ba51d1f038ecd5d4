#include "model/arch/llava.h"

#include <ATen/CPUGeneratorImpl.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace cdcca::model {

namespace {

// The hidden-state index (0 = the embeddings, i = layer i's output) of the deepest feature
// layer: the encoder layers that run.
int64_t DeepestFeatureLayer(const LlavaConfig& config) {
  const int64_t n = config.vision.num_hidden_layers;
  int64_t deepest = 0;
  for (int64_t layer : config.vision_feature_layers) {
    deepest = std::max(deepest, layer < 0 ? layer + n + 1 : layer);
  }
  return deepest;
}

}  // namespace

torch::Tensor SelectLlavaFeatures(ClipVisionTowerImpl& tower, const LlavaConfig& config,
                                  const torch::Tensor& pixel_values) {
  const int64_t n = config.vision.num_hidden_layers;
  std::vector<torch::Tensor> states = tower.HiddenStates(pixel_values, DeepestFeatureLayer(config));
  std::vector<torch::Tensor> picked;
  for (int64_t layer : config.vision_feature_layers) {
    torch::Tensor h = states[layer < 0 ? layer + n + 1 : layer];
    if (config.vision_feature_select_strategy == "default") h = h.narrow(1, 1, h.size(1) - 1);
    picked.push_back(h);
  }
  return picked.size() == 1 ? picked[0] : torch::cat(picked, -1);
}

LlavaImpl::LlavaImpl(const LlavaConfig& config, const WeightPrecision& precision)
    : config_(config) {
  model_ = register_module("model", std::make_shared<Body>());
  vision_tower_ =
      model_->register_module("vision_tower", ClipVisionTower(config.vision, precision));
  projector_ = model_->register_module("multi_modal_projector", std::make_shared<Projector>());
  const int64_t in =
      config.vision.hidden_size * static_cast<int64_t>(config.vision_feature_layers.size());
  const int64_t out = config.text.hidden_size;
  const bool bias = config.multimodal_projector_bias;
  projector_->linear_1 =
      projector_->register_module("linear_1", Linear(LinearOptions{in, out, bias, precision}));
  projector_->linear_2 =
      projector_->register_module("linear_2", Linear(LinearOptions{out, out, bias, precision}));
  language_model_ = model_->register_module("language_model", DecoderLm(config.text, precision));
}

absl::Status LlavaImpl::Load(const ModelFolder& folder, torch::Device device) {
  LoadIntoOptions o;
  o.device = device;
  if (absl::Status s = folder.LoadInto(*vision_tower_, "model.vision_tower.", o); !s.ok()) return s;
  if (absl::Status s = folder.LoadInto(*projector_, "model.multi_modal_projector.", o); !s.ok()) {
    return s;
  }
  return language_model_->Load(folder, "model.language_model.", "lm_head.", device);
}

torch::Tensor LlavaImpl::ImageFeatures(const torch::Tensor& pixel_values) {
  return Project(SelectedFeatures(pixel_values));
}

torch::Tensor LlavaImpl::SelectedFeatures(const torch::Tensor& pixel_values) {
  return SelectLlavaFeatures(*vision_tower_, config_, pixel_values);
}

torch::Tensor LlavaImpl::Project(const torch::Tensor& selected) {
  torch::Tensor h = projector_->linear_1(selected);
  return projector_->linear_2(Activation(config_.projector_hidden_act, h));
}

void LlavaImpl::AddProjectorLora(const AdapterOptions& options) {
  at::Generator gen = at::detail::createCPUGenerator(options.seed + 2);
  AddLinearLora(projector_->linear_1, options, gen);
  AddLinearLora(projector_->linear_2, options, gen);
}

void LlavaImpl::AddVisionLora(const AdapterOptions& options) {
  at::Generator gen = at::detail::createCPUGenerator(options.seed + 3);
  for (int64_t i = 0; i < VisionLayersUsed(); ++i) {
    AddLinearLora(vision_tower_->layer(i).q_proj(), options, gen);
    AddLinearLora(vision_tower_->layer(i).v_proj(), options, gen);
  }
  if (!options.lora_vision_mlp) return;
  at::Generator mlp_gen = at::detail::createCPUGenerator(options.seed + 4);
  for (int64_t i = 0; i < VisionLayersUsed(); ++i) {
    AddLinearLora(vision_tower_->layer(i).fc1(), options, mlp_gen);
    AddLinearLora(vision_tower_->layer(i).fc2(), options, mlp_gen);
  }
}

int64_t LlavaImpl::VisionLayersUsed() const { return DeepestFeatureLayer(config_); }

absl::StatusOr<torch::Tensor> LlavaImpl::MergeEmbeddings(const torch::Tensor& input_ids,
                                                         const torch::Tensor& features) {
  torch::Tensor is_image = input_ids == config_.image_token_id;
  const int64_t count = is_image.sum().item<int64_t>();
  const int64_t want = features.size(0) * features.size(1);
  if (count != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("input_ids hold ", count, " image tokens (id ", config_.image_token_id,
                     "), the images give ", want, " features (", features.size(1), " per image)"));
  }
  // The image token id may lie past the vocabulary (older checkpoints): embed a valid id there.
  torch::Tensor ids = input_ids.masked_fill(is_image, 0);
  torch::Tensor embeds = language_model_->EmbedTokens(ids);
  torch::Tensor mask = is_image.unsqueeze(-1).expand_as(embeds);
  return embeds.masked_scatter(mask, features.to(embeds.scalar_type()));
}

namespace {

class LlavaModel : public MultimodalModel {
 public:
  LlavaModel(Llava llava, std::string image_token, std::vector<int64_t> eos, torch::Device device)
      : llava_(std::move(llava)),
        image_token_(std::move(image_token)),
        eos_(std::move(eos)),
        device_(device) {}

  std::string model_type() const override { return "llava"; }

  std::string ExpandPrompt(const std::string& prompt) const override {
    std::string repeated;
    for (int64_t i = 0; i < llava_->config().NumImageTokens(); ++i) repeated += image_token_;
    return absl::StrReplaceAll(prompt, {{image_token_, repeated}});
  }

  // InvalidArgument unless pixel_values fit the tower and input_ids are [B, T].
  absl::Status CheckInputs(const MultimodalInputs& in) const {
    const ClipVisionConfig& v = llava_->config().vision;
    const torch::Tensor& px = in.pixel_values;
    if (!px.defined() || px.dim() != 4 || px.size(1) != v.num_channels ||
        px.size(2) != v.image_size || px.size(3) != v.image_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pixel_values must be [B, ", v.num_channels, ", ", v.image_size, ", ", v.image_size,
          "], got ", px.defined() ? c10::str(px.sizes()) : std::string("none")));
    }
    if (!in.input_ids.defined() || in.input_ids.dim() != 2 || in.input_ids.size(1) < 1) {
      return absl::InvalidArgumentError("input_ids must be [B, T]");
    }
    return absl::OkStatus();
  }

  std::vector<int64_t> ExpandImageTokens(const std::vector<int64_t>& ids) const override {
    std::vector<int64_t> out;
    const LlavaConfig& c = llava_->config();
    for (int64_t id : ids) {
      if (id == c.image_token_id) {
        out.insert(out.end(), c.NumImageTokens(), id);
      } else {
        out.push_back(id);
      }
    }
    return out;
  }

  absl::StatusOr<GreedyResult> Generate(const MultimodalInputs& in,
                                        const GreedyOptions& options) override {
    if (absl::Status s = CheckInputs(in); !s.ok()) return s;
    const torch::Tensor& px = in.pixel_values;
    try {
      torch::NoGradGuard no_grad;
      llava_->eval();
      torch::Tensor features = llava_->ImageFeatures(px.to(device_));
      absl::StatusOr<torch::Tensor> embeds =
          llava_->MergeEmbeddings(in.input_ids.to(device_, torch::kLong), features);
      if (!embeds.ok()) return embeds.status();
      return GreedyGenerateFromEmbeds(llava_->language_model(), *embeds, in.attention_mask,
                                      options);
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("llava generate: ", e.what_without_backtrace()));
    }
  }

  // UTS stage 2 (VIS, multimodal_model.h): element-wise dropout on the projected image rows of the
  // LM input; F is what the first RepresentationLayer() layers add to each image row. The mass
  // (ablations) is the last prompt position's attention.
  absl::StatusOr<VisualTokenPasses> StochasticVisualTokens(
      const MultimodalInputs& in, const VisualTokenPassOptions& options) override {
    const LlavaConfig& c = llava_->config();
    const bool given = in.visual_tokens.defined();
    if (given) {
      const int64_t d = c.vision.hidden_size * static_cast<int64_t>(c.vision_feature_layers.size());
      if (in.visual_tokens.dim() != 3 || in.visual_tokens.size(1) != c.NumImageTokens() ||
          in.visual_tokens.size(2) != d) {
        return absl::InvalidArgumentError(absl::StrCat("visual_tokens must be [1, ",
                                                       c.NumImageTokens(), ", ", d, "], got ",
                                                       c10::str(in.visual_tokens.sizes())));
      }
      if (!in.input_ids.defined() || in.input_ids.dim() != 2) {
        return absl::InvalidArgumentError("input_ids must be [B, T]");
      }
    } else if (absl::Status s = CheckInputs(in); !s.ok()) {
      return s;
    }
    const torch::Tensor& image = given ? in.visual_tokens : in.pixel_values;
    if (image.size(0) != 1 || in.input_ids.size(0) != 1) {
      return absl::InvalidArgumentError(absl::StrCat("UTS stage 2 takes one image and prompt, got ",
                                                     c10::str(image.sizes()), " and input_ids ",
                                                     c10::str(in.input_ids.sizes())));
    }
    try {
      torch::NoGradGuard no_grad;
      llava_->eval();
      torch::Tensor selected =
          given ? in.visual_tokens.to(device_, llava_->language_model().precision().dtype)
                : llava_->SelectedFeatures(in.pixel_values.to(device_));
      torch::Tensor projected = llava_->Project(selected);  // [1, N, H]
      torch::Tensor ids = in.input_ids.to(device_, torch::kLong);
      const int64_t n = projected.size(1), t = ids.size(1);
      if (ids[0][t - 1].item<int64_t>() == llava_->config().image_token_id) {
        return absl::InvalidArgumentError(
            "UTS stage 2 reads the attention of the prompt's last position, which is an image "
            "token here: end the prompt with text (e.g. the template's \"ASSISTANT:\")");
      }
      absl::StatusOr<torch::Tensor> masks = VisInputMasks(options, n, projected.size(2));
      if (!masks.ok()) return masks.status();
      const int64_t m = masks->size(0);
      torch::Tensor dropped =
          projected.expand({m, -1, -1}) * masks->to(device_, projected.scalar_type());
      absl::StatusOr<torch::Tensor> embeds = llava_->MergeEmbeddings(ids.expand({m, -1}), dropped);
      if (!embeds.ok()) return embeds.status();
      torch::Tensor image_pos = (ids[0] == llava_->config().image_token_id).nonzero().squeeze(1);
      torch::Tensor mask = in.attention_mask.defined()
                               ? in.attention_mask.to(device_, torch::kLong).expand({m, t})
                               : torch::Tensor();
      std::vector<torch::Tensor> probs;  // per layer [M, heads, T]
      DecoderForwardOptions o;
      o.last_logits_only = true;
      o.last_query_attention = &probs;
      o.capture_layer = RepresentationLayer();
      // Given masks are for checks: then the model's own dropout is off.
      o.dropout_p = options.input_masks.defined() ? 0.0 : options.dropout_p;
      DecoderOutput d;
      {
        ScopedTorchSeed seeded(options.seed);
        d = llava_->language_model().Forward(*embeds, mask, nullptr, o);
      }
      torch::Tensor features =
          (d.captured.index_select(1, image_pos) - dropped).to(torch::kFloat);  // [M, N, H]
      torch::Tensor mass = torch::zeros({m, t}, torch::TensorOptions().device(device_));
      for (const torch::Tensor& p : probs) mass = mass + p.mean(1);
      VisualTokenPasses out;
      out.tokens = selected[0].to(torch::kCPU, torch::kFloat);
      SetVisScores(features, &out);
      out.mass = (mass.index_select(1, image_pos) / static_cast<double>(probs.size())).cpu();
      if (options.keep_features) {
        out.features = features.cpu();
        out.input_masks = *masks;
      }
      return out;
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("llava UTS stage 2: ", e.what_without_backtrace()));
    }
  }

  std::vector<int64_t> eos_token_ids() const override { return eos_; }
  int64_t image_token_id() const override { return llava_->config().image_token_id; }
  int64_t ResidentBytes() override { return cdcca::model::ResidentBytes(*llava_); }
  torch::Device device() const override { return device_; }

  absl::Status AddAdapters(const AdapterOptions& options) override {
    if (options.lora_qformer) {
      return absl::InvalidArgumentError(
          "lora_qformer: LLaVA has no Q-Former (it is for BLIP-2 and InstructBLIP)");
    }
    if (absl::Status s = CheckVisionMlp(options); !s.ok()) return s;
    if (absl::Status s = AddDecoderLora(llava_->language_model(), options); !s.ok()) return s;
    if (options.lora_projector) llava_->AddProjectorLora(options);
    if (options.lora_vision) llava_->AddVisionLora(options);
    train_vision_ = options.lora_vision;
    return absl::OkStatus();
  }

  // The module tree is the checkpoint's (llava.h), so names need no mapping.
  NamedTensors TrainableParameters() override {
    const std::string tower = "model.vision_tower.vision_model.";
    const std::string layers = tower + "encoder.layers.";
    const bool vision = train_vision_;
    const int64_t used = llava_->VisionLayersUsed();
    return SelectHfTrainable(
        *llava_, "model.language_model.",
        // The projector's biases, and its LoRA factors where it has them (lora_projector);
        // with lora_vision, the LoRA factors and LayerNorms of the tower's layers that run and
        // its pre-layernorm (CLIP), not post_layernorm (LLaVA reads an earlier state).
        [=](const std::string& name) {
          const bool lora = absl::EndsWith(name, ".lora_a") || absl::EndsWith(name, ".lora_b");
          if (absl::StartsWith(name, "model.multi_modal_projector.")) {
            return absl::EndsWith(name, ".bias") || lora;
          }
          if (!vision || !absl::StartsWith(name, tower)) return false;
          if (absl::StartsWith(name, tower + "pre_layrnorm.")) return true;
          if (!absl::StartsWith(name, layers)) return false;
          const std::string rest = name.substr(layers.size());
          int64_t index = -1;
          if (!absl::SimpleAtoi(rest.substr(0, rest.find('.')), &index) || index >= used) {
            return false;
          }
          return lora || absl::StrContains(rest, ".layer_norm");
        },
        [](const std::string& name) { return name; });
  }

  int64_t RepresentationLayer() const override {
    return llava_->config().text.num_hidden_layers / 2;
  }
  torch::nn::Module& module() override { return *llava_; }

  absl::StatusOr<TokenForward> ForwardTokens(const TokenInputs& in) override {
    absl::StatusOr<Merged> m = Merge(in);
    if (!m.ok()) return m.status();
    try {
      DecoderForwardOptions o;
      o.capture_layer = RepresentationLayer();
      o.logits_tail = in.logits_tail;
      DecoderOutput out = llava_->language_model().Forward(m->embeds, m->mask, nullptr, o);
      TokenForward f;
      f.logits = out.logits.to(torch::kFloat);
      f.representation = out.captured.to(torch::kFloat);
      f.queries = m->projected.to(torch::kFloat);
      f.queries_present = m->present;
      return f;
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("llava forward: ", e.what_without_backtrace()));
    }
  }

  std::pair<int64_t, int64_t> VisualTokenShape() const override {
    const LlavaConfig& c = llava_->config();
    return {c.NumImageTokens(),
            c.vision.hidden_size * static_cast<int64_t>(c.vision_feature_layers.size())};
  }

  absl::StatusOr<torch::Tensor> EncodeImages(const MultimodalInputs& in) override {
    MultimodalInputs checked = in;
    if (!checked.input_ids.defined()) checked.input_ids = torch::zeros({1, 1}, torch::kLong);
    if (absl::Status s = CheckInputs(checked); !s.ok()) return s;
    try {
      torch::NoGradGuard no_grad;
      llava_->eval();
      return llava_->SelectedFeatures(in.pixel_values.to(device_)).to(torch::kCPU, torch::kFloat);
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("llava vision tower: ", e.what_without_backtrace()));
    }
  }

  absl::StatusOr<GreedyResult> GenerateFromTokens(const TokenInputs& in,
                                                  const GreedyOptions& options) override {
    torch::NoGradGuard no_grad;
    absl::StatusOr<Merged> m = Merge(in);
    if (!m.ok()) return m.status();
    return GreedyFromTokenEmbeds(llava_->language_model(), m->embeds, m->mask, options,
                                 "llava generate");
  }

 private:
  struct Merged {
    torch::Tensor embeds;     // [B, T, H]
    torch::Tensor mask;       // [B, T] int64, dropped image tokens 0
    torch::Tensor projected;  // [B, N, H]
    torch::Tensor present;    // [B, N] bool
  };

  // The LM input for TokenInputs: projected tokens over the image positions, and the dropped
  // ones taken out of the attention mask (positions renumbered from it, as UTS stage 2 does).
  absl::StatusOr<Merged> Merge(const TokenInputs& in) {
    const LlavaConfig& c = llava_->config();
    const int64_t n = c.NumImageTokens();
    const int64_t d = c.vision.hidden_size * static_cast<int64_t>(c.vision_feature_layers.size());
    torch::Tensor v = in.visual_tokens;
    if (in.pixel_values.defined()) {
      // The tower on the frames, differentiable in its trainable part (lora_vision).
      const torch::Tensor& px = in.pixel_values;
      const int64_t size = c.vision.image_size;
      if (px.dim() != 4 || px.size(1) != c.vision.num_channels || px.size(2) != size ||
          px.size(3) != size) {
        return absl::InvalidArgumentError(absl::StrCat("pixel_values must be [B, ",
                                                       c.vision.num_channels, ", ", size, ", ",
                                                       size, "], got ", c10::str(px.sizes())));
      }
      try {
        v = llava_->SelectedFeatures(px.to(device_));
      } catch (const c10::Error& e) {
        return absl::InternalError(
            absl::StrCat("llava vision tower: ", e.what_without_backtrace()));
      }
    }
    if (!v.defined() || v.dim() != 3 || v.size(1) != n || v.size(2) != d) {
      return absl::InvalidArgumentError(
          absl::StrCat("visual_tokens must be [B, ", n, ", ", d, "], got ",
                       v.defined() ? c10::str(v.sizes()) : std::string("none")));
    }
    const int64_t b = v.size(0);
    if (absl::Status s = CheckTokenInputs(in, b, n); !s.ok()) return s;
    try {
      Merged m;
      const torch::ScalarType dtype = llava_->language_model().precision().dtype;
      torch::Tensor ids = in.input_ids.to(device_, torch::kLong);
      m.projected = llava_->Project(v.to(device_, dtype));
      absl::StatusOr<torch::Tensor> embeds = llava_->MergeEmbeddings(ids, m.projected);
      if (!embeds.ok()) return embeds.status();
      if ((ids == c.image_token_id).sum(1).ne(n).any().item<bool>()) {
        return absl::InvalidArgumentError(
            absl::StrCat("every row of input_ids must hold ", n, " image tokens"));
      }
      m.embeds = *embeds;
      m.mask = in.attention_mask.defined() ? in.attention_mask.to(device_, torch::kLong).clone()
                                           : torch::ones_like(ids);
      m.present = in.visual_present.defined()
                      ? in.visual_present.to(device_, torch::kBool)
                      : torch::ones({b, n}, ids.options().dtype(torch::kBool));
      // Row-major image positions take the row's present flags in order.
      m.mask.masked_scatter_(ids == c.image_token_id, m.present.to(torch::kLong));
      return m;
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("llava inputs: ", e.what_without_backtrace()));
    }
  }

  Llava llava_;
  bool train_vision_ = false;  // AdapterOptions::lora_vision: the tower's norms are trainable
  std::string image_token_;
  std::vector<int64_t> eos_;
  torch::Device device_;
};

}  // namespace

std::unique_ptr<MultimodalModel> WrapLlavaModel(std::shared_ptr<LlavaImpl> model,
                                                std::string image_token,
                                                std::vector<int64_t> eos_token_ids,
                                                torch::Device device) {
  return std::make_unique<LlavaModel>(Llava(std::move(model)), std::move(image_token),
                                      std::move(eos_token_ids), device);
}

absl::StatusOr<std::unique_ptr<MultimodalModel>> LoadLlavaModel(const ModelFolder& folder,
                                                                const WeightPrecision& precision,
                                                                torch::Device device) {
  absl::StatusOr<LlavaConfig> config = ParseLlavaConfig(folder.config(), folder.config_path());
  if (!config.ok()) return config.status();
  // transformers saves tied checkpoints without lm_head.weight.
  if (!folder.Has("lm_head.weight")) config->text.tie_word_embeddings = true;
  try {
    Llava llava(*config, precision);
    if (absl::Status s = llava->Load(folder, device); !s.ok()) return s;
    // The processor's placeholder text: processor_config.json's image_token, else "<image>".
    std::string image_token = "<image>";
    absl::StatusOr<nlohmann::json> proc = ReadJsonFile(folder.dir() + "/processor_config.json");
    if (proc.ok() && proc->is_object() && proc->contains("image_token") &&
        (*proc)["image_token"].is_string()) {
      image_token = (*proc)["image_token"].get<std::string>();
    }
    std::vector<int64_t> eos = ReadEosTokenIds(folder.dir(), config->text.eos_token_ids);
    return std::unique_ptr<MultimodalModel>(
        new LlavaModel(std::move(llava), image_token, std::move(eos), device));
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(folder.dir(), ": building llava: ", e.what_without_backtrace()));
  }
}

}  // namespace cdcca::model
