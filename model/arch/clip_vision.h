// CLIP and SigLIP vision towers as transformers defines them (modeling_clip.py,
// modeling_siglip.py), as LLaVA uses them: patch embedding (conv; CLIP without bias and with
// a class token, SigLIP with bias and none), learned positions, CLIP's pre-layernorm,
// pre-norm encoder layers (self_attn.{q,k,v,out}_proj, layer_norm1/2, mlp.fc1/fc2) and
// post_layernorm.
//
// Module tree = the checkpoint's names under "<prefix>vision_model.": embeddings.*,
// pre_layrnorm (CLIP, transformers' spelling), encoder.layers.N.*, post_layernorm.
// SigLIP's attention-pooling head (vision_use_head) is not used by LLaVA and not loaded.
#ifndef CDCCA_MODEL_ARCH_CLIP_VISION_H_
#define CDCCA_MODEL_ARCH_CLIP_VISION_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/arch/layers.h"
#include "model/hub/folder_config.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

// ClipVisionConfig and ParseClipVisionConfig are in folder_config.h (torch-free).

class ClipEncoderLayerImpl : public torch::nn::Module {
 public:
  ClipEncoderLayerImpl(const ClipVisionConfig& c, const WeightPrecision& p);
  torch::Tensor forward(const torch::Tensor& x);

  // The attention's query and value projections: where LoRA goes on the tower
  // (AdapterOptions::lora_vision).
  Linear& q_proj() { return self_attn_->q_proj; }
  Linear& v_proj() { return self_attn_->v_proj; }
  // The MLP's projections (AdapterOptions::lora_vision_mlp).
  Linear& fc1() { return mlp_->fc1; }
  Linear& fc2() { return mlp_->fc2; }

 private:
  struct Attention : torch::nn::Module {
    Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  };
  struct Mlp : torch::nn::Module {
    Linear fc1{nullptr}, fc2{nullptr};
  };
  std::shared_ptr<Attention> self_attn_;
  std::shared_ptr<Mlp> mlp_;
  LayerNormLayer layer_norm1_{nullptr}, layer_norm2_{nullptr};
  int64_t heads_, head_dim_;
  std::string act_;
};
TORCH_MODULE(ClipEncoderLayer);

class ClipVisionTowerImpl : public torch::nn::Module {
 public:
  ClipVisionTowerImpl(const ClipVisionConfig& config, const WeightPrecision& precision);

  // pixel_values [B, C, H, W] -> hidden states as transformers' output_hidden_states lists
  // them: [0] = embeddings (after CLIP's pre-layernorm), [i] = output of layer i. Layers past
  // `last_layer` (an index into that list, negative from the end) are not computed.
  std::vector<torch::Tensor> HiddenStates(const torch::Tensor& pixel_values, int64_t last_layer);
  // post_layernorm(last layer output).
  torch::Tensor LastHiddenState(const torch::Tensor& pixel_values);

  const ClipVisionConfig& config() const { return config_; }
  // Encoder layer `i` (0-based).
  ClipEncoderLayerImpl& layer(int64_t i) {
    return vision_model_->encoder->layers->at<ClipEncoderLayerImpl>(static_cast<size_t>(i));
  }

 private:
  // Conv with kernel = stride = patch: "weight" [hidden, C, p, p], "bias" (SigLIP).
  struct PatchConv : torch::nn::Module {
    torch::Tensor weight, bias;
  };
  struct Embeddings : torch::nn::Module {
    std::shared_ptr<PatchConv> patch_embedding;
    torch::Tensor class_embedding;  // CLIP only
    Embedding position_embedding{nullptr};
  };
  struct Encoder : torch::nn::Module {
    torch::nn::ModuleList layers{nullptr};
  };
  struct VisionModel : torch::nn::Module {
    std::shared_ptr<Embeddings> embeddings;
    LayerNormLayer pre_layrnorm{nullptr};  // CLIP only
    std::shared_ptr<Encoder> encoder;
    LayerNormLayer post_layernorm{nullptr};
  };

  ClipVisionConfig config_;
  WeightPrecision precision_;
  std::shared_ptr<VisionModel> vision_model_;
};
TORCH_MODULE(ClipVisionTower);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_CLIP_VISION_H_
