#include "model/family/vision_encoder.h"

#include "model/family/blip2_tower.h"

namespace cdcca::model {

VisionEncoderImpl::VisionEncoderImpl(const VisionConfig& config) : config_(config) {
  vision_model = register_module("vision_model", MakeFamilyVit(config));
}

torch::Tensor VisionEncoderImpl::forward(const torch::Tensor& images) {
  TORCH_CHECK(images.dim() == 4 && images.size(2) == config_.image_size &&
                  images.size(3) == config_.image_size,
              "VisionEncoder expects images [B, 3, ", config_.image_size, ", ", config_.image_size,
              "]");
  return vision_model->forward(FamilyPixelValues(images));
}

}  // namespace cdcca::model
