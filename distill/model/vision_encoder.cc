#include "distill/model/vision_encoder.h"

namespace cdcca::model {

VisionEncoderImpl::VisionEncoderImpl(const VisionConfig& config) : config_(config) {
  convs_ = register_module("convs", torch::nn::ModuleList());
  norms_ = register_module("norms", torch::nn::ModuleList());
  int64_t in = 3;
  for (int c : config.channels) {
    // Stride 2 from the first layer on: a full-resolution stem would cost ~4x the compute
    // for little gain on 64x64 scenes of 1-4 items.
    convs_->push_back(
        torch::nn::Conv2d(torch::nn::Conv2dOptions(in, c, 3).stride(2).padding(1).bias(false)));
    norms_->push_back(torch::nn::BatchNorm2d(c));
    in = c;
  }
  // 3x3 at grid resolution widens each token's receptive field to whole Fashion-MNIST items.
  proj_ = register_module(
      "proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, config.d_vis, 3).padding(1)));
  pos_embed_ =
      register_parameter("pos_embed", torch::randn({1, config.NumTokens(), config.d_vis}) * 0.02);
}

torch::Tensor VisionEncoderImpl::forward(const torch::Tensor& images) {
  TORCH_CHECK(images.dim() == 4 && images.size(1) == 3 && images.size(2) == config_.image_size &&
                  images.size(3) == config_.image_size,
              "VisionEncoder expects [B, 3, ", config_.image_size, ", ", config_.image_size, "]");
  torch::Tensor x = (images - 0.5) * 4.0;  // roughly zero-mean, unit-range input
  for (size_t i = 0; i < convs_->size(); ++i) {
    x = convs_[i]->as<torch::nn::Conv2d>()->forward(x);
    x = norms_[i]->as<torch::nn::BatchNorm2d>()->forward(x);
    x = torch::relu(x);
  }
  x = proj_->forward(x);             // [B, d, g, g]
  x = x.flatten(2).transpose(1, 2);  // [B, g*g, d]
  return x + pos_embed_;
}

}  // namespace cdcca::model
