#include "model/family/family_model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "model/arch/layers.h"
#include "model/arch/qformer.h"
#include "model/hub/safetensors.h"

namespace cdcca::model {
namespace {

using nlohmann::json;

constexpr int64_t kBos = 1, kEos = 2, kPad = 0;  // the scene vocabulary's specials

// [ones(B, L), valid] as the LM's 0/1 attention mask.
torch::Tensor PrefixedMask(const torch::Tensor& valid, int64_t l) {
  return torch::cat({torch::ones({valid.size(0), l}, valid.options()), valid}, 1).to(torch::kLong);
}

// The Hugging Face folder name of a model parameter: the decoder body lives under
// "language_model.model." there, its head under "language_model.lm_head.".
std::string CheckpointName(const std::string& name) {
  const std::string lm = "language_model.";
  if (absl::StartsWith(name, lm) && !absl::StartsWith(name, lm + "lm_head.")) {
    return lm + "model." + name.substr(lm.size());
  }
  return name;
}

bool IsLoraName(const std::string& name) {
  return absl::EndsWith(name, ".lora_a") || absl::EndsWith(name, ".lora_b");
}

absl::Status WriteJson(const std::string& path, const json& j) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

Blip2VisionConfig FamilyVitConfig(const VisionConfig& v) {
  Blip2VisionConfig c;
  c.hidden_size = v.d_vis;
  c.intermediate_size = v.mlp_hidden;
  c.num_hidden_layers = v.layers;
  c.num_attention_heads = v.heads;
  c.num_channels = 3;
  c.image_size = v.image_size;
  c.patch_size = v.patch_size;
  c.layer_norm_eps = 1e-6;
  c.hidden_act = "gelu";
  c.qkv_bias = false;
  return c;
}

FamilyTowerArchitecture FamilyTowerConfig(const VisionConfig& vision, const TowerConfig& t) {
  FamilyTowerArchitecture a;
  a.blip2.instruct = false;
  a.blip2.vision = FamilyVitConfig(vision);
  QFormerConfig& q = a.blip2.qformer;
  q.hidden_size = t.qa_dim;
  q.num_hidden_layers = t.qa_layers;
  q.num_attention_heads = t.qa_heads;
  q.intermediate_size = t.qa_mlp_hidden;
  q.hidden_act = "gelu";
  q.layer_norm_eps = 1e-12;
  q.cross_attention_frequency = 1;  // every layer reads the image, as the query adapter did
  q.encoder_hidden_size = vision.d_vis;
  q.use_qformer_text_input = false;
  a.blip2.num_query_tokens = t.num_queries;
  a.blip2.image_token_id = t.vocab_size - 1;
  DecoderConfig& d = a.text;
  d.model_type = "llama";
  d.vocab_size = t.vocab_size;
  d.hidden_size = t.d_model;
  d.intermediate_size = t.ffn_hidden;
  d.num_hidden_layers = t.lm_layers;
  d.num_attention_heads = t.lm_heads;
  d.num_key_value_heads = t.lm_heads;
  d.head_dim = t.d_model / t.lm_heads;
  d.rms_norm_eps = 1e-5;
  d.hidden_act = "silu";
  d.max_position_embeddings = t.max_positions;
  d.rope.theta = t.rope_theta;
  d.tie_word_embeddings = false;
  d.eos_token_ids = {kEos};
  d.bos_token_id = kBos;
  d.pad_token_id = kPad;
  return a;
}

json FamilyTextConfigJson(const DecoderConfig& d) {
  return json{{"model_type", "llama"},
              {"vocab_size", d.vocab_size},
              {"hidden_size", d.hidden_size},
              {"intermediate_size", d.intermediate_size},
              {"num_hidden_layers", d.num_hidden_layers},
              {"num_attention_heads", d.num_attention_heads},
              {"num_key_value_heads", d.num_key_value_heads},
              {"head_dim", d.head_dim},
              {"max_position_embeddings", d.max_position_embeddings},
              {"rms_norm_eps", d.rms_norm_eps},
              // transformers 5 spelling; 4.x reads the top-level rope_theta.
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", d.rope.theta}}},
              {"rope_theta", d.rope.theta},
              {"hidden_act", d.hidden_act},
              {"attention_bias", false},
              {"mlp_bias", false},
              {"tie_word_embeddings", false},
              {"bos_token_id", kBos},
              {"eos_token_id", kEos},
              {"pad_token_id", kPad}};
}

json FamilyHfConfigJson(const VisionConfig& vision, const TowerConfig& t) {
  const FamilyTowerArchitecture a = FamilyTowerConfig(vision, t);
  const Blip2VisionConfig& v = a.blip2.vision;
  const QFormerConfig& q = a.blip2.qformer;
  const DecoderConfig& d = a.text;
  json vision_config = {{"model_type", "blip_2_vision_model"},
                        {"hidden_size", v.hidden_size},
                        {"intermediate_size", v.intermediate_size},
                        {"num_hidden_layers", v.num_hidden_layers},
                        {"num_attention_heads", v.num_attention_heads},
                        {"num_channels", v.num_channels},
                        {"image_size", v.image_size},
                        {"patch_size", v.patch_size},
                        {"layer_norm_eps", v.layer_norm_eps},
                        {"hidden_act", v.hidden_act},
                        {"qkv_bias", v.qkv_bias},
                        {"attention_dropout", 0.0}};
  json qformer_config = {{"model_type", "blip_2_qformer"},
                         {"hidden_size", q.hidden_size},
                         {"num_hidden_layers", q.num_hidden_layers},
                         {"num_attention_heads", q.num_attention_heads},
                         {"intermediate_size", q.intermediate_size},
                         {"hidden_act", q.hidden_act},
                         {"hidden_dropout_prob", t.dropout},
                         {"attention_probs_dropout_prob", t.dropout},
                         {"layer_norm_eps", q.layer_norm_eps},
                         {"cross_attention_frequency", q.cross_attention_frequency},
                         {"encoder_hidden_size", q.encoder_hidden_size},
                         {"vocab_size", q.vocab_size},
                         {"max_position_embeddings", q.max_position_embeddings},
                         {"position_embedding_type", "absolute"},
                         {"use_qformer_text_input", false}};
  json text_config = FamilyTextConfigJson(d);
  return json{{"architectures", {"Blip2ForConditionalGeneration"}},
              {"model_type", "blip-2"},
              {"num_query_tokens", a.blip2.num_query_tokens},
              {"image_token_index", *a.blip2.image_token_id},
              {"use_decoder_only_language_model", true},
              {"tie_word_embeddings", false},
              {"initializer_range", 0.02},
              {"vision_config", vision_config},
              {"qformer_config", qformer_config},
              {"text_config", text_config},
              {"cdcca",
               {{"lora_rank", t.lora_rank},
                {"lora_alpha", t.lora_alpha},
                {"dropout", t.dropout},
                {"adapter_prompt_len", t.adapter_prompt_len},
                {"adapter_layers", t.adapter_layers},
                {"representation_layer", t.lm_layers / 2}}}};
}

torch::Tensor FamilyPixelValues(const torch::Tensor& images01) {
  return (images01.to(torch::kFloat) - 0.5) / 0.25;
}

// Per quarter of the channels sin/cos of the row and of the column at geometric frequencies.
torch::Tensor FamilyGridPositions(int64_t grid, int64_t dim) {
  const int64_t n = grid * grid;
  torch::Tensor idx = torch::arange(n, torch::kDouble);
  torch::Tensor row = (idx / grid).floor();
  torch::Tensor col = idx - row * grid;
  const int64_t quarter = std::max<int64_t>(1, dim / 4);
  torch::Tensor freq =
      torch::pow(grid * 2.0, -torch::arange(quarter, torch::kDouble) / quarter) * M_PI;
  torch::Tensor parts =
      torch::cat({torch::sin(torch::outer(row, freq)), torch::cos(torch::outer(row, freq)),
                  torch::sin(torch::outer(col, freq)), torch::cos(torch::outer(col, freq))},
                 1);
  torch::Tensor out = torch::zeros({1 + n, dim}, torch::kDouble);
  const int64_t used = std::min(dim, parts.size(1));
  out.narrow(0, 1, n).narrow(1, 0, used).copy_(parts.narrow(1, 0, used));
  return out.to(torch::kFloat);
}

Blip2VisionModel MakeFamilyVit(const VisionConfig& vision) {
  Blip2VisionModel vit(FamilyVitConfig(vision));
  InitializeHfParameters(*vit);
  // The position embedding starts as a grid sinusoid rather than transformers' small random
  // init: the Q-Former's cross-attention is blind to token order, so "where" questions need
  // each patch token to carry its position, and with a small random init they stayed at
  // chance (26 % DA on `small`).
  {
    torch::NoGradGuard no_grad;
    vit->named_parameters()["embeddings.position_embedding"].copy_(
        FamilyGridPositions(vision.GridSide(), vision.d_vis).unsqueeze(0));
  }
  for (auto& p : vit->parameters()) p.set_requires_grad(true);
  return vit;
}

absl::StatusOr<Blip2ForConditionalGeneration> NewFamilyModel(const VisionConfig& vision,
                                                             const TowerConfig& tower) {
  if (absl::Status valid = ValidateTower(tower); !valid.ok()) return valid;
  if (tower.d_vis != vision.d_vis) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tower's d_vis ", tower.d_vis, " is not the vision's ", vision.d_vis));
  }
  try {
    const FamilyTowerArchitecture arch = FamilyTowerConfig(vision, tower);
    Blip2ForConditionalGeneration model(arch.blip2, arch.text, WeightPrecision{});
    model->vision_model = model->replace_module("vision_model", MakeFamilyVit(vision));
    InitializeHfParameters(*model);
    for (auto& p : model->parameters()) p.set_requires_grad(true);
    return model;
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("building the family model: ", e.what_without_backtrace()));
  }
}

std::unique_ptr<MultimodalModel> FamilyMultimodalModel(Blip2ForConditionalGeneration model,
                                                       torch::Device device) {
  return WrapBlip2Model(model.ptr(), {kEos}, device);
}

std::vector<FamilyGroupOutput> ForwardQuestionGroups(Blip2ForConditionalGenerationImpl& model,
                                                     const torch::Tensor& visual_tokens,
                                                     const torch::Tensor& visual_mask,
                                                     const std::vector<FamilyQuestionGroup>& groups,
                                                     double dropout_p) {
  const int64_t b = visual_tokens.size(0);
  const int64_t l = model.config().num_query_tokens;
  std::vector<torch::Tensor> probs;
  torch::Tensor queries = model.qformer->ForwardQueries(
      model.query_tokens.expand({b, -1, -1}), visual_tokens, visual_mask, dropout_p, &probs);
  torch::Tensor prefix = model.language_projection->forward(queries);
  DecoderKvCache prefix_cache;
  DecoderForwardOptions prefix_options;
  prefix_options.last_logits_only = true;
  prefix_options.dropout_p = dropout_p;
  model.language_model->Forward(prefix, torch::Tensor(), &prefix_cache, prefix_options);
  std::vector<FamilyGroupOutput> outs;
  outs.reserve(groups.size());
  for (const FamilyQuestionGroup& g : groups) {
    const torch::Tensor& idx = g.scene_index;
    DecoderKvCache cache;
    for (size_t i = 0; i < prefix_cache.keys.size(); ++i) {
      cache.keys.push_back(prefix_cache.keys[i].index_select(0, idx));
      cache.values.push_back(prefix_cache.values[i].index_select(0, idx));
    }
    DecoderForwardOptions o;
    o.dropout_p = dropout_p;
    torch::Tensor valid = g.text_valid.defined()
                              ? g.text_valid.to(torch::kBool)
                              : torch::ones(g.text_ids.sizes(),
                                            torch::dtype(torch::kBool).device(g.text_ids.device()));
    DecoderOutput d = model.language_model->Forward(model.language_model->EmbedTokens(g.text_ids),
                                                    PrefixedMask(valid, l), &cache, o);
    FamilyGroupOutput out;
    out.logits = g.logit_count < 0 ? d.logits : d.logits.narrow(1, g.logit_first, g.logit_count);
    out.queries = queries.index_select(0, idx);
    outs.push_back(std::move(out));
  }
  return outs;
}

json WordLevelTokenizerJson(const std::vector<std::string>& vocabulary, int64_t vocab_size) {
  json vocab = json::object();
  json added = json::array();
  auto special = [&](int64_t id, const std::string& content) {
    added.push_back({{"id", id},
                     {"content", content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  };
  for (int64_t id = 0; id < vocab_size; ++id) {
    std::string word;
    if (id == vocab_size - 1) {
      word = "<image>";
    } else if (id < static_cast<int64_t>(vocabulary.size())) {
      word = vocabulary[id];
    } else {
      word = absl::StrCat("<unused_", id, ">");
    }
    vocab[word] = id;
    if (id < 4 || id == vocab_size - 1) special(id, word);
  }
  // Words: runs of letters, digits, '-', '\'', '<', '>', '_' (datasets::Tokenizer::Split);
  // any other non-space character is a word of its own; whitespace separates.
  const std::string word = "[\\p{L}\\p{N}'\\-<>_]+|[^\\s\\p{L}\\p{N}'\\-<>_]";
  return json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", added},
              {"normalizer", {{"type", "Lowercase"}}},
              {"pre_tokenizer",
               {{"type", "Split"},
                {"pattern", {{"Regex", word}}},
                {"behavior", "Removed"},
                {"invert", true}}},
              {"post_processor", nullptr},
              {"decoder", nullptr},
              {"model", {{"type", "WordLevel"}, {"vocab", vocab}, {"unk_token", "<unk>"}}}};
}

absl::Status WriteFamilyFolder(const std::string& dir, torch::nn::Module& model,
                               const std::function<std::string(const std::string&)>& folder_name,
                               const TowerConfig& tower, const std::vector<std::string>& vocabulary,
                               const json& config, const std::string& processor_file,
                               const json& processor) {
  if (static_cast<int64_t>(vocabulary.size()) > tower.vocab_size - 1 || vocabulary.size() < 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, ": the vocabulary has ", vocabulary.size(), " words; the model holds 4 to ",
        tower.vocab_size - 1, " (its last id is the image token)"));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  try {
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> merged;  // LoRA folded into the base weights
    for (const auto& m : model.named_modules()) {
      if (auto* linear = dynamic_cast<LinearImpl*>(m.value().get());
          linear != nullptr && linear->has_lora()) {
        merged[m.key() + ".weight"] = linear->MergedWeight();
      }
    }
    std::vector<std::pair<std::string, torch::Tensor>> tensors;
    for (const auto& p : model.named_parameters()) {
      if (IsLoraName(p.key())) continue;
      auto it = merged.find(p.key());
      const torch::Tensor value = it != merged.end() ? it->second : p.value();
      tensors.emplace_back(folder_name(p.key()),
                           value.detach().to(torch::kCPU, torch::kFloat).contiguous());
    }
    if (absl::Status s = WriteSafetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
        !s.ok()) {
      return s;
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(dir, ": saving the model: ", e.what_without_backtrace()));
  }
  const json specials = {{"bos_token", "<bos>"},
                         {"eos_token", "<eos>"},
                         {"unk_token", "<unk>"},
                         {"pad_token", "<pad>"}};
  json tokenizer_config = specials;
  tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast";
  tokenizer_config["model_max_length"] = tower.max_positions;
  tokenizer_config["extra_special_tokens"] = {{"image_token", "<image>"}};
  for (const auto& [name, j] : std::vector<std::pair<std::string, json>>{
           {"config.json", config},
           {"tokenizer.json", WordLevelTokenizerJson(vocabulary, tower.vocab_size)},
           {"tokenizer_config.json", tokenizer_config},
           {"special_tokens_map.json", specials},
           {processor_file, processor},
           {"generation_config.json",
            {{"bos_token_id", kBos}, {"eos_token_id", kEos}, {"pad_token_id", kPad}}}}) {
    if (absl::Status s = WriteJson(dir + "/" + name, j); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status SaveFamilyFolder(const std::string& dir, Blip2ForConditionalGenerationImpl& model,
                              const VisionConfig& vision, const TowerConfig& tower,
                              const std::vector<std::string>& vocabulary, const json& cdcca_extra) {
  if (model.precision().weights != Precision::kFp32 || model.precision().dtype != torch::kFloat) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": a family folder holds an fp32 model, not a quantized one"));
  }
  json config = FamilyHfConfigJson(vision, tower);
  for (const auto& [key, value] : cdcca_extra.items()) config["cdcca"][key] = value;
  const json preprocessor = {
      {"image_processor_type", "BlipImageProcessor"},
      {"do_convert_rgb", true},
      {"do_resize", true},
      {"size", {{"height", vision.image_size}, {"width", vision.image_size}}},
      {"resample", 3},
      {"do_rescale", true},
      {"rescale_factor", 1.0 / 255.0},
      {"do_normalize", true},
      {"image_mean", {0.5, 0.5, 0.5}},
      {"image_std", {0.25, 0.25, 0.25}}};
  return WriteFamilyFolder(dir, model, CheckpointName, tower, vocabulary, config,
                           "preprocessor_config.json", preprocessor);
}

absl::Status WriteFamilyParityCases(const std::string& dir, MultimodalModel& model,
                                    const torch::Tensor& pixel_values,
                                    const std::vector<std::vector<int64_t>>& prompts,
                                    const std::vector<std::string>& texts, int max_new_tokens) {
  if (pixel_values.dim() != 4 || pixel_values.size(0) != static_cast<int64_t>(prompts.size())) {
    return absl::InvalidArgumentError("WriteFamilyParityCases: one [3, S, S] image per prompt");
  }
  json cases = json::array();
  std::vector<std::pair<std::string, torch::Tensor>> pixels;
  GreedyOptions options;
  options.max_new_tokens = max_new_tokens;
  options.eos_token_ids = model.eos_token_ids();
  for (size_t i = 0; i < prompts.size(); ++i) {
    MultimodalInputs in;
    in.pixel_values = pixel_values.narrow(0, static_cast<int64_t>(i), 1).to(torch::kFloat);
    const std::vector<int64_t> input_ids = model.ExpandImageTokens(prompts[i]);
    in.input_ids = torch::tensor(input_ids, torch::kLong).unsqueeze(0);
    absl::StatusOr<GreedyResult> r = model.Generate(in, options);
    if (!r.ok()) return r.status();
    torch::Tensor first = r->first_logits[0].to(torch::kFloat).contiguous();
    json c = {{"input_ids", input_ids},
              {"prompt_ids", prompts[i]},
              {"greedy_tokens", r->tokens[0]},
              {"max_new_tokens", max_new_tokens},
              {"first_logits", std::vector<float>(first.data_ptr<float>(),
                                                  first.data_ptr<float>() + first.numel())}};
    if (i < texts.size()) c["prompt"] = texts[i];
    cases.push_back(c);
    pixels.emplace_back(absl::StrCat("case", i), in.pixel_values[0].contiguous());
  }
  if (absl::Status s =
          WriteSafetensors(dir + "/cdcca_pixels.safetensors", pixels, {{"format", "pt"}});
      !s.ok()) {
    return s;
  }
  return WriteJson(dir + "/cdcca_expected.json",
                   {{"note", "greedy answers of cdcca (fp32) on this folder"}, {"cases", cases}});
}

}  // namespace cdcca::model
