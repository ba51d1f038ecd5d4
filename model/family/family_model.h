// The project's model families as configurations of the one BLIP-2 implementation
// (model/arch/blip2.h): a family's teacher and student are each a
// Blip2ForConditionalGeneration (ViT, Q-Former over learned query tokens, language
// projection, Llama decoder) sized by the family config (config.h), sharing one ViT. The
// student halves the Q-Former depth, as the paper's does. Pretraining (pretrain.h) trains
// these models and writes them as Hugging Face folders; everything after it reads the folders
// through LoadModel, as it reads a downloaded checkpoint.
//
// Parameter names are transformers' (Blip2ForConditionalGeneration): "vision_model.*",
// "query_tokens", "qformer.*", "language_projection.*", and the decoder under
// "language_model.*" (a folder stores its body under "language_model.model." and its head
// under "language_model.lm_head.").
//
// Thread-safety: as torch modules; concurrent const use under NoGradGuard is fine.
#ifndef CDCCA_MODEL_FAMILY_FAMILY_MODEL_H_
#define CDCCA_MODEL_FAMILY_FAMILY_MODEL_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/arch/blip2.h"
#include "model/arch/blip2_vision.h"
#include "model/arch/decoder_lm.h"
#include "model/arch/multimodal_model.h"
#include "model/family/config.h"
#include "model/hub/blip2_config.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

// The ViT of a family as VisionConfig sizes it (image_size, patch_size, d_vis, layers, heads,
// mlp_hidden), gelu, eps 1e-6, no qkv bias.
Blip2VisionConfig FamilyVitConfig(const VisionConfig& vision);

// A tower's architecture: Blip2Config (the ViT, a Q-Former with cross-attention in every
// layer, num_query_tokens = num_queries, image token id = vocab_size - 1) and the Llama
// decoder (d_model, lm_layers, lm_heads, ffn_hidden, max_positions, rope_theta; bos 1, eos 2,
// pad 0 as the scene vocabulary has them).
struct FamilyTowerArchitecture {
  Blip2Config blip2;
  DecoderConfig text;
};
FamilyTowerArchitecture FamilyTowerConfig(const VisionConfig& vision, const TowerConfig& tower);

// config.json of a family model as transformers writes Blip2Config (model_type "blip-2",
// text_config llama), plus a "cdcca" object with the tower's adaptation settings.
nlohmann::json FamilyHfConfigJson(const VisionConfig& vision, const TowerConfig& tower);

// Pixel values the ViT takes for images in [0, 1]: (x - 0.5) / 0.25 per channel, what
// preprocessor_config.json (rescale 1/255, mean 0.5, std 0.25) makes of 8-bit pixels.
torch::Tensor FamilyPixelValues(const torch::Tensor& images01);

// A 2-D sinusoid over a grid x grid patch grid, unit amplitude, [1 + grid^2, dim]: the class
// token's row zero, then the patches in row-major order. What a family ViT's position
// embedding starts as (MakeFamilyVit, MakeLlavaFamilyVit).
torch::Tensor FamilyGridPositions(int64_t grid, int64_t dim);

// A freshly initialised family ViT (seed torch first; transformers' init, but the position
// embedding starts as a 2-D sinusoid over the patch grid), every parameter trainable. Its
// output (last hidden state, [B, 1 + grid^2, d_vis]) is the model's visual tokens.
Blip2VisionModel MakeFamilyVit(const VisionConfig& vision);

// A freshly initialised fp32 BLIP-2 of the tower's sizes (seed torch first; transformers'
// init, the ViT as MakeFamilyVit), every parameter trainable. InvalidArgument for a tower
// ValidateTower rejects or whose d_vis is not the vision's.
absl::StatusOr<Blip2ForConditionalGeneration> NewFamilyModel(const VisionConfig& vision,
                                                             const TowerConfig& tower);

// `model` behind the interface every program uses (multimodal_model.h), sharing its weights: what
// LoadModel would give for the folder SaveFamilyFolder writes of it, without the round trip.
std::unique_ptr<MultimodalModel> FamilyMultimodalModel(Blip2ForConditionalGeneration model,
                                                       torch::Device device);

// Questions about a batch of scenes that share the scenes' query prefix (pretraining's
// teacher-forced step): text_ids [Q, T] (prompt left-padded, then the answer), text_valid
// [Q, T] bool, scene_index [Q] int64 (which scene each row is about); logits are kept for
// columns [logit_first, logit_first + logit_count) (all when logit_count < 0).
struct FamilyQuestionGroup {
  torch::Tensor text_ids, text_valid, scene_index;
  int64_t logit_first = 0;
  int64_t logit_count = -1;
};
struct FamilyGroupOutput {
  torch::Tensor logits;   // [Q, kept columns, V]: logits[:, t] predicts text_ids[:, t + 1]
  torch::Tensor queries;  // [Q, L, H_qformer]: the Q-Former's query outputs of each row's scene
};

// The teacher-forced forward of pretraining: the Q-Former and the LM over each scene's query
// prefix run once (visual_tokens [S, N, D], visual_mask [S, N] bool or undefined = all
// present), then every group's rows continue from their scene's cached prefix. The model's
// dropout (Q-Former and LM) runs at dropout_p. The LM sees [L projected queries][prompt,
// left-padded][answer] with padding taking no position, as transformers numbers a left-padded
// row: what the folder computes for the same ids in LoadModel's layout.
std::vector<FamilyGroupOutput> ForwardQuestionGroups(Blip2ForConditionalGenerationImpl& model,
                                                     const torch::Tensor& visual_tokens,
                                                     const torch::Tensor& visual_mask,
                                                     const std::vector<FamilyQuestionGroup>& groups,
                                                     double dropout_p);

// tokenizer.json (Hugging Face tokenizers) of a word vocabulary: WordLevel with "<unk>",
// lower-casing, words of letters, digits, '-', '\'' and other characters one each; the
// words' ids are their positions in `vocabulary`, padded with "<unused_N>" up to vocab_size
// - 1 and "<image>" at vocab_size - 1.
nlohmann::json WordLevelTokenizerJson(const std::vector<std::string>& vocabulary,
                                      int64_t vocab_size);

// text_config of a family's Llama decoder as transformers writes LlamaConfig (both the
// transformers 5 "rope_parameters" and the 4.x top-level "rope_theta"; bos 1, eos 2, pad 0).
nlohmann::json FamilyTextConfigJson(const DecoderConfig& text);

// What every family folder holds besides its architecture's config and processor: the weights
// of `model` (LoRA folded in; each parameter stored under folder_name(module name)),
// config.json (`config`), tokenizer.json (the word vocabulary), tokenizer_config.json,
// special_tokens_map.json, generation_config.json, and `processor_file` holding `processor`.
// InvalidArgument for a vocabulary outside 4 to tower.vocab_size - 1 words; file errors as
// Internal. For SaveFamilyFolder and its LLaVA counterpart.
absl::Status WriteFamilyFolder(const std::string& dir, torch::nn::Module& model,
                               const std::function<std::string(const std::string&)>& folder_name,
                               const TowerConfig& tower, const std::vector<std::string>& vocabulary,
                               const nlohmann::json& config, const std::string& processor_file,
                               const nlohmann::json& processor);

// Writes `model` (fp32) as a Hugging Face model folder that transformers'
// Blip2ForConditionalGeneration loads: config.json (FamilyHfConfigJson with `cdcca_extra`'s
// members added to its "cdcca" object), model.safetensors (LoRA, if any, folded in),
// tokenizer.json (the word vocabulary), tokenizer_config.json, special_tokens_map.json,
// preprocessor_config.json, generation_config.json. `vocabulary` lists the words by id (4 to
// vocab_size - 1 of them). InvalidArgument for a vocabulary that does not fit,
// FailedPrecondition for a quantized model; file errors as Internal.
absl::Status SaveFamilyFolder(const std::string& dir, Blip2ForConditionalGenerationImpl& model,
                              const VisionConfig& vision, const TowerConfig& tower,
                              const std::vector<std::string>& vocabulary,
                              const nlohmann::json& cdcca_extra = nlohmann::json::object());

// Records in `dir` (a folder SaveFamilyFolder wrote) what `model` answers, for
// `python3 scripts/hf_fixtures.py --check_family DIR` to compare with transformers:
// cdcca_expected.json holds per case the LM input ids (the image tokens, then the prompt),
// the prompt's text (when `texts` has one), the greedy tokens (through EOS) and the first
// step's full-vocabulary logits; cdcca_pixels.safetensors the pixel values ("case<i>",
// [3, S, S]). pixel_values [K, 3, S, S], one prompt per row.
absl::Status WriteFamilyParityCases(const std::string& dir, MultimodalModel& model,
                                    const torch::Tensor& pixel_values,
                                    const std::vector<std::vector<int64_t>>& prompts,
                                    const std::vector<std::string>& texts, int max_new_tokens);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_FAMILY_MODEL_H_
