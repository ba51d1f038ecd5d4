// The project's model families as configurations of the Hugging Face BLIP-2 architecture
// (issue 19, "One model path"): the shared frozen vision encoder is a BLIP-2 ViT
// (blip2_vision.h), and each tower (teacher, student) is BLIP-2's upper half, a Q-Former
// over learned query tokens (qformer.h), the language projection and a Llama decoder
// (decoder_lm.h). The student halves the Q-Former depth, as the paper's does.
//
// A tower keeps the interface of the family's towers (mllm_io.h): queries Q = the Q-Former's
// query outputs (before the projection), representation R = the LM hidden state after
// lm_layers / 2 layers at the text positions, attention mass = the cross-attention weight
// each visual token receives, averaged over layers, heads and queries. The visual tokens are
// the ViT's last hidden state (patch tokens after the class token).
//
// Parameter names are transformers' (Blip2ForConditionalGeneration) without the ViT:
// "query_tokens", "qformer.*", "language_projection.*", "language_model.*" (the decoder body
// and "language_model.lm_head.*"; a Hugging Face folder stores the body under
// "language_model.model."). LoRA ("lora_a", "lora_b") sits on the q and v projections of
// the LM's attention and of every Q-Former attention, and the gated adapter prompts
// ("adapter_prompt", "adapter_gate", LLaMA-Adapter) in the top adapter_layers LM layers;
// neither is part of the architecture: SaveBlip2FamilyFolder folds LoRA into the weights
// and requires the adapter gates to be zero (pretraining must leave them untouched).
//
// Precision: the frozen linear weights (LM, projection, Q-Former) are stored as
// TowerConfig::precision says (int8 per output channel, int4 in groups of int4_group,
// quantized from the floats); everything computes in fp32 and the trainable set stays fp32.
//
// Sequence layout seen by the LM: [L projected queries][prompt, left-padded][answer]. Padding
// takes no position (positions count real tokens, as transformers' generate numbers a
// left-padded batch), so a row computes what transformers computes on its unpadded ids.
//
// Thread-safety: as torch modules; concurrent const use under NoGradGuard is fine.
#ifndef CDCCA_MODEL_FAMILY_BLIP2_TOWER_H_
#define CDCCA_MODEL_FAMILY_BLIP2_TOWER_H_

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/arch/blip2_vision.h"
#include "model/arch/decoder_lm.h"
#include "model/arch/hf_linear.h"
#include "model/arch/qformer.h"
#include "model/family/config.h"
#include "model/family/mllm_io.h"
#include "model/hub/blip2_config.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

// The ViT of a family as VisionConfig sizes it (image_size, patch_size, d_vis, layers, heads,
// mlp_hidden), gelu, eps 1e-6, no qkv bias (a trainable fused bias would not be
// transformers' q_bias / v_bias split).
Blip2VisionConfig FamilyVitConfig(const VisionConfig& vision);

// A tower's architecture: Blip2Config (ViT, Q-Former with cross-attention in every layer,
// num_query_tokens = num_queries, image token id = vocab_size - 1) and the Llama decoder
// (d_model, lm_layers, lm_heads, ffn_hidden, max_positions, rope_theta; bos 1, eos 2, pad 0
// as the scene vocabulary has them).
struct FamilyTowerArchitecture {
  Blip2Config blip2;
  DecoderConfig text;
};
FamilyTowerArchitecture FamilyTowerConfig(const VisionConfig& vision, const TowerConfig& tower);

// config.json of a family tower as transformers writes Blip2Config (model_type "blip-2",
// text_config llama), plus a "cdcca" object with the tower's adaptation settings.
nlohmann::json FamilyHfConfigJson(const VisionConfig& vision, const TowerConfig& tower);

// Pixel values the ViT takes for images in [0, 1]: (x - 0.5) / 0.25 per channel, what
// preprocessor_config.json (rescale 1/255, mean 0.5, std 0.25) makes of 8-bit pixels.
torch::Tensor FamilyPixelValues(const torch::Tensor& images01);

// The shared vision encoder, freshly initialised (seed torch first; transformers' init, but
// the position embedding starts as a 2-D sinusoid over the patch grid). eval() it once frozen.
// Its output (last hidden state, [B, 1 + grid^2, d_vis]) is a tower's visual tokens.
Blip2VisionModel MakeFamilyVit(const VisionConfig& vision);

class Blip2TowerImpl : public torch::nn::Module {
 public:
  // A freshly initialised tower (transformers' init; seed torch first), with LoRA when
  // tower.lora_rank > 0 and adapter prompts when tower.adapter_prompt_len > 0, its frozen
  // linear weights stored at tower.precision. Every parameter but a quantized weight's
  // placeholder requires grad (pretraining trains the whole tower). Throws c10::Error on a
  // config ValidateTower rejects or a d_vis other than the vision's.
  Blip2TowerImpl(const VisionConfig& vision, const TowerConfig& tower);
  // The same with tower.vision (as ParseFamilyConfig fills it).
  explicit Blip2TowerImpl(const TowerConfig& tower) : Blip2TowerImpl(tower.vision, tower) {}

  // Teacher-forced pass. Dropout (config.dropout) is active only in train() mode.
  MllmOutput Forward(const MllmInput& input);

  // As MllmImpl::ForwardGroups: the Q-Former and the LM over each scene's prefix run once.
  std::vector<MllmOutput> ForwardGroups(const torch::Tensor& visual_tokens,
                                        const torch::Tensor& visual_mask,
                                        const std::vector<QuestionGroup>& groups);

  // Greedy decoding with a KV cache (no grad, no dropout): tokens after a row's EOS are
  // eos_id; stops when every row is done or after max_new_tokens.
  GenerateResult Generate(const torch::Tensor& visual_tokens, const torch::Tensor& visual_mask,
                          const torch::Tensor& prompt_ids, const torch::Tensor& prompt_valid,
                          int max_new_tokens, int64_t eos_id);

  // M passes of the Q-Former as one batch (inputs repeated M times along the batch), each
  // with element-wise dropout at dropout_p on the visual tokens and the Q-Former's own dropout
  // at the same rate: UTS stage 2. Population variances over the passes (attention mass,
  // queries, and VIS: each token's contribution to the cross-attention output, see
  // StochasticStats::token_variance); dropout_p == 0 gives exactly zero. Draws from
  // LibTorch's default generator.
  StochasticStats StochasticPasses(const torch::Tensor& visual_tokens,
                                   const torch::Tensor& visual_mask, int passes, double dropout_p);
  // Only the attention half of StochasticPasses (queries stay undefined).
  StochasticStats StochasticAttention(const torch::Tensor& visual_tokens,
                                      const torch::Tensor& visual_mask, int passes,
                                      double dropout_p);

  const TowerConfig& config() const { return config_; }
  const VisionConfig& vision() const { return vision_; }
  const FamilyTowerArchitecture& architecture() const { return arch_; }
  int representation_layer() const { return config_.lm_layers / 2; }

  torch::Tensor query_tokens;  // [1, L, qa_dim]
  QFormerModel qformer{nullptr};
  HfLinear language_projection{nullptr};
  DecoderLm language_model{nullptr};

 private:
  struct QueryPass {
    torch::Tensor queries;         // [B, L, qa_dim]
    torch::Tensor prefix;          // [B, L, d_model]
    torch::Tensor attention_mass;  // [B, N]
  };
  // contributions (if non-null) receives, per cross-attending layer, each visual token's
  // contribution to the cross-attention output [B, N, qa_dim].
  QueryPass Queries(const torch::Tensor& visual_tokens, const torch::Tensor& visual_mask,
                    double dropout_p, std::vector<torch::Tensor>* contributions = nullptr);
  double TrainDropout() const { return is_training() ? config_.dropout : 0.0; }

  VisionConfig vision_;
  TowerConfig config_;
  FamilyTowerArchitecture arch_;
};
TORCH_MODULE(Blip2Tower);

// Mean over generated tokens of the entropy (nats) of each step's softmax, counting tokens
// up to and including EOS (lengths + 1, capped at n). [B] float.
torch::Tensor MeanTokenEntropy(const GenerateResult& result);

// A copy of `tower` whose frozen linear weights are stored at `precision` (the effective
// weights quantized, or dequantized for fp32); every other tensor (LoRA, adapter prompts,
// norms, biases, embeddings, query tokens) is copied unchanged, and so is the train/eval
// mode. Converting an int8/int4 tower to fp32 gives a cloud mirror that computes with the
// device's weights. Thread-compatible; no grad.
Blip2Tower ConvertTowerPrecision(Blip2TowerImpl& tower, Precision precision);

// Bytes held by the tower's frozen linear weights as stored (quantized values + scales, or
// floats): what the precision saves.
int64_t TowerLinearWeightBytes(Blip2TowerImpl& tower);

// Writes a family tower as a Hugging Face model folder that transformers'
// Blip2ForConditionalGeneration loads: config.json, model.safetensors (the ViT under
// vision_model., the tower under transformers' names, LoRA folded in), tokenizer.json (the
// word vocabulary as a WordLevel model; "<image>" at the image token id),
// tokenizer_config.json, special_tokens_map.json, preprocessor_config.json,
// generation_config.json. `vocabulary` lists the words by id (at most vocab_size - 1 of
// them; the rest of the embedding rows get "<unused_N>" names). fp32 towers only.
absl::Status SaveBlip2FamilyFolder(const std::string& dir, Blip2VisionModelImpl& vit,
                                   Blip2TowerImpl& tower, const VisionConfig& vision,
                                   const std::vector<std::string>& vocabulary);

// Records in `dir` (a folder SaveBlip2FamilyFolder wrote) what the tower answers, for
// `python3 scripts/hf_fixtures.py --check_family DIR` to compare with transformers:
// cdcca_expected.json holds per case the LM input ids transformers takes (num_queries image
// tokens, then the prompt), the prompt's text (when `texts` has one), the greedy tokens
// (through EOS) and the first step's full-vocabulary logits; cdcca_pixels.safetensors the
// pixel values ("case<i>", [3, S, S]). pixel_values [K, 3, S, S], one prompt per row.
absl::Status WriteFamilyParityCases(const std::string& dir, Blip2VisionModelImpl& vit,
                                    Blip2TowerImpl& tower, const torch::Tensor& pixel_values,
                                    const std::vector<std::vector<int64_t>>& prompts,
                                    const std::vector<std::string>& texts, int max_new_tokens);

// A tower and its ViT from such a folder, with the adaptation settings and precision of
// `tower` (LoRA and adapter prompts start fresh). Errors name the folder's file and the
// tensor or field.
struct LoadedFamilyTower {
  Blip2VisionModel vit{nullptr};
  Blip2Tower tower{nullptr};
};
absl::StatusOr<LoadedFamilyTower> LoadBlip2FamilyFolder(const std::string& dir,
                                                        const VisionConfig& vision,
                                                        const TowerConfig& tower);

// tokenizer.json (Hugging Face tokenizers) of a word vocabulary: WordLevel with "<unk>",
// lower-casing, words of letters, digits, '-', '\'' and other characters one each; the
// words' ids are their positions in `vocabulary`, padded with "<unused_N>" up to vocab_size
// - 1 and "<image>" at vocab_size - 1.
nlohmann::json WordLevelTokenizerJson(const std::vector<std::string>& vocabulary,
                                      int64_t vocab_size);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_BLIP2_TOWER_H_
