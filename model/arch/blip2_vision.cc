#include "model/arch/blip2_vision.h"

#include <cmath>

#include "model/runtime/batched_matmul.h"

namespace cdcca::model {

torch::Tensor Blip2QkvBiasFromParts(const torch::Tensor& q_bias, const torch::Tensor& v_bias) {
  return torch::cat({q_bias, torch::zeros_like(v_bias), v_bias});
}

Blip2VisionEmbeddingsImpl::Blip2VisionEmbeddingsImpl(const Blip2VisionConfig& config,
                                                     const WeightPrecision& precision) {
  const torch::ScalarType dtype = precision.dtype;
  class_embedding =
      register_parameter("class_embedding", Placeholder({1, 1, config.hidden_size}, dtype));
  patch_embedding = register_module(
      "patch_embedding",
      torch::nn::Conv2d(
          torch::nn::Conv2dOptions(config.num_channels, config.hidden_size, config.patch_size)
              .stride(config.patch_size)
              .bias(true)));
  patch_embedding->to(dtype);
  position_embedding = register_parameter(
      "position_embedding", Placeholder({1, config.NumPositions(), config.hidden_size}, dtype));
}

torch::Tensor Blip2VisionEmbeddingsImpl::forward(const torch::Tensor& pixel_values) {
  const auto dtype = patch_embedding->weight.scalar_type();
  torch::Tensor patches = patch_embedding->forward(pixel_values.to(dtype));  // [B, H, g, g]
  patches = patches.flatten(2).transpose(1, 2);                              // [B, g*g, H]
  torch::Tensor cls = class_embedding.to(dtype).expand({patches.size(0), 1, -1});
  torch::Tensor embeddings = torch::cat({cls, patches}, 1);
  return embeddings + position_embedding.slice(1, 0, embeddings.size(1)).to(dtype);
}

namespace {
Linear MakeLinear(int64_t in, int64_t out, bool bias, const WeightPrecision& precision) {
  LinearOptions o;
  o.in_features = in;
  o.out_features = out;
  o.bias = bias;
  o.precision = precision;
  return Linear(o);
}
}  // namespace

Blip2VisionAttentionImpl::Blip2VisionAttentionImpl(const Blip2VisionConfig& config,
                                                   const WeightPrecision& precision)
    : heads_(config.num_attention_heads) {
  const int64_t h = config.hidden_size;
  qkv = register_module("qkv", MakeLinear(h, 3 * h, config.qkv_bias, precision));
  projection = register_module("projection", MakeLinear(h, h, true, precision));
}

torch::Tensor Blip2VisionAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0);
  const int64_t t = x.size(1);
  const int64_t h = x.size(2);
  const int64_t head_dim = h / heads_;
  // [B, T, 3H] -> [3, B, heads, T, head_dim]
  torch::Tensor mixed =
      qkv->forward(x).reshape({b, t, 3, heads_, head_dim}).permute({2, 0, 3, 1, 4});
  torch::Tensor q = mixed[0];
  torch::Tensor k = mixed[1];
  torch::Tensor v = mixed[2];
  torch::Tensor scores =
      BatchedMatmul(q, k.transpose(-1, -2)) * (1.0 / std::sqrt(double(head_dim)));
  torch::Tensor probs = torch::softmax(scores, -1);
  torch::Tensor context = BatchedMatmul(probs, v).permute({0, 2, 1, 3}).reshape({b, t, h});
  return projection->forward(context);
}

Blip2VisionMlpImpl::Blip2VisionMlpImpl(const Blip2VisionConfig& config,
                                       const WeightPrecision& precision)
    : act_(config.hidden_act) {
  fc1 = register_module("fc1",
                        MakeLinear(config.hidden_size, config.intermediate_size, true, precision));
  fc2 = register_module("fc2",
                        MakeLinear(config.intermediate_size, config.hidden_size, true, precision));
}

torch::Tensor Blip2VisionMlpImpl::forward(const torch::Tensor& x) {
  return fc2->forward(Activation(act_, fc1->forward(x)));
}

Blip2VisionLayerImpl::Blip2VisionLayerImpl(const Blip2VisionConfig& config,
                                           const WeightPrecision& precision) {
  const int64_t h = config.hidden_size;
  self_attn = register_module("self_attn", Blip2VisionAttention(config, precision));
  layer_norm1 =
      register_module("layer_norm1", LayerNormLayer(h, config.layer_norm_eps, precision.dtype));
  mlp = register_module("mlp", Blip2VisionMlp(config, precision));
  layer_norm2 =
      register_module("layer_norm2", LayerNormLayer(h, config.layer_norm_eps, precision.dtype));
}

torch::Tensor Blip2VisionLayerImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = x + self_attn->forward(layer_norm1->forward(x));
  return h + mlp->forward(layer_norm2->forward(h));
}

Blip2VisionEncoderImpl::Blip2VisionEncoderImpl(const Blip2VisionConfig& config,
                                               const WeightPrecision& precision) {
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers->push_back(Blip2VisionLayer(config, precision));
  }
}

torch::Tensor Blip2VisionEncoderImpl::forward(torch::Tensor x) {
  for (const auto& layer : *layers) x = layer->as<Blip2VisionLayerImpl>()->forward(x);
  return x;
}

Blip2VisionModelImpl::Blip2VisionModelImpl(const Blip2VisionConfig& config,
                                           const WeightPrecision& precision)
    : config_(config) {
  embeddings = register_module("embeddings", Blip2VisionEmbeddings(config, precision));
  encoder = register_module("encoder", Blip2VisionEncoder(config, precision));
  post_layernorm = register_module(
      "post_layernorm", LayerNormLayer(config.hidden_size, config.layer_norm_eps, precision.dtype));
}

torch::Tensor Blip2VisionModelImpl::forward(const torch::Tensor& pixel_values) {
  return post_layernorm->forward(encoder->forward(embeddings->forward(pixel_values)));
}

}  // namespace cdcca::model
