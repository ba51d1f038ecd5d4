// The device's student when --checkpoint_dir is a Hugging Face folder (LLaVA, BLIP-2,
// InstructBLIP): what InferenceRuntime delegates to instead of a cdcca family.
//
// Answers go through the vision tower's tokens (HfAnswerer::AnswerRgbFromTokens), the same
// computation the cloud mirror runs on uplinked tokens; UTS stage 2 is VIS (hf_model.h
// VisualTokenPassOptions, paper Eq. 3), or an attention ablation from the same passes. The
// trainable set is the paper's (hf_model.h AdapterOptions) under the checkpoint's names, aliasing
// the model, so a DWC update adds to the live weights.
//
// Not thread-safe: InferenceRuntime serialises every call under its lock.
#ifndef CDCCA_DEVICE_INTERNAL_HUB_STUDENT_H_
#define CDCCA_DEVICE_INTERNAL_HUB_STUDENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "compress/named_tensors.h"
#include "device/inference_runtime.h"

namespace cdcca::device::internal {

class HubStudent {
 public:
  virtual ~HubStudent() = default;
  // One frame's answer: text, the question's ids (no special tokens: the cloud decodes them
  // with the student's tokenizer and applies each side's template), the answer's ids (up to
  // EOS), the mean answer-token entropy and the tower's tokens.
  virtual absl::StatusOr<AnswerResult> Answer(const Frame& frame) = 0;
  // Stage 2 for the frame `visual` came from, `passes` passes: per token VIS (kVis), VIS
  // over F's mean square (kVisRelative), the attention mass's variance (kAttentionVariance) or mean
  // (kAttentionMass), the kinds InferenceRuntime::TokenScores lets through (it refuses the others
  // before calling).
  virtual absl::StatusOr<std::vector<float>> Scores(const VisualTokens& visual, int passes,
                                                    float dropout_p, uint64_t seed,
                                                    TokenScore kind) = 0;
  // The jpeg uplink: the frame as the tower takes it, as JPEG (HfAnswerer::TowerInputJpeg);
  // FAILED_PRECONDITION where CanSendFrames() is false.
  virtual absl::StatusOr<std::string> FrameJpeg(const Frame& frame, int quality) = 0;
  // Whether the processor's output size is fixed (HfAnswerer::TowerInputSize), which the
  // cloud needs to check a frame before decoding it.
  virtual bool CanSendFrames() const = 0;
  // The trainable set (aliases the model's tensors).
  virtual compress::NamedTensors Trainable() = 0;
  virtual uint64_t BaseFingerprint() const = 0;
  virtual uint64_t VisionFingerprint() const = 0;
  virtual int64_t BaseBytes() = 0;
};

// Loads options.checkpoint_dir at options.precision on the CPU and adds the adapters
// (options.lora_*, seed 0, as the cloud's mirror does). Unimplemented where the build has no
// Hugging Face tokenizers.
absl::StatusOr<std::unique_ptr<HubStudent>> LoadHubStudent(const RuntimeOptions& options);

// Whether `dir` is a model folder the device reads: config.json's model_type is llava,
// blip-2 or instructblip (a cdcca family's student folder is a blip-2 one).
bool IsHubFolder(const std::string& dir);

}  // namespace cdcca::device::internal

#endif  // CDCCA_DEVICE_INTERNAL_HUB_STUDENT_H_
