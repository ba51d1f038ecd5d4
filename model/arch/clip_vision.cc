#include "model/arch/clip_vision.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace cdcca::model {
ClipEncoderLayerImpl::ClipEncoderLayerImpl(const ClipVisionConfig& c, const WeightPrecision& p)
    : heads_(c.num_attention_heads),
      head_dim_(c.hidden_size / c.num_attention_heads),
      act_(c.hidden_act) {
  auto linear = [&](int64_t in, int64_t out) { return Linear(LinearOptions{in, out, true, p}); };
  self_attn_ = register_module("self_attn", std::make_shared<Attention>());
  self_attn_->q_proj = self_attn_->register_module("q_proj", linear(c.hidden_size, c.hidden_size));
  self_attn_->k_proj = self_attn_->register_module("k_proj", linear(c.hidden_size, c.hidden_size));
  self_attn_->v_proj = self_attn_->register_module("v_proj", linear(c.hidden_size, c.hidden_size));
  self_attn_->out_proj =
      self_attn_->register_module("out_proj", linear(c.hidden_size, c.hidden_size));
  layer_norm1_ =
      register_module("layer_norm1", LayerNormLayer(c.hidden_size, c.layer_norm_eps, p.dtype));
  mlp_ = register_module("mlp", std::make_shared<Mlp>());
  mlp_->fc1 = mlp_->register_module("fc1", linear(c.hidden_size, c.intermediate_size));
  mlp_->fc2 = mlp_->register_module("fc2", linear(c.intermediate_size, c.hidden_size));
  layer_norm2_ =
      register_module("layer_norm2", LayerNormLayer(c.hidden_size, c.layer_norm_eps, p.dtype));
}

torch::Tensor ClipEncoderLayerImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1);
  torch::Tensor h = layer_norm1_(x);
  auto split = [&](const torch::Tensor& y) {
    return y.view({b, t, heads_, head_dim_}).transpose(1, 2);
  };
  torch::Tensor q = split(self_attn_->q_proj(h));
  torch::Tensor k = split(self_attn_->k_proj(h));
  torch::Tensor v = split(self_attn_->v_proj(h));
  const double scaling = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  torch::Tensor probs =
      torch::softmax(torch::matmul(q, k.transpose(2, 3)) * scaling, -1, torch::kFloat)
          .to(q.scalar_type());
  torch::Tensor attn = torch::matmul(probs, v).transpose(1, 2).reshape({b, t, heads_ * head_dim_});
  torch::Tensor r = x + self_attn_->out_proj(attn);
  return r + mlp_->fc2(Activation(act_, mlp_->fc1(layer_norm2_(r))));
}

ClipVisionTowerImpl::ClipVisionTowerImpl(const ClipVisionConfig& config,
                                         const WeightPrecision& precision)
    : config_(config), precision_(precision) {
  const auto dtype = precision.dtype;
  const int64_t h = config.hidden_size;
  vision_model_ = register_module("vision_model", std::make_shared<VisionModel>());
  VisionModel& vm = *vision_model_;
  vm.embeddings = vm.register_module("embeddings", std::make_shared<Embeddings>());
  Embeddings& e = *vm.embeddings;
  e.patch_embedding = e.register_module("patch_embedding", std::make_shared<PatchConv>());
  e.patch_embedding->weight = e.patch_embedding->register_parameter(
      "weight", Placeholder({h, config.num_channels, config.patch_size, config.patch_size}, dtype),
      false);
  if (config.is_siglip()) {
    e.patch_embedding->bias =
        e.patch_embedding->register_parameter("bias", Placeholder({h}, dtype), false);
  } else {
    e.class_embedding = e.register_parameter("class_embedding", Placeholder({h}, dtype), false);
    vm.pre_layrnorm =
        vm.register_module("pre_layrnorm", LayerNormLayer(h, config.layer_norm_eps, dtype));
  }
  e.position_embedding =
      e.register_module("position_embedding", Embedding(config.num_positions(), h, dtype));
  vm.encoder = vm.register_module("encoder", std::make_shared<Encoder>());
  vm.encoder->layers = vm.encoder->register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    vm.encoder->layers->push_back(ClipEncoderLayer(config, precision));
  }
  vm.post_layernorm =
      vm.register_module("post_layernorm", LayerNormLayer(h, config.layer_norm_eps, dtype));
}

std::vector<torch::Tensor> ClipVisionTowerImpl::HiddenStates(const torch::Tensor& pixel_values,
                                                             int64_t last_layer) {
  VisionModel& vm = *vision_model_;
  Embeddings& e = *vm.embeddings;
  const int64_t n = config_.num_hidden_layers;
  if (last_layer < 0) last_layer += n + 1;
  TORCH_CHECK(last_layer >= 0 && last_layer <= n, "vision feature layer out of range");
  torch::Tensor x = pixel_values.to(e.patch_embedding->weight.scalar_type());
  torch::Tensor patches =
      torch::conv2d(x, e.patch_embedding->weight, e.patch_embedding->bias, config_.patch_size);
  patches = patches.flatten(2).transpose(1, 2);  // [B, patches, H]
  if (!config_.is_siglip()) {
    torch::Tensor cls = e.class_embedding.view({1, 1, -1}).expand({patches.size(0), 1, -1});
    patches = torch::cat({cls.to(patches.scalar_type()), patches}, 1);
  }
  torch::Tensor h = patches + e.position_embedding->weight.unsqueeze(0);
  if (vm.pre_layrnorm) h = vm.pre_layrnorm(h);
  std::vector<torch::Tensor> states{h};
  for (int64_t i = 0; i < last_layer; ++i) {
    h = vm.encoder->layers->ptr(i)->as<ClipEncoderLayerImpl>()->forward(h);
    states.push_back(h);
  }
  return states;
}

torch::Tensor ClipVisionTowerImpl::LastHiddenState(const torch::Tensor& pixel_values) {
  return vision_model_->post_layernorm(HiddenStates(pixel_values, -1).back());
}

}  // namespace cdcca::model
