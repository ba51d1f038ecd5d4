// Multimodal models loaded from Hugging Face folders (issue 19): one interface that LLaVA,
// BLIP-2 and InstructBLIP implement, and LoadHfModel(), which dispatches on config.json's
// model_type. Programs (cdcca generate / answer, the device) use only this header.
//
// A model is not thread-safe: one Generate at a time.
#ifndef CDCCA_DISTILL_MODEL_HF_MODEL_H_
#define CDCCA_DISTILL_MODEL_HF_MODEL_H_

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "distill/model/generation.h"
#include "distill/model/hf_folder.h"
#include "distill/model/hf_linear.h"

namespace cdcca::model {

struct HfModelOptions {
  // fp32 | bf16 | fp16 (compute and weights in that dtype), int8 | int4 (frozen linear
  // weights quantized at load; compute in fp32 on CPU, bf16 on CUDA). Default: fp32.
  std::string precision = "fp32";
  int64_t int4_group = 128;  // 32, 64 or 128
  torch::Device device = torch::kCPU;
};

// The weight storage and compute dtype an options set stands for. InvalidArgument naming
// the option for an unknown precision or int4 group. (bf16/fp16 on CPU are allowed, slow.)
absl::StatusOr<HfPrecision> ResolveHfPrecision(const HfModelOptions& options);

// What one generation call gets: the processor's outputs.
struct MultimodalInputs {
  torch::Tensor pixel_values;    // [B, 3, H, W] float, as the image processor gives them
  torch::Tensor input_ids;       // [B, T] int64: the LM prompt after image-token expansion
  torch::Tensor attention_mask;  // [B, T] (1 = token, 0 = left padding); undefined = all 1
  // InstructBLIP only: the instruction in the Q-Former's tokenizer.
  torch::Tensor qformer_input_ids, qformer_attention_mask;
};

class MultimodalModel {
 public:
  virtual ~MultimodalModel() = default;

  virtual std::string model_type() const = 0;
  // The prompt text after the processor's image-placeholder expansion (LLaVA: "<image>" ->
  // one image token per image feature), ready for the tokenizer.
  virtual std::string ExpandPrompt(const std::string& prompt) const = 0;
  // The same expansion on ids (identical when the placeholder is one added token).
  virtual std::vector<int64_t> ExpandImageTokens(const std::vector<int64_t>& ids) const = 0;
  // Greedy answer. InvalidArgument for inputs that do not fit the model (image size, image
  // token count); errors from the tensor library become Internal.
  virtual absl::StatusOr<GreedyResult> Generate(const MultimodalInputs& inputs,
                                                const GreedyOptions& options) = 0;
  // The ids generation stops at (generation_config.json, else config.json).
  virtual std::vector<int64_t> eos_token_ids() const = 0;
  // Bytes of weights held (quantized weights at their packed size).
  virtual int64_t ResidentBytes() = 0;
  virtual torch::Device device() const = 0;
};

// Opens `dir` and builds the model config.json names (model_type llava; blip-2 and
// instructblip where registered). Errors name the file and the field or tensor.
absl::StatusOr<std::unique_ptr<MultimodalModel>> LoadHfModel(const std::string& dir,
                                                              const HfModelOptions& options);

// One architecture's loader, for the dispatch table in hf_model.cc.
using HfModelLoader = absl::StatusOr<std::unique_ptr<MultimodalModel>> (*)(
    const HfFolder& folder, const HfPrecision& precision, torch::Device device);

}  // namespace cdcca::model

#endif  // CDCCA_DISTILL_MODEL_HF_MODEL_H_
