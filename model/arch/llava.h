// LLaVA (transformers' LlavaForConditionalGeneration): a CLIP or SigLIP tower, the hidden
// state at `vision_feature_layer` (a list of layers is concatenated), `default` strategy
// dropping the class token or `full` keeping all, a 2-layer projector (linear_1, act,
// linear_2), and a Llama-family decoder whose image-token embeddings are replaced by the
// projected image features in order.
//
// Module tree (transformers-5 names): model.vision_tower.vision_model.*,
// model.multi_modal_projector.linear_{1,2}, model.language_model.*, lm_head.
#ifndef CDCCA_MODEL_ARCH_LLAVA_H_
#define CDCCA_MODEL_ARCH_LLAVA_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/arch/clip_vision.h"
#include "model/arch/decoder_lm.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/folder_config.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

// LlavaConfig and ParseLlavaConfig are in folder_config.h (torch-free).

// The tower's features LLaVA projects: the hidden states at `config`'s
// vision_feature_layers (concatenated), without the class token under the "default"
// strategy. pixel_values [B, C, S, S] -> [B, NumImageTokens(), vision hidden x layers]. Layers
// past the deepest one used are not computed.
torch::Tensor SelectLlavaFeatures(ClipVisionTowerImpl& tower, const LlavaConfig& config,
                                  const torch::Tensor& pixel_values);

class LlavaImpl : public torch::nn::Module {
 public:
  LlavaImpl(const LlavaConfig& config, const WeightPrecision& precision);

  absl::Status Load(const ModelFolder& folder, torch::Device device);

  // pixel_values [B, C, S, S] -> projected features [B, NumImageTokens(), text hidden].
  torch::Tensor ImageFeatures(const torch::Tensor& pixel_values);
  // Its two halves: the vision tower's selected hidden states [B, NumImageTokens(),
  // vision hidden x layers] (what a device uplinks), and the projector over them.
  torch::Tensor SelectedFeatures(const torch::Tensor& pixel_values);
  torch::Tensor Project(const torch::Tensor& selected);
  // Token embeddings with the image-token positions replaced by `features` in order.
  // InvalidArgument when the counts differ.
  absl::StatusOr<torch::Tensor> MergeEmbeddings(const torch::Tensor& input_ids,
                                                const torch::Tensor& features);

  // LoRA on the projector's linear_1 and linear_2 (AdapterOptions::lora_projector), A drawn
  // from options.seed + 2.
  void AddProjectorLora(const AdapterOptions& options);
  // LoRA on the tower's attention (q_proj and v_proj) in the layers whose output LLaVA reads
  // (AdapterOptions::lora_vision), A drawn from options.seed + 3; with lora_vision_mlp on
  // their MLP's fc1 and fc2 too, A drawn from options.seed + 4.
  void AddVisionLora(const AdapterOptions& options);
  // How many of the tower's encoder layers run: those up to the deepest feature layer.
  int64_t VisionLayersUsed() const;

  const LlavaConfig& config() const { return config_; }
  DecoderLmImpl& language_model() { return *language_model_; }

 private:
  struct Projector : torch::nn::Module {
    Linear linear_1{nullptr}, linear_2{nullptr};
  };
  struct Body : torch::nn::Module {};  // "model."

  LlavaConfig config_;
  std::shared_ptr<Body> model_;
  ClipVisionTower vision_tower_{nullptr};
  std::shared_ptr<Projector> projector_;
  DecoderLm language_model_{nullptr};
};
TORCH_MODULE(Llava);

// The MultimodalModel for model_type "llava".
absl::StatusOr<std::unique_ptr<MultimodalModel>> LoadLlavaModel(const ModelFolder& folder,
                                                                const WeightPrecision& precision,
                                                                torch::Device device);

// The MultimodalModel of a model built in memory (pretraining's): what LoadLlavaModel gives
// for the folder it would be saved as, sharing `model`'s weights. `image_token` is the
// processor's placeholder text; generation stops at `eos_token_ids`.
std::unique_ptr<MultimodalModel> WrapLlavaModel(std::shared_ptr<LlavaImpl> model,
                                                std::string image_token,
                                                std::vector<int64_t> eos_token_ids,
                                                torch::Device device);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_LLAVA_H_
