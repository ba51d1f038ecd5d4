// The device's student: a model folder (LLaVA, BLIP-2, InstructBLIP; a cdcca family's folder is
// a BLIP-2 one) at the device's precision with the adapters the cloud's mirror trains. What
// InferenceRuntime answers, scores and updates through.
//
// Answers go through the vision tower's tokens (Answerer::AnswerRgbFromTokens), the same
// computation the cloud mirror runs on uplinked tokens; UTS stage 2 is VIS (multimodal_model.h
// VisualTokenPassOptions, paper Eq. 3), or an attention ablation from the same passes. The
// trainable set is the paper's (multimodal_model.h AdapterOptions) under the checkpoint's
// names, aliasing the model, so a DWC update adds to the live weights.
//
// Not thread-safe: InferenceRuntime serialises every call under its lock.
#ifndef CDCCA_DEVICE_INTERNAL_STUDENT_H_
#define CDCCA_DEVICE_INTERNAL_STUDENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "compress/named_tensors.h"
#include "device/inference_runtime.h"
#include "model/arch/answerer.h"
#include "model/arch/multimodal_model.h"

namespace cdcca::device::internal {

class Student {
 public:
  // Loads options.checkpoint_dir at options.precision on the CPU and adds the adapters
  // (options.lora_*, seed 0, as the cloud's mirror does).
  static absl::StatusOr<std::unique_ptr<Student>> Load(const RuntimeOptions& options);

  // One frame's answer: text, the question's ids (no special tokens: the cloud decodes them
  // with the student's tokenizer and applies each side's template), the answer's ids (up to
  // EOS), the mean answer-token entropy and the tower's tokens.
  absl::StatusOr<AnswerResult> Answer(const Frame& frame);
  // Stage 2 for the frame `visual` came from, `passes` passes: per token VIS (kVis), VIS
  // over F's mean square (kVisRelative), the attention mass's variance (kAttentionVariance) or
  // mean (kAttentionMass), the kinds InferenceRuntime::TokenScores lets through (it refuses
  // the others before calling).
  absl::StatusOr<std::vector<float>> Scores(const VisualTokens& visual, int passes, float dropout_p,
                                            uint64_t seed, TokenScore kind);
  // The jpeg uplink: the frame as the tower takes it, as JPEG (Answerer::TowerInputJpeg);
  // FAILED_PRECONDITION where CanSendFrames() is false.
  absl::StatusOr<std::string> FrameJpeg(const Frame& frame, int quality);
  // Whether the processor's output size is fixed (Answerer::TowerInputSize), which the
  // cloud needs to check a frame before decoding it.
  bool CanSendFrames() const;
  // The trainable set (aliases the model's tensors).
  compress::NamedTensors Trainable();
  uint64_t BaseFingerprint() const { return base_fingerprint_; }
  uint64_t VisionFingerprint() const { return vision_fingerprint_; }
  int64_t BaseBytes();

 private:
  Student(std::unique_ptr<model::Answerer> answerer, model::PromptFormat format,
          int max_new_tokens);
  absl::Status Init(const RuntimeOptions& options);

  std::unique_ptr<model::Answerer> answerer_;
  model::PromptFormat format_;
  int max_new_tokens_;
  uint64_t base_fingerprint_ = 0;
  uint64_t vision_fingerprint_ = 0;
};

// The adapters `options` ask for (seed 0, as the cloud's mirror adds them).
model::AdapterOptions AdaptersOf(const RuntimeOptions& options);

// Whether `dir` is a model folder the device reads: config.json's model_type is llava,
// blip-2 or instructblip (a cdcca family's student folder is a blip-2 one).
bool IsModelFolder(const std::string& dir);

}  // namespace cdcca::device::internal

#endif  // CDCCA_DEVICE_INTERNAL_STUDENT_H_
