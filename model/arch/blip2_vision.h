// The BLIP-2 / InstructBLIP vision transformer (transformers' Blip2VisionModel and
// InstructBlipVisionModel, the EVA ViT-g of the published checkpoints). The module tree
// mirrors the checkpoint names under `vision_model.`:
//   embeddings.{class_embedding [1,1,H], patch_embedding.{weight,bias}, position_embedding [1,P,H]}
//   encoder.layers.N.{layer_norm1, self_attn.{qkv, projection}, layer_norm2, mlp.{fc1, fc2}}
//   post_layernorm
// self_attn.qkv is one fused [3H, H] linear whose bias is [q_bias, 0, v_bias]: checkpoints
// store it either as `qkv.bias` [3H] (what transformers' conversion writes) or as separate
// `q_bias` / `v_bias` [H] (see Blip2QkvBiasFromParts).
//
// Precision: compute in precision.dtype; the linear weights (qkv, projection, fc1, fc2) are
// held as precision.weights (int8 / int4 quantized at load, layers.h); the patch
// convolution, embeddings and norms stay float. Parameters are placeholders until loaded.
//
// Not thread-safe for concurrent forward + mutation; concurrent forwards under NoGradGuard
// are fine.
#ifndef CDCCA_MODEL_ARCH_BLIP2_VISION_H_
#define CDCCA_MODEL_ARCH_BLIP2_VISION_H_

#include <torch/torch.h>

#include <string>

#include "model/arch/layers.h"
#include "model/hub/blip2_config.h"

namespace cdcca::model {

// The fused qkv bias [3H] from the checkpoint's separate q and v biases (k gets zeros).
torch::Tensor Blip2QkvBiasFromParts(const torch::Tensor& q_bias, const torch::Tensor& v_bias);

class Blip2VisionEmbeddingsImpl : public torch::nn::Module {
 public:
  Blip2VisionEmbeddingsImpl(const Blip2VisionConfig& config, const WeightPrecision& precision);
  // pixel_values [B, C, image_size, image_size] -> [B, P, H] (class token first).
  torch::Tensor forward(const torch::Tensor& pixel_values);

  torch::Tensor class_embedding;
  torch::nn::Conv2d patch_embedding{nullptr};
  torch::Tensor position_embedding;
};
TORCH_MODULE(Blip2VisionEmbeddings);

class Blip2VisionAttentionImpl : public torch::nn::Module {
 public:
  Blip2VisionAttentionImpl(const Blip2VisionConfig& config, const WeightPrecision& precision);
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, H] -> [B, T, H], no mask

  Linear qkv{nullptr};  // [3H, H], bias [3H] iff config.qkv_bias
  Linear projection{nullptr};

 private:
  int64_t heads_;
};
TORCH_MODULE(Blip2VisionAttention);

class Blip2VisionMlpImpl : public torch::nn::Module {
 public:
  Blip2VisionMlpImpl(const Blip2VisionConfig& config, const WeightPrecision& precision);
  torch::Tensor forward(const torch::Tensor& x);

  Linear fc1{nullptr};
  Linear fc2{nullptr};

 private:
  std::string act_;
};
TORCH_MODULE(Blip2VisionMlp);

// Pre-norm block: x + attn(ln1(x)), then + mlp(ln2(.)).
class Blip2VisionLayerImpl : public torch::nn::Module {
 public:
  Blip2VisionLayerImpl(const Blip2VisionConfig& config, const WeightPrecision& precision);
  torch::Tensor forward(const torch::Tensor& x);

  LayerNormLayer layer_norm1{nullptr};
  Blip2VisionAttention self_attn{nullptr};
  LayerNormLayer layer_norm2{nullptr};
  Blip2VisionMlp mlp{nullptr};
};
TORCH_MODULE(Blip2VisionLayer);

class Blip2VisionEncoderImpl : public torch::nn::Module {
 public:
  Blip2VisionEncoderImpl(const Blip2VisionConfig& config, const WeightPrecision& precision);
  torch::Tensor forward(torch::Tensor x);

  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(Blip2VisionEncoder);

class Blip2VisionModelImpl : public torch::nn::Module {
 public:
  Blip2VisionModelImpl(const Blip2VisionConfig& config, const WeightPrecision& precision = {});

  // pixel_values [B, C, image_size, image_size] (converted to the weights' dtype) ->
  // last_hidden_state [B, P, H], post-layernormed, as transformers returns it. Throws
  // c10::Error on a wrong image size (callers check config().image_size first).
  torch::Tensor forward(const torch::Tensor& pixel_values);

  const Blip2VisionConfig& config() const { return config_; }

  Blip2VisionEmbeddings embeddings{nullptr};
  Blip2VisionEncoder encoder{nullptr};
  LayerNormLayer post_layernorm{nullptr};

 private:
  Blip2VisionConfig config_;
};
TORCH_MODULE(Blip2VisionModel);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_BLIP2_VISION_H_
