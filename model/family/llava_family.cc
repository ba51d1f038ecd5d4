#include "model/family/llava_family.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "model/arch/decoder_lm.h"
#include "model/arch/layers.h"
#include "model/hub/model_folder.h"
#include "model/hub/safetensors.h"

namespace cdcca::model {
namespace {

using nlohmann::json;

constexpr int64_t kEos = 2;  // the scene vocabulary's end of sequence

// The last layer's hidden states: the layer stage 1 trains the cell heads on.
constexpr int64_t kFeatureLayer = -1;

// The LM head sits in the decoder module (DecoderLm's "lm_head") but at the top level of a
// folder, as transformers names it.
constexpr char kModuleLmHead[] = "model.language_model.lm_head.";
constexpr char kFolderLmHead[] = "lm_head.";

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

const char kLlavaFamilyChatTemplate[] =
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image> {{ bos_token }} "
    "{% elif part['type'] == 'text' %}{{ part['text'].split('\\n')[0] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}";

ClipVisionConfig LlavaFamilyVitConfig(const VisionConfig& v) {
  ClipVisionConfig c;
  c.model_type = "clip_vision_model";
  c.hidden_size = v.d_vis;
  c.intermediate_size = v.mlp_hidden;
  c.num_hidden_layers = v.layers;
  c.num_attention_heads = v.heads;
  c.num_channels = 3;
  c.image_size = v.image_size;
  c.patch_size = v.patch_size;
  c.hidden_act = "gelu";
  c.layer_norm_eps = 1e-5;
  return c;
}

LlavaConfig LlavaFamilyConfig(const VisionConfig& vision, const TowerConfig& tower) {
  LlavaConfig c;
  c.vision = LlavaFamilyVitConfig(vision);
  c.text = FamilyTowerConfig(vision, tower).text;
  c.vision_feature_layers = {kFeatureLayer};
  c.vision_feature_select_strategy = "default";
  c.projector_hidden_act = "gelu";
  c.multimodal_projector_bias = true;
  c.image_token_id = tower.vocab_size - 1;
  return c;
}

json LlavaFamilyHfConfigJson(const VisionConfig& vision, const TowerConfig& t) {
  const LlavaConfig c = LlavaFamilyConfig(vision, t);
  const ClipVisionConfig& v = c.vision;
  const DecoderConfig& d = c.text;
  json vision_config = {{"model_type", v.model_type},
                        {"hidden_size", v.hidden_size},
                        {"intermediate_size", v.intermediate_size},
                        {"num_hidden_layers", v.num_hidden_layers},
                        {"num_attention_heads", v.num_attention_heads},
                        {"num_channels", v.num_channels},
                        {"image_size", v.image_size},
                        {"patch_size", v.patch_size},
                        {"hidden_act", v.hidden_act},
                        {"layer_norm_eps", v.layer_norm_eps},
                        {"attention_dropout", 0.0},
                        {"projection_dim", v.hidden_size}};
  json text_config = FamilyTextConfigJson(d);
  return json{{"architectures", {"LlavaForConditionalGeneration"}},
              {"model_type", "llava"},
              {"image_token_index", c.image_token_id},
              {"image_seq_length", c.NumImageTokens()},
              {"vision_feature_layer", kFeatureLayer},
              {"vision_feature_select_strategy", c.vision_feature_select_strategy},
              {"projector_hidden_act", c.projector_hidden_act},
              {"multimodal_projector_bias", c.multimodal_projector_bias},
              {"tie_word_embeddings", false},
              {"vision_config", vision_config},
              {"text_config", text_config},
              {"cdcca",
               {{"lora_rank", t.lora_rank},
                {"lora_alpha", t.lora_alpha},
                {"dropout", t.dropout},
                {"adapter_prompt_len", t.adapter_prompt_len},
                {"adapter_layers", t.adapter_layers},
                {"representation_layer", t.lm_layers / 2}}}};
}

ClipVisionTower MakeLlavaFamilyVit(const VisionConfig& vision) {
  ClipVisionTower vit(LlavaFamilyVitConfig(vision), WeightPrecision{});
  InitializeHfParameters(*vit);
  // The position embedding starts as the grid sinusoid, as a BLIP-2 family's does: the LM
  // numbers the image tokens, but a dropped token takes no position, so the "where"
  // questions of a teacher trained with dropped tokens need each token to carry its place.
  {
    torch::NoGradGuard no_grad;
    vit->named_parameters()["vision_model.embeddings.position_embedding.weight"].copy_(
        FamilyGridPositions(vision.GridSide(), vision.d_vis));
  }
  for (auto& p : vit->parameters()) p.set_requires_grad(true);
  return vit;
}

torch::Tensor LlavaFamilyVisualTokens(ClipVisionTowerImpl& vit, const VisionConfig& vision,
                                      const torch::Tensor& pixel_values) {
  LlavaConfig c;
  c.vision = LlavaFamilyVitConfig(vision);
  c.vision_feature_layers = {kFeatureLayer};
  c.vision_feature_select_strategy = "default";
  return SelectLlavaFeatures(vit, c, pixel_values);
}

absl::StatusOr<Llava> NewLlavaFamilyModel(const VisionConfig& vision, const TowerConfig& tower) {
  if (absl::Status valid = ValidateTower(tower); !valid.ok()) return valid;
  if (tower.d_vis != vision.d_vis) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tower's d_vis ", tower.d_vis, " is not the vision's ", vision.d_vis));
  }
  if (tower.max_positions <= vision.NumPatches()) {
    return absl::InvalidArgumentError(absl::StrCat("max_positions ", tower.max_positions,
                                                   " leaves no room for text after the ",
                                                   vision.NumPatches(), " image tokens"));
  }
  try {
    Llava model(LlavaFamilyConfig(vision, tower), WeightPrecision{});
    InitializeHfParameters(*model);
    for (auto& p : model->parameters()) p.set_requires_grad(true);
    return model;
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("building the llava family model: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<Llava> LoadLlavaFamilyModel(const std::string& dir, torch::Device device) {
  absl::StatusOr<ModelFolder> folder = ModelFolder::Open(dir);
  if (!folder.ok()) return folder.status();
  absl::StatusOr<LlavaConfig> config = ParseLlavaConfig(folder->config(), folder->config_path());
  if (!config.ok()) return config.status();
  try {
    Llava model(*config, WeightPrecision{});
    if (absl::Status s = model->Load(*folder, device); !s.ok()) return s;
    model->eval();
    return model;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(dir, ": loading: ", e.what_without_backtrace()));
  }
}

std::unique_ptr<MultimodalModel> LlavaFamilyMultimodalModel(Llava model, torch::Device device) {
  return WrapLlavaModel(model.ptr(), "<image>", {kEos}, device);
}

std::vector<FamilyGroupOutput> ForwardQuestionGroups(LlavaImpl& model,
                                                     const torch::Tensor& visual_tokens,
                                                     const torch::Tensor& visual_mask,
                                                     const std::vector<FamilyQuestionGroup>& groups,
                                                     double dropout_p) {
  const int64_t s = visual_tokens.size(0), n = visual_tokens.size(1);
  torch::Tensor prefix = model.Project(visual_tokens);  // [S, N, d_model]
  const torch::Tensor prefix_mask =
      visual_mask.defined()
          ? visual_mask.to(torch::kLong)
          : torch::ones({s, n}, torch::dtype(torch::kLong).device(visual_tokens.device()));
  DecoderKvCache prefix_cache;
  DecoderForwardOptions prefix_options;
  prefix_options.last_logits_only = true;
  prefix_options.dropout_p = dropout_p;
  DecoderLmImpl& lm = model.language_model();
  lm.Forward(prefix, prefix_mask, &prefix_cache, prefix_options);
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
                              ? g.text_valid.to(torch::kLong)
                              : torch::ones(g.text_ids.sizes(),
                                            torch::dtype(torch::kLong).device(g.text_ids.device()));
    torch::Tensor mask = torch::cat({prefix_mask.index_select(0, idx), valid}, 1);
    DecoderOutput d = lm.Forward(lm.EmbedTokens(g.text_ids), mask, &cache, o);
    FamilyGroupOutput out;
    out.logits = g.logit_count < 0 ? d.logits : d.logits.narrow(1, g.logit_first, g.logit_count);
    out.queries = prefix.index_select(0, idx);
    outs.push_back(std::move(out));
  }
  return outs;
}

absl::Status SaveLlavaFamilyFolder(const std::string& dir, LlavaImpl& model,
                                   const VisionConfig& vision, const TowerConfig& tower,
                                   const std::vector<std::string>& vocabulary,
                                   const json& cdcca_extra) {
  if (model.language_model().precision().weights != Precision::kFp32 ||
      model.language_model().precision().dtype != torch::kFloat) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": a family folder holds an fp32 model, not a quantized one"));
  }
  json config = LlavaFamilyHfConfigJson(vision, tower);
  for (const auto& [key, value] : cdcca_extra.items()) config["cdcca"][key] = value;
  // LlavaProcessor with a CLIPImageProcessor whose resize and crop keep a family-sized image
  // as it is and whose rescale and normalisation are FamilyPixelValues'.
  const json processor = {
      {"processor_class", "LlavaProcessor"},
      {"image_token", "<image>"},
      {"num_additional_image_tokens", 1},
      {"patch_size", vision.patch_size},
      {"vision_feature_select_strategy", "default"},
      {"image_processor",
       {{"image_processor_type", "CLIPImageProcessor"},
        {"do_convert_rgb", true},
        {"do_resize", true},
        {"size", {{"shortest_edge", vision.image_size}}},
        {"resample", 3},
        {"do_center_crop", true},
        {"crop_size", {{"height", vision.image_size}, {"width", vision.image_size}}},
        {"do_rescale", true},
        {"rescale_factor", 1.0 / 255.0},
        {"do_normalize", true},
        {"image_mean", {0.5, 0.5, 0.5}},
        {"image_std", {0.25, 0.25, 0.25}}}}};
  // The LM head is the decoder module's but sits at the top level of a folder.
  auto folder_name = [](const std::string& name) {
    return absl::StartsWith(name, kModuleLmHead)
               ? kFolderLmHead + name.substr(sizeof(kModuleLmHead) - 1)
               : name;
  };
  if (absl::Status s = WriteFamilyFolder(dir, model, folder_name, tower, vocabulary, config,
                                         "processor_config.json", processor);
      !s.ok()) {
    return s;
  }
  return WriteText(dir + "/chat_template.jinja", std::string(kLlavaFamilyChatTemplate) + "\n");
}

}  // namespace cdcca::model
