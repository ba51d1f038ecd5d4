// The shared vision encoder of a family: a BLIP-2 ViT (blip2_vision.h, sized by VisionConfig)
// over images in [0, 1], normalized as the family's preprocessor_config.json says
// (FamilyPixelValues). Output: the ViT's last hidden state, [B, 1 + grid^2, d_vis]: the class
// token, then the patch tokens in row-major grid order (token 1 + row * grid + col). Teacher
// and student read the same frozen encoder, so the tokens a device uplinks are exactly the
// cloud's input.
//
// Parameter names: "vision_model.*", transformers' names in a BLIP-2 folder.
// Thread-safety: as torch modules; concurrent const use under NoGradGuard is fine.
#ifndef CDCCA_MODEL_FAMILY_VISION_ENCODER_H_
#define CDCCA_MODEL_FAMILY_VISION_ENCODER_H_

#include <torch/torch.h>

#include "model/arch/blip2_vision.h"
#include "model/family/config.h"

namespace cdcca::model {

class VisionEncoderImpl : public torch::nn::Module {
 public:
  // Freshly initialised (transformers' init; seed torch first), every parameter trainable.
  explicit VisionEncoderImpl(const VisionConfig& config);

  // images: [B, 3, S, S] float in [0, 1] (S = image_size) -> [B, 1 + grid^2, d_vis].
  torch::Tensor forward(const torch::Tensor& images);

  const VisionConfig& config() const { return config_; }

  Blip2VisionModel vision_model{nullptr};

 private:
  VisionConfig config_;
};
TORCH_MODULE(VisionEncoder);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_VISION_ENCODER_H_
