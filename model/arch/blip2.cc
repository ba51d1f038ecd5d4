#include "model/arch/blip2.h"

#include <ATen/CPUGeneratorImpl.h>

#include <map>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "model/arch/blip2_inputs.h"
#include "model/arch/row_segments.h"

namespace cdcca::model {
namespace {

// The first of `candidates` for which `<candidate><probe>` is in the folder.
absl::StatusOr<std::string> Probe(const ModelFolder& folder,
                                  std::initializer_list<const char*> candidates,
                                  const std::string& probe, const std::string& what) {
  for (const char* c : candidates) {
    if (folder.Has(std::string(c) + probe)) return std::string(c);
  }
  std::string tried;
  for (const char* c : candidates) absl::StrAppend(&tried, tried.empty() ? "" : ", ", c, probe);
  return absl::NotFoundError(
      absl::StrCat(folder.dir(), ": no ", what, " weights (looked for ", tried, ")"));
}

WeightPrecision Fp32Compute(WeightPrecision p) {
  p.dtype = torch::kFloat;
  return p;
}

// LoRA on T5's attention q and v (self- and cross-attention, encoder and decoder; with
// lora_mlp its MLP projections too), drawn as AddDecoderLora draws the decoder's.
absl::Status AddT5Lora(T5ForConditionalGenerationImpl& lm, const AdapterOptions& options) {
  if (options.lora_rank <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoRA rank must be > 0, got ", options.lora_rank));
  }
  if (!(options.lora_alpha > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoRA alpha must be > 0, got ", options.lora_alpha));
  }
  if (lm.encoder->Sublayer(0, 0).attention->q->has_lora()) {
    return absl::InvalidArgumentError("the model already has LoRA adapters");
  }
  at::Generator gen = at::detail::createCPUGenerator(options.seed);
  for (T5StackImpl* stack : {lm.encoder.get(), lm.decoder.get()}) {
    for (size_t b = 0; b < stack->num_blocks(); ++b) {
      for (size_t m = 0; m < stack->num_sublayers(); ++m) {
        T5SublayerImpl& sub = stack->Sublayer(b, m);
        if (!sub.attention.is_empty()) {
          AddLinearLora(sub.attention->q, options, gen);
          AddLinearLora(sub.attention->v, options, gen);
        } else if (options.lora_mlp) {
          T5DenseImpl& d = *sub.DenseReluDense;
          for (Linear* l : {&d.wi_0, &d.wi_1, &d.wi, &d.wo}) {
            if (!l->is_empty()) AddLinearLora(*l, options, gen);
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Blip2Prefixes> FindBlip2Prefixes(const ModelFolder& folder) {
  Blip2Prefixes p;
  absl::StatusOr<std::string> s =
      Probe(folder, {"vision_model.", "model.vision_model."}, "embeddings.class_embedding", "ViT");
  if (!s.ok()) return s.status();
  p.vision = *s;
  s = Probe(folder, {"", "model."}, "query_tokens", "query_tokens");
  if (!s.ok()) return s.status();
  p.query_tokens = *s + "query_tokens";
  s = Probe(folder, {"qformer.", "model.qformer."},
            "encoder.layer.0.attention.attention.query.weight", "Q-Former");
  if (!s.ok()) return s.status();
  p.qformer = *s;
  s = Probe(folder, {"language_projection.", "model.language_projection."}, "weight",
            "language_projection");
  if (!s.ok()) return s.status();
  p.projection = *s;
  // OPT's blocks sit under a "decoder." of their own.
  // T5: one tree (shared, encoder, decoder, lm_head) under the LM's prefix.
  if (absl::StatusOr<std::string> t5 =
          Probe(folder, {"language_model.", "model.language_model."}, "shared.weight", "T5");
      t5.ok()) {
    p.lm_body = *t5;
    p.lm_head = *t5 + "lm_head.";
    p.t5 = true;
    return p;
  }
  // OPT's blocks sit under a "decoder." of their own.
  s = Probe(folder,
            {"language_model.model.", "model.language_model.", "language_model.",
             "language_model.model.decoder.", "model.language_model.decoder."},
            "embed_tokens.weight", "language model");
  if (!s.ok()) return s.status();
  p.lm_body = *s;
  // Absent when the embeddings are tied; DecoderLm ignores the head prefix then.
  s = Probe(folder, {"language_model.lm_head.", "lm_head."}, "weight", "lm_head");
  p.lm_head = s.ok() ? *s : "lm_head.";
  return p;
}

absl::Status LoadBlip2Vision(const ModelFolder& folder, const std::string& prefix,
                             Blip2VisionModelImpl& vision, torch::Device device) {
  LoadIntoOptions options;
  options.device = device;
  const std::string first = prefix + "encoder.layers.0.self_attn.";
  if (!vision.config().qkv_bias || folder.Has(first + "qkv.bias") ||
      !folder.Has(first + "q_bias")) {
    return folder.LoadInto(vision, prefix, options);
  }
  // Separate q_bias / v_bias: everything but the fused qkv layers loads by name.
  if (absl::Status s = folder.LoadInto(*vision.embeddings, prefix + "embeddings.", options);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = folder.LoadInto(*vision.post_layernorm, prefix + "post_layernorm.", options);
      !s.ok()) {
    return s;
  }
  const int64_t h = vision.config().hidden_size;
  for (size_t i = 0; i < vision.encoder->layers->size(); ++i) {
    auto* layer = vision.encoder->layers[i]->as<Blip2VisionLayerImpl>();
    const std::string lp = absl::StrCat(prefix, "encoder.layers.", i, ".");
    for (auto& [name, module] : std::vector<std::pair<std::string, torch::nn::Module*>>{
             {"layer_norm1.", layer->layer_norm1.get()},
             {"layer_norm2.", layer->layer_norm2.get()},
             {"mlp.", layer->mlp.get()},
             {"self_attn.projection.", layer->self_attn->projection.get()}}) {
      if (absl::Status s = folder.LoadInto(*module, lp + name, options); !s.ok()) return s;
    }
    LinearImpl& qkv = *layer->self_attn->qkv;
    const torch::ScalarType dtype = qkv.options().precision.dtype;
    // The weight pack (weight_pack.h) keeps a quantized qkv weight as LoadInto would: the
    // floats are read only where it has none.
    const std::string qkv_name = lp + "self_attn.qkv.weight";
    absl::StatusOr<std::optional<QuantizedWeight>> packed = folder.PackedTensor(qkv_name, device);
    if (!packed.ok()) return packed.status();
    std::map<std::string, torch::Tensor> parts;
    for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"qkv.weight", {3 * h, h}}, {"q_bias", {h}}, {"v_bias", {h}}}) {
      if (name == "qkv.weight" && packed->has_value()) continue;
      absl::StatusOr<torch::Tensor> t = folder.Load(lp + "self_attn." + name, dtype, device);
      if (!t.ok()) return t.status();
      if (t->sizes().vec() != shape) {
        return absl::InvalidArgumentError(
            absl::StrCat(folder.FileOf(lp + "self_attn." + name), ": tensor ", lp, "self_attn.",
                         name, " has shape ", c10::str(t->sizes()), ", the model needs ",
                         c10::str(c10::IntArrayRef(shape))));
      }
      parts[name] = *std::move(t);
    }
    if (packed->has_value()) {
      if (absl::Status s = qkv.AdoptPacked("weight", **packed); !s.ok()) return s;
    } else {
      if (absl::Status s = qkv.Adopt("weight", parts["qkv.weight"]); !s.ok()) return s;
      if (const QuantizedWeight* held = qkv.Packed("weight")) folder.RecordPacked(qkv_name, *held);
    }
    if (absl::Status s = qkv.Adopt("bias", Blip2QkvBiasFromParts(parts["q_bias"], parts["v_bias"]));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

Blip2ForConditionalGenerationImpl::Blip2ForConditionalGenerationImpl(
    const Blip2Config& config, const DecoderConfig& text, const WeightPrecision& precision)
    : config_(config), precision_(precision) {
  BuildImageSide(text.hidden_size);
  language_model = register_module("language_model", DecoderLm(text, precision));
}

Blip2ForConditionalGenerationImpl::Blip2ForConditionalGenerationImpl(
    const Blip2Config& config, const T5Config& text, const WeightPrecision& precision)
    : config_(config), precision_(precision) {
  BuildImageSide(text.d_model);
  t5_language_model =
      register_module("language_model", T5ForConditionalGeneration(text, precision));
}

void Blip2ForConditionalGenerationImpl::BuildImageSide(int64_t lm_width) {
  vision_model = register_module("vision_model", Blip2VisionModel(config_.vision, precision_));
  query_tokens = register_parameter(
      "query_tokens",
      Placeholder({1, config_.num_query_tokens, config_.qformer.hidden_size}, torch::kFloat));
  qformer = register_module(
      "qformer", QFormerModel(config_.qformer, config_.instruct, Fp32Compute(precision_)));
  LinearOptions proj;
  proj.in_features = config_.qformer.hidden_size;
  proj.out_features = lm_width;
  proj.bias = true;
  proj.precision = precision_;
  language_projection = register_module("language_projection", Linear(proj));
}

torch::Tensor Blip2ForConditionalGenerationImpl::EmbedTokens(const torch::Tensor& ids) {
  return is_encoder_decoder() ? t5_language_model->EmbedTokens(ids)
                              : language_model->EmbedTokens(ids);
}

GreedyResult Blip2ForConditionalGenerationImpl::GenerateFromEmbeds(const torch::Tensor& embeds,
                                                                   const torch::Tensor& mask,
                                                                   const GreedyOptions& options) {
  if (is_encoder_decoder()) return T5GreedyGenerate(*t5_language_model, embeds, mask, options);
  return GreedyGenerateFromEmbeds(*language_model, embeds, mask, options);
}

std::vector<int64_t> Blip2ForConditionalGenerationImpl::ConfigEosTokenIds() const {
  return is_encoder_decoder() ? t5_language_model->config().eos_token_ids
                              : language_model->config().eos_token_ids;
}

absl::StatusOr<std::shared_ptr<Blip2ForConditionalGenerationImpl>>
Blip2ForConditionalGenerationImpl::FromFolder(const ModelFolder& folder,
                                              const WeightPrecision& precision,
                                              torch::Device device) {
  const std::string file = folder.config_path();
  absl::StatusOr<Blip2Config> config = ParseBlip2Config(folder.config(), file);
  if (!config.ok()) return config.status();
  auto text_json = folder.config().find("text_config");
  if (text_json == folder.config().end() || !text_json->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": field text_config is missing"));
  }
  absl::StatusOr<std::string> text_type = ConfigModelType(*text_json, file);
  if (!text_type.ok()) return text_type.status();
  std::shared_ptr<Blip2ForConditionalGenerationImpl> model;
  try {
    if (*text_type == "t5") {
      absl::StatusOr<T5Config> t5 = ParseT5Config(*text_json, file);
      if (!t5.ok()) return t5.status();
      // The head is the shared embedding unless the checkpoint has one of its own (published
      // Flan-T5 folders have; transformers 5 saves a tied one without).
      absl::StatusOr<Blip2Prefixes> p = FindBlip2Prefixes(folder);
      if (!p.ok()) return p.status();
      t5->tie_word_embeddings = !folder.Has(p->lm_head + "weight");
      model = std::make_shared<Blip2ForConditionalGenerationImpl>(*config, *t5, precision);
    } else {
      absl::StatusOr<DecoderConfig> text = ParseDecoderConfig(*text_json, file);
      if (!text.ok()) return text.status();
      model = std::make_shared<Blip2ForConditionalGenerationImpl>(*config, *text, precision);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(folder.dir(), ": building the model: ", e.what_without_backtrace()));
  }
  if (absl::Status s = model->Load(folder, device); !s.ok()) return s;
  model->eval();
  return model;
}

absl::Status Blip2ForConditionalGenerationImpl::Load(const ModelFolder& folder,
                                                     torch::Device device) {
  absl::StatusOr<Blip2Prefixes> p = FindBlip2Prefixes(folder);
  if (!p.ok()) return p.status();
  try {
    LoadIntoOptions options;
    options.device = device;
    if (absl::Status s = LoadBlip2Vision(folder, p->vision, *vision_model, device); !s.ok())
      return s;
    absl::StatusOr<torch::Tensor> q = folder.Load(p->query_tokens, torch::kFloat, device);
    if (!q.ok()) return q.status();
    if (q->sizes() != query_tokens.sizes()) {
      return absl::InvalidArgumentError(
          absl::StrCat(folder.FileOf(p->query_tokens), ": tensor ", p->query_tokens, " has shape ",
                       c10::str(q->sizes()), ", the model needs ", c10::str(query_tokens.sizes())));
    }
    {
      torch::NoGradGuard no_grad;
      query_tokens.set_data(*q);
    }
    if (absl::Status s = folder.LoadInto(*qformer, p->qformer, options); !s.ok()) return s;
    if (absl::Status s = folder.LoadInto(*language_projection, p->projection, options); !s.ok()) {
      return s;
    }
    if (is_encoder_decoder()) {
      if (!p->t5) {
        return absl::InvalidArgumentError(
            absl::StrCat(folder.dir(), ": text_config is t5 but there are no T5 weights (",
                         p->lm_body, "shared.weight)"));
      }
      return t5_language_model->Load(folder, p->lm_body, device);
    }
    return language_model->Load(folder, p->lm_body, p->lm_head, device);
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(folder.dir(), ": loading: ", e.what_without_backtrace()));
  }
}

torch::Tensor Blip2ForConditionalGenerationImpl::ImageQueries(
    const torch::Tensor& pixel_values, const torch::Tensor& qformer_input_ids,
    const torch::Tensor& qformer_attention_mask) {
  torch::Tensor image = vision_model->forward(pixel_values);
  torch::Tensor queries = query_tokens.expand({image.size(0), -1, -1});
  torch::Tensor out =
      qformer->forward(queries, image.to(torch::kFloat), qformer_input_ids, qformer_attention_mask);
  out = out.slice(1, 0, config_.num_query_tokens);
  return language_projection->forward(out.to(precision_.dtype));
}

absl::Status Blip2ForConditionalGenerationImpl::CheckImageInputs(const Blip2Inputs& in,
                                                                 bool one_image) const {
  if (config_.instruct != in.qformer_input_ids.defined()) {
    return absl::InvalidArgumentError(config_.instruct ? "InstructBLIP needs qformer_input_ids"
                                                       : "BLIP-2 takes no qformer_input_ids");
  }
  const int64_t size = config_.vision.image_size;
  const torch::Tensor& px = in.pixel_values;
  if (!px.defined() || px.dim() != 4 || (one_image && px.size(0) != 1) ||
      px.size(1) != config_.vision.num_channels || px.size(2) != size || px.size(3) != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        one_image ? "UTS stage 2 takes pixel_values [1, " : "pixel_values must be [B, ",
        config_.vision.num_channels, ", ", size, ", ", size, "], got ",
        px.defined() ? c10::str(px.sizes()) : std::string("none")));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<torch::Tensor, torch::Tensor>>
Blip2ForConditionalGenerationImpl::InputsEmbeds(const Blip2Inputs& in) {
  if (absl::Status s = CheckImageInputs(in, /*one_image=*/false); !s.ok()) return s;
  torch::Tensor queries =
      ImageQueries(in.pixel_values, in.qformer_input_ids, in.qformer_attention_mask);
  torch::Tensor text = EmbedTokens(in.input_ids);
  absl::StatusOr<torch::Tensor> merged =
      MergeBlip2Queries(text, in.input_ids, queries, config_.image_token_id);
  if (!merged.ok()) return merged.status();
  torch::Tensor mask = in.attention_mask;
  if (mask.defined() && !config_.image_token_id.has_value()) {
    mask = torch::cat({torch::ones({mask.size(0), queries.size(1)}, mask.options()), mask}, 1);
  }
  return std::make_pair(*merged, mask);
}

absl::StatusOr<torch::Tensor> Blip2ForConditionalGenerationImpl::Logits(const Blip2Inputs& in) {
  if (is_encoder_decoder()) {
    return absl::FailedPreconditionError(
        "BLIP-2 forward: a T5 language model needs decoder ids; use Generate");
  }
  try {
    torch::NoGradGuard no_grad;
    absl::StatusOr<std::pair<torch::Tensor, torch::Tensor>> e = InputsEmbeds(in);
    if (!e.ok()) return e.status();
    return language_model->Forward(e->first, e->second, nullptr).logits;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("BLIP-2 forward: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<GreedyResult> Blip2ForConditionalGenerationImpl::Generate(
    const Blip2Inputs& in, const GreedyOptions& options) {
  try {
    torch::NoGradGuard no_grad;
    absl::StatusOr<std::pair<torch::Tensor, torch::Tensor>> e = InputsEmbeds(in);
    if (!e.ok()) return e.status();
    return GenerateFromEmbeds(e->first, e->second, options);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("BLIP-2 generate: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<VisualTokenPasses> Blip2ForConditionalGenerationImpl::StochasticVisualTokens(
    const Blip2Inputs& in, const VisualTokenPassOptions& options) {
  if (in.image_embeds.defined()) {
    const int64_t n = config_.vision.NumPositions();
    if (in.image_embeds.dim() != 3 || in.image_embeds.size(0) != 1 ||
        in.image_embeds.size(1) != n || in.image_embeds.size(2) != config_.vision.hidden_size) {
      return absl::InvalidArgumentError(absl::StrCat("UTS stage 2 takes the vision tokens as [1, ",
                                                     n, ", ", config_.vision.hidden_size, "], got ",
                                                     c10::str(in.image_embeds.sizes())));
    }
    if (config_.instruct != in.qformer_input_ids.defined()) {
      return absl::InvalidArgumentError(config_.instruct ? "InstructBLIP needs qformer_input_ids"
                                                         : "BLIP-2 takes no qformer_input_ids");
    }
  } else if (absl::Status s = CheckImageInputs(in, /*one_image=*/true); !s.ok()) {
    return s;
  }
  try {
    torch::NoGradGuard no_grad;
    torch::Tensor image =
        in.image_embeds.defined()
            ? in.image_embeds.to(query_tokens.device(), torch::kFloat)
            : vision_model->forward(in.pixel_values).to(torch::kFloat);  // [1, N, E]
    absl::StatusOr<torch::Tensor> masks = VisInputMasks(options, image.size(1), image.size(2));
    if (!masks.ok()) return masks.status();
    const int64_t m = masks->size(0);
    // Given masks are for checks: then the model's own dropout is off.
    const double p = options.input_masks.defined() ? 0.0 : options.dropout_p;
    torch::Tensor qids, qmask;
    if (in.qformer_input_ids.defined()) {
      qids = in.qformer_input_ids.expand({m, -1});
      qmask = in.qformer_attention_mask.defined() ? in.qformer_attention_mask.expand({m, -1})
                                                  : torch::ones_like(qids);
    }
    std::vector<torch::Tensor> probs;          // per cross-attending layer [M, heads, Q, N]
    std::vector<torch::Tensor> contributions;  // per cross-attending layer [M, N, H]
    {
      ScopedTorchSeed seeded(options.seed);
      qformer->ForwardStochastic(query_tokens.expand({m, -1, -1}),
                                 image.expand({m, -1, -1}) * masks->to(image.device()), qids, qmask,
                                 p, &probs, &contributions);
    }
    if (probs.empty()) return absl::InternalError("the Q-Former has no cross-attention layer");
    torch::Tensor mass = torch::zeros({m, image.size(1)}, image.options());
    for (const torch::Tensor& w : probs) mass = mass + w.to(torch::kFloat).mean(1).mean(1);
    torch::Tensor features = torch::cat(contributions, -1).to(torch::kFloat);
    VisualTokenPasses out;
    out.tokens = image[0].cpu();
    SetVisScores(features, &out);
    out.mass = (mass / static_cast<double>(probs.size())).cpu();
    if (options.keep_features) {
      out.features = features.cpu();
      out.input_masks = *masks;
    }
    return out;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("BLIP-2 UTS stage 2: ", e.what_without_backtrace()));
  }
}

std::vector<int64_t> Blip2ForConditionalGenerationImpl::ExpandInputIds(
    const std::vector<int64_t>& prompt_ids) const {
  return ExpandBlip2InputIds(prompt_ids, config_.num_query_tokens, config_.image_token_id);
}

namespace {

class Blip2MultimodalModel : public MultimodalModel {
 public:
  Blip2MultimodalModel(std::shared_ptr<Blip2ForConditionalGenerationImpl> model,
                       std::vector<int64_t> eos, torch::Device device, Blip2Prefixes prefixes)
      : model_(std::move(model)),
        eos_(std::move(eos)),
        device_(device),
        prefixes_(std::move(prefixes)) {}

  std::string model_type() const override {
    return model_->config().instruct ? "instructblip" : "blip-2";
  }
  std::string ExpandPrompt(const std::string& prompt) const override { return prompt; }
  std::vector<int64_t> ExpandImageTokens(const std::vector<int64_t>& ids) const override {
    return model_->ExpandInputIds(ids);
  }

  absl::StatusOr<GreedyResult> Generate(const MultimodalInputs& inputs,
                                        const GreedyOptions& options) override {
    Blip2Inputs in{inputs.pixel_values.to(device_), inputs.input_ids.to(device_),
                   inputs.attention_mask, inputs.qformer_input_ids, inputs.qformer_attention_mask};
    if (in.attention_mask.defined()) in.attention_mask = in.attention_mask.to(device_);
    if (in.qformer_input_ids.defined()) in.qformer_input_ids = in.qformer_input_ids.to(device_);
    if (in.qformer_attention_mask.defined()) {
      in.qformer_attention_mask = in.qformer_attention_mask.to(device_);
    }
    const std::optional<int64_t> image = model_->config().image_token_id;
    if (image.has_value() && in.input_ids.dim() == 2 &&
        !in.input_ids.eq(*image).any().item<bool>()) {
      // The tokenized prompt alone: add the processor's image tokens.
      const int64_t q = model_->config().num_query_tokens;
      in.input_ids = torch::cat(
          {torch::full({in.input_ids.size(0), q}, *image, in.input_ids.options()), in.input_ids},
          1);
      if (in.attention_mask.defined()) {
        in.attention_mask =
            torch::cat({torch::ones({in.attention_mask.size(0), q}, in.attention_mask.options()),
                        in.attention_mask},
                       1);
      }
    }
    return model_->Generate(in, options);
  }

  absl::StatusOr<VisualTokenPasses> StochasticVisualTokens(
      const MultimodalInputs& inputs, const VisualTokenPassOptions& options) override {
    Blip2Inputs in;
    if (inputs.pixel_values.defined()) in.pixel_values = inputs.pixel_values.to(device_);
    if (inputs.visual_tokens.defined()) in.image_embeds = inputs.visual_tokens.to(device_);
    if (inputs.qformer_input_ids.defined()) {
      in.qformer_input_ids = inputs.qformer_input_ids.to(device_);
    }
    if (inputs.qformer_attention_mask.defined()) {
      in.qformer_attention_mask = inputs.qformer_attention_mask.to(device_);
    }
    return model_->StochasticVisualTokens(in, options);
  }

  std::vector<int64_t> eos_token_ids() const override { return eos_; }
  int64_t image_token_id() const override { return model_->config().image_token_id.value_or(-1); }
  int64_t ResidentBytes() override { return cdcca::model::ResidentBytes(*model_); }
  torch::Device device() const override { return device_; }

  absl::Status AddAdapters(const AdapterOptions& options) override {
    if (absl::Status s = CheckVisionMlp(options); !s.ok()) return s;
    if (model_->is_encoder_decoder()) {
      if (absl::Status s = AddT5Lora(*model_->t5_language_model, options); !s.ok()) return s;
    } else if (absl::Status s = AddDecoderLora(*model_->language_model, options); !s.ok()) {
      return s;
    }
    if (options.lora_qformer) {
      at::Generator gen = at::detail::createCPUGenerator(options.seed + 1);
      for (const auto& layer : *model_->qformer->encoder->layer) {
        auto* l = layer->as<QFormerLayerImpl>();
        for (QFormerAttention* a : {&l->attention, &l->crossattention}) {
          if (a->is_empty()) continue;
          AddLinearLora((*a)->attention->query, options, gen);
          AddLinearLora((*a)->attention->value, options, gen);
        }
      }
    }
    if (options.lora_projector) {
      at::Generator gen = at::detail::createCPUGenerator(options.seed + 2);
      AddLinearLora(model_->language_projection, options, gen);
    }
    if (options.lora_vision) {
      // Every layer of the tower feeds the Q-Former (through post_layernorm).
      at::Generator gen = at::detail::createCPUGenerator(options.seed + 3);
      for (const auto& layer : *model_->vision_model->encoder->layers) {
        AddLinearLora(layer->as<Blip2VisionLayerImpl>()->self_attn->qkv, options, gen);
      }
      if (options.lora_vision_mlp) {
        at::Generator mlp_gen = at::detail::createCPUGenerator(options.seed + 4);
        for (const auto& layer : *model_->vision_model->encoder->layers) {
          AddLinearLora(layer->as<Blip2VisionLayerImpl>()->mlp->fc1, options, mlp_gen);
          AddLinearLora(layer->as<Blip2VisionLayerImpl>()->mlp->fc2, options, mlp_gen);
        }
      }
    }
    train_vision_ = options.lora_vision;
    return absl::OkStatus();
  }

  // Module names -> the checkpoint's: the LM body and the query tokens sit where the folder
  // had them (FindBlip2Prefixes).
  NamedTensors TrainableParameters() override {
    const Blip2Prefixes& p = prefixes_;
    // The LoRA factors of the Q-Former (lora_qformer) and of the language projection
    // (lora_projector) are trainable too; their other weights not.
    auto lora_of = [](const std::string& name) {
      return (absl::StartsWith(name, "qformer.") ||
              absl::StartsWith(name, "language_projection.") ||
              absl::StartsWith(name, "vision_model.")) &&
             (absl::EndsWith(name, ".lora_a") || absl::EndsWith(name, ".lora_b"));
    };
    // With lora_vision, the tower's LayerNorms (layer_norm1/2 of every layer, post_layernorm).
    const bool vision = train_vision_;
    auto vision_norm = [vision](const std::string& name) {
      return vision && absl::StartsWith(name, "vision_model.") &&
             (absl::StrContains(name, "layer_norm") || absl::StrContains(name, "post_layernorm"));
    };
    return SelectHfTrainable(
        *model_, "language_model.",
        [lora_of, vision_norm](const std::string& name) {
          return name == "query_tokens" || lora_of(name) || vision_norm(name);
        },
        [&p](const std::string& name) {
          if (name == "query_tokens") return p.query_tokens;
          if (absl::StartsWith(name, "vision_model.")) {
            return p.vision + name.substr(std::string("vision_model.").size());
          }
          if (absl::StartsWith(name, "qformer.")) {
            return p.qformer + name.substr(std::string("qformer.").size());
          }
          if (absl::StartsWith(name, "language_projection.")) {
            return p.projection + name.substr(std::string("language_projection.").size());
          }
          return p.lm_body + name.substr(std::string("language_model.").size());
        });
  }

  int64_t RepresentationLayer() const override {
    // T5: R is the decoder's state, which reads the answer as a decoder LM does.
    if (model_->is_encoder_decoder()) {
      return model_->t5_language_model->config().num_decoder_layers / 2;
    }
    return model_->language_model->config().num_hidden_layers / 2;
  }
  torch::nn::Module& module() override { return *model_; }

  absl::StatusOr<TokenForward> ForwardTokens(const TokenInputs& in) override {
    if (model_->is_encoder_decoder()) return ForwardTokensT5(in);
    absl::StatusOr<Merged> m = Merge(in);
    if (!m.ok()) return m.status();
    try {
      DecoderForwardOptions o;
      o.capture_layer = RepresentationLayer();
      const int64_t t = in.input_ids.size(1), offset = m->embeds.size(1) - t;
      // The tail lies within the text positions (after the query tokens).
      const int64_t tail = in.logits_tail > 0 ? std::min(in.logits_tail, t) : t;
      o.logits_tail = tail;
      DecoderOutput out = model_->language_model->Forward(m->embeds, m->mask, nullptr, o);
      TokenForward f;
      f.logits = out.logits.to(torch::kFloat);
      f.representation = out.captured.narrow(1, offset, t).to(torch::kFloat);
      f.queries = m->queries;
      f.queries_present = torch::ones({f.queries.size(0), f.queries.size(1)},
                                      f.queries.options().dtype(torch::kBool));
      return f;
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("BLIP-2 forward: ", e.what_without_backtrace()));
    }
  }

  std::pair<int64_t, int64_t> VisualTokenShape() const override {
    const Blip2Config& c = model_->config();
    return {c.vision.NumPositions(), c.vision.hidden_size};
  }

  absl::StatusOr<torch::Tensor> EncodeImages(const MultimodalInputs& inputs) override {
    const Blip2VisionConfig& v = model_->config().vision;
    const torch::Tensor& px = inputs.pixel_values;
    if (!px.defined() || px.dim() != 4 || px.size(1) != v.num_channels ||
        px.size(2) != v.image_size || px.size(3) != v.image_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("pixel_values must be [B, ", v.num_channels, ", ", v.image_size, ", ",
                       v.image_size, "], got ", px.defined() ? c10::str(px.sizes()) : "none"));
    }
    try {
      torch::NoGradGuard no_grad;
      return model_->vision_model->forward(px.to(device_)).to(torch::kCPU, torch::kFloat);
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("BLIP-2 vision tower: ", e.what_without_backtrace()));
    }
  }

  absl::StatusOr<GreedyResult> GenerateFromTokens(const TokenInputs& in,
                                                  const GreedyOptions& options) override {
    absl::StatusOr<Merged> m = Merge(in);
    if (!m.ok()) return m.status();
    if (model_->is_encoder_decoder()) {
      try {
        return model_->GenerateFromEmbeds(m->embeds, m->mask, options);
      } catch (const c10::Error& e) {
        return absl::InternalError(absl::StrCat("BLIP-2 generate: ", e.what_without_backtrace()));
      }
    }
    return GreedyFromTokenEmbeds(*model_->language_model, m->embeds, m->mask, options,
                                 "BLIP-2 generate");
  }

 private:
  struct Merged {
    torch::Tensor embeds;   // [B, T' (= T, or Q + T without an image token id), H]
    torch::Tensor mask;     // [B, T'] int64
    torch::Tensor queries;  // [B, Q, H_qformer] fp32: the Q-Former's query outputs
  };

  // ForwardTokens with T5: each row's prompt (with the queries in place) is the encoder's input
  // and its answer the decoder's, teacher-forced from the start token, laid out in the row's
  // positions so the contract holds: logits[:, t] predicts input_ids[:, t + 1] over the answer
  // (the start token sits at the prompt's last position). Elsewhere the rows hold no prediction.
  absl::StatusOr<TokenForward> ForwardTokensT5(const TokenInputs& in) {
    const int64_t b = in.input_ids.defined() && in.input_ids.dim() == 2 ? in.input_ids.size(0) : 0;
    const int64_t t = b > 0 ? in.input_ids.size(1) : 0;
    if (!in.prompt_lengths.defined() || in.prompt_lengths.dim() != 1 ||
        in.prompt_lengths.size(0) != b) {
      return absl::InvalidArgumentError(
          absl::StrCat("a T5 language model needs TokenInputs::prompt_lengths [", b, "]"));
    }
    absl::StatusOr<Merged> m = Merge(in);
    if (!m.ok()) return m.status();
    try {
      T5ForConditionalGenerationImpl& lm = *model_->t5_language_model;
      const int64_t merged = m->embeds.size(1), offset = merged - t;
      torch::Tensor keep = m->mask.to(torch::kCPU, torch::kLong);
      torch::Tensor text_keep = keep.narrow(1, offset, t);
      torch::Tensor lengths = in.prompt_lengths.to(torch::kCPU, torch::kLong);
      torch::Tensor ids = in.input_ids.to(torch::kCPU, torch::kLong);
      torch::Tensor encoder_mask = keep.clone();
      torch::Tensor decoder_ids = torch::zeros({b, merged}, torch::kLong);
      torch::Tensor decoder_mask = torch::zeros({b, merged}, torch::kLong);
      for (int64_t r = 0; r < b; ++r) {
        // The row's tokens begin after its left padding.
        const int64_t start = t - text_keep[r].sum().item<int64_t>();
        const int64_t p = lengths[r].item<int64_t>();
        if (p < 1 || start + p > t) {
          return absl::InvalidArgumentError(absl::StrCat(
              "prompt_lengths[", r, "] = ", p, " does not fit the row's ", t - start, " tokens"));
        }
        const int64_t end = offset + start + p;  // the answer's first position (merged row)
        encoder_mask[r].narrow(0, end, merged - end).zero_();
        decoder_ids[r][end - 1] = lm.config().decoder_start_token_id;
        if (end < merged) {
          decoder_ids[r]
              .narrow(0, end, merged - end)
              .copy_(ids[r].narrow(0, end - offset, t - (end - offset)));
        }
        decoder_mask[r].narrow(0, end - 1, merged - end + 1).fill_(1);
      }
      const torch::Device device = m->embeds.device();
      encoder_mask = encoder_mask.to(device);
      torch::Tensor encoded = lm.Encode(m->embeds, encoder_mask);
      torch::Tensor captured;
      torch::Tensor logits =
          lm.DecodeLogits(decoder_ids.to(device), encoded, encoder_mask, nullptr,
                          decoder_mask.to(device), RepresentationLayer(), &captured);
      TokenForward f;
      const int64_t tail = in.logits_tail > 0 ? std::min(in.logits_tail, t) : t;
      f.logits = logits.narrow(1, offset + t - tail, tail);
      f.representation = captured.narrow(1, offset, t).to(torch::kFloat);
      f.queries = m->queries;
      f.queries_present = torch::ones({f.queries.size(0), f.queries.size(1)},
                                      f.queries.options().dtype(torch::kBool));
      return f;
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("BLIP-2 forward: ", e.what_without_backtrace()));
    }
  }

  // The Q-Former over the kept tokens (dropped ones masked out of its cross-attention keys),
  // projected into the LM input as InputsEmbeds places an image's queries.
  absl::StatusOr<Merged> Merge(const TokenInputs& in) {
    const Blip2Config& c = model_->config();
    torch::Tensor v = in.visual_tokens;
    if (in.pixel_values.defined()) {
      // The tower on the frames, differentiable in its trainable part (lora_vision).
      const torch::Tensor& px = in.pixel_values;
      if (px.dim() != 4 || px.size(1) != c.vision.num_channels ||
          px.size(2) != c.vision.image_size || px.size(3) != c.vision.image_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "pixel_values must be [B, ", c.vision.num_channels, ", ", c.vision.image_size, ", ",
            c.vision.image_size, "], got ", c10::str(px.sizes())));
      }
      try {
        v = model_->vision_model->forward(px.to(device_));
      } catch (const c10::Error& e) {
        return absl::InternalError(
            absl::StrCat("BLIP-2 vision tower: ", e.what_without_backtrace()));
      }
    }
    if (!v.defined() || v.dim() != 3 || v.size(2) != c.vision.hidden_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("visual_tokens must be [B, N, ", c.vision.hidden_size, "], got ",
                       v.defined() ? c10::str(v.sizes()) : std::string("none")));
    }
    const int64_t b = v.size(0), n = v.size(1);
    if (absl::Status s = CheckTokenInputs(in, b, n); !s.ok()) return s;
    if (c.instruct != in.qformer_input_ids.defined()) {
      return absl::InvalidArgumentError(c.instruct ? "InstructBLIP needs qformer_input_ids"
                                                   : "BLIP-2 takes no qformer_input_ids");
    }
    try {
      Merged m;
      torch::Tensor image = v.to(device_, torch::kFloat);
      torch::Tensor qids, qmask;
      if (in.qformer_input_ids.defined()) {
        qids = in.qformer_input_ids.to(device_, torch::kLong);
        qmask = in.qformer_attention_mask.defined()
                    ? in.qformer_attention_mask.to(device_, torch::kLong)
                    : torch::ones_like(qids);
      }
      torch::Tensor present;
      if (in.visual_present.defined()) present = in.visual_present.to(device_, torch::kBool);
      torch::Tensor queries = model_->query_tokens.expand({b, -1, -1});
      if (const RowSegments* segments = ActiveRowSegments(); segments != nullptr) {
        // Jobs trained together: each row's own query tokens.
        if (torch::Tensor rows = segments->Rows(model_->query_tokens); rows.defined()) {
          queries = rows.reshape({b, c.num_query_tokens, -1});
        }
      }
      torch::Tensor out =
          model_->qformer->ForwardMasked(queries, image, qids, qmask, present, nullptr);
      m.queries = out.slice(1, 0, c.num_query_tokens).to(torch::kFloat);
      torch::Tensor projected =
          model_->language_projection->forward(m.queries.to(model_->precision().dtype));
      torch::Tensor ids = in.input_ids.to(device_, torch::kLong);
      absl::StatusOr<torch::Tensor> merged =
          MergeBlip2Queries(model_->EmbedTokens(ids), ids, projected, c.image_token_id);
      if (!merged.ok()) return merged.status();
      m.embeds = *merged;
      m.mask = in.attention_mask.defined() ? in.attention_mask.to(device_, torch::kLong)
                                           : torch::ones_like(ids);
      if (!c.image_token_id.has_value()) {
        m.mask = torch::cat({torch::ones({b, c.num_query_tokens}, m.mask.options()), m.mask}, 1);
      }
      return m;
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("BLIP-2 inputs: ", e.what_without_backtrace()));
    }
  }

  std::shared_ptr<Blip2ForConditionalGenerationImpl> model_;
  std::vector<int64_t> eos_;
  torch::Device device_;
  Blip2Prefixes prefixes_;
  bool train_vision_ = false;  // AdapterOptions::lora_vision: the tower's norms are trainable
};

}  // namespace

absl::StatusOr<std::unique_ptr<MultimodalModel>> LoadBlip2Model(const ModelFolder& folder,
                                                                const WeightPrecision& precision,
                                                                torch::Device device) {
  absl::StatusOr<std::shared_ptr<Blip2ForConditionalGenerationImpl>> model =
      Blip2ForConditionalGenerationImpl::FromFolder(folder, precision, device);
  if (!model.ok()) return model.status();
  absl::StatusOr<Blip2Prefixes> prefixes = FindBlip2Prefixes(folder);
  if (!prefixes.ok()) return prefixes.status();
  std::vector<int64_t> eos = ReadEosTokenIds(folder.dir(), (*model)->ConfigEosTokenIds());
  return std::unique_ptr<MultimodalModel>(std::make_unique<Blip2MultimodalModel>(
      std::move(*model), std::move(eos), device, *std::move(prefixes)));
}

std::unique_ptr<MultimodalModel> WrapBlip2Model(
    std::shared_ptr<Blip2ForConditionalGenerationImpl> model, std::vector<int64_t> eos_token_ids,
    torch::Device device) {
  Blip2Prefixes saved;
  saved.vision = "vision_model.";
  saved.query_tokens = "query_tokens";
  saved.qformer = "qformer.";
  saved.projection = "language_projection.";
  saved.lm_body = "language_model.model.";
  saved.lm_head = "language_model.lm_head.";
  return std::make_unique<Blip2MultimodalModel>(std::move(model), std::move(eos_token_ids), device,
                                                std::move(saved));
}

}  // namespace cdcca::model
