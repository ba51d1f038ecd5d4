// The shared vision encoder: 64x64 RGB -> a grid of visual tokens (8x8 = 64 tokens of width
// d_vis for the default configs). Teacher and student use the same frozen encoder, so the
// tokens a device uplinks are exactly the cloud's input.
//
// Parameter names: "convs.<i>.weight|bias", "norms.<i>.weight|bias" (+ BatchNorm running
// statistics as buffers), "proj.weight|bias", "pos_embed".
#ifndef CDCCA_DISTILL_MODEL_VISION_ENCODER_H_
#define CDCCA_DISTILL_MODEL_VISION_ENCODER_H_

#include <torch/torch.h>

#include "distill/model/config.h"

namespace cdcca::model {

class VisionEncoderImpl : public torch::nn::Module {
 public:
  explicit VisionEncoderImpl(const VisionConfig& config);

  // images: [B, 3, S, S] float in [0, 1] (S = image_size). Returns [B, N, d_vis] tokens in
  // row-major grid order (token index = row * grid + col). Call eval() once the encoder is
  // frozen so BatchNorm uses its running statistics.
  torch::Tensor forward(const torch::Tensor& images);

  const VisionConfig& config() const { return config_; }

 private:
  VisionConfig config_;
  torch::nn::ModuleList convs_;
  torch::nn::ModuleList norms_;
  torch::nn::Conv2d proj_{nullptr};
  torch::Tensor pos_embed_;
};
TORCH_MODULE(VisionEncoder);

}  // namespace cdcca::model

#endif  // CDCCA_DISTILL_MODEL_VISION_ENCODER_H_
