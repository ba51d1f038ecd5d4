// The project's LLaVA-style families (FamilyConfig::architecture "llava"): teacher and student
// are each a LlavaForConditionalGeneration (model/arch/llava.h) sized by the family config, a
// CLIP ViT shared by both (the family's VisionConfig), a two-layer MLP projector (linear_1,
// gelu, linear_2, d_vis -> d_model -> d_model) and a Llama decoder of the tower's LM sizes
// (the decoder of family_model.h's FamilyTowerConfig). The image enters as the ViT's patch
// tokens: the last layer's hidden states without the class token (vision_feature_layer -1,
// strategy "default"), one LM position per patch. Pretraining (pretrain.h) trains these
// models as it trains the BLIP-2 families and writes them as Hugging Face folders.
//
// Token layout (pretraining, the folder's chat template, and every program through it): the
// image tokens, then <bos> and the question, then the answer: "<image> <bos> QUESTION". The
// shared per-scene prefix is the image, as the query tokens are in a BLIP-2 family.
//
// Parameter names are transformers' (model.vision_tower.vision_model.*,
// model.multi_modal_projector.*, model.language_model.*), so a folder is the module's
// named_parameters(), but for the LM head: the module keeps it in its decoder
// (model.language_model.lm_head.*), a folder at the top level (lm_head.*).
//
// Thread-safety: as torch modules; concurrent const use under NoGradGuard is fine.
#ifndef CDCCA_MODEL_FAMILY_LLAVA_FAMILY_H_
#define CDCCA_MODEL_FAMILY_LLAVA_FAMILY_H_

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/arch/clip_vision.h"
#include "model/arch/llava.h"
#include "model/arch/multimodal_model.h"
#include "model/family/config.h"
#include "model/family/family_model.h"
#include "model/hub/folder_config.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

// The family's chat template (chat_template.jinja): "<image> <bos> " and the first line of the
// user's text. Only the first line: `cdcca answer` appends LLaVA-1.5's answer-format
// instruction on a second line, and a word-level family was trained on the question alone.
extern const char kLlavaFamilyChatTemplate[];

// The family's ViT as a CLIP vision config (VisionConfig's sizes; gelu, eps 1e-5).
ClipVisionConfig LlavaFamilyVitConfig(const VisionConfig& vision);

// A tower's LlavaConfig: LlavaFamilyVitConfig, feature layer -1, strategy "default", a gelu
// projector with biases, FamilyTowerConfig's Llama decoder, image token id vocab_size - 1.
LlavaConfig LlavaFamilyConfig(const VisionConfig& vision, const TowerConfig& tower);

// config.json as transformers writes LlavaConfig (model_type "llava", vision_config
// clip_vision_model, text_config llama), plus a "cdcca" object with the tower's adaptation
// settings.
nlohmann::json LlavaFamilyHfConfigJson(const VisionConfig& vision, const TowerConfig& tower);

// A freshly initialised family ViT (seed torch first; transformers' init), every parameter
// trainable. Its parameters are named as under a tower's "model.vision_tower.".
ClipVisionTower MakeLlavaFamilyVit(const VisionConfig& vision);

// What a tower reads of `vit`'s image (pixel_values from FamilyPixelValues): the patch tokens
// [B, grid^2, d_vis] in row-major grid order. Gradients flow.
torch::Tensor LlavaFamilyVisualTokens(ClipVisionTowerImpl& vit, const VisionConfig& vision,
                                      const torch::Tensor& pixel_values);

// A freshly initialised fp32 LLaVA of the tower's sizes (seed torch first; transformers'
// init), every parameter trainable. InvalidArgument for a tower ValidateTower rejects, whose
// d_vis is not the vision's, or whose max_positions do not exceed the image tokens.
absl::StatusOr<Llava> NewLlavaFamilyModel(const VisionConfig& vision, const TowerConfig& tower);

// The model a folder SaveLlavaFamilyFolder wrote holds, fp32 on `device`, as a module to train
// further or save again (LoadModel gives the same weights behind MultimodalModel). Errors
// as ModelFolder's and ParseLlavaConfig's.
absl::StatusOr<Llava> LoadLlavaFamilyModel(const std::string& dir, torch::Device device);

// `model` behind the interface every program uses (multimodal_model.h), sharing its weights: what
// LoadModel gives for the folder SaveLlavaFamilyFolder writes of it.
std::unique_ptr<MultimodalModel> LlavaFamilyMultimodalModel(Llava model, torch::Device device);

// The teacher-forced forward of pretraining (family_model.h's FamilyQuestionGroup and
// FamilyGroupOutput): each scene's projected image tokens (visual_tokens [S, N, d_vis] as
// LlavaFamilyVisualTokens gives them; visual_mask [S, N] bool, false = dropped, or undefined =
// all present) run through the LM once, then every group's rows ([<bos> question, left-padded]
// [answer]) continue from their scene's cached prefix. A dropped image token is out of the
// attention and takes no position, as MultimodalModel::ForwardTokens has it for
// visual_present. FamilyGroupOutput::queries holds each row's projected image tokens
// [Q, N, d_model]. The LM's dropout runs at dropout_p.
std::vector<FamilyGroupOutput> ForwardQuestionGroups(LlavaImpl& model,
                                                     const torch::Tensor& visual_tokens,
                                                     const torch::Tensor& visual_mask,
                                                     const std::vector<FamilyQuestionGroup>& groups,
                                                     double dropout_p);

// Writes `model` (fp32) as a Hugging Face folder that transformers'
// LlavaForConditionalGeneration and LlavaProcessor load: config.json (LlavaFamilyHfConfigJson
// with `cdcca_extra`'s members added to its "cdcca" object), model.safetensors (LoRA, if any,
// folded in), tokenizer.json (the word vocabulary, family_model.h's WordLevelTokenizerJson),
// tokenizer_config.json, special_tokens_map.json, processor_config.json (LlavaProcessor with a
// CLIPImageProcessor: rescale 1/255, mean 0.5, std 0.25, as FamilyPixelValues),
// chat_template.jinja (kLlavaFamilyChatTemplate), generation_config.json. Errors as
// SaveFamilyFolder's.
absl::Status SaveLlavaFamilyFolder(const std::string& dir, LlavaImpl& model,
                                   const VisionConfig& vision, const TowerConfig& tower,
                                   const std::vector<std::string>& vocabulary,
                                   const nlohmann::json& cdcca_extra = nlohmann::json::object());

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_LLAVA_FAMILY_H_
