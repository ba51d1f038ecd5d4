// InferenceRuntime: the device's student MLLM, any LLaVA, BLIP-2 or InstructBLIP folder (the
// project's families are BLIP-2 folders, read the same way). Answers (image, question) pairs
// with greedy decoding and a KV cache; scores visual tokens for UTS stage 2; and applies DWC
// updates to the trainable set in place while serving.
//
// Concurrency: every call is thread-safe. The model is not: answers, scores and updates take
// one lock in turn, so no answer ever sees a half-applied update. LibTorch's intra-op threads
// are set once at Load (options.threads).
//
// The header is torch-free (pimpl), so the agent loop and tests compile fast.
#ifndef CDCCA_DEVICE_INFERENCE_RUNTIME_H_
#define CDCCA_DEVICE_INFERENCE_RUNTIME_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "datasets/image.h"
#include "device/sample_step.h"
#include "device/uts.h"
#include "settings/defaults.h"

namespace cdcca::device {

struct RuntimeOptions {
  // The student's folder: a Hugging Face LLaVA, BLIP-2 or InstructBLIP folder, downloaded or
  // written by `cdcca pretrain` (a cdcca family's student is a BLIP-2 folder).
  std::string checkpoint_dir;
  // Storage of the student's frozen base: "fp32", "bf16", "fp16", "int8" or "int4".
  // Default: the defaults table's (settings/defaults.h), as every default below.
  std::string precision = settings::kStudentPrecision;
  // Longest answer generated, in tokens (1-64; captions need datasets::kMaxCaptionTokens).
  int max_answer_tokens = settings::kMaxAnswerTokens;
  // LibTorch intra-op threads; 0 = automatic (1: the BLAS threads the matrix products over
  // every core; model/runtime/threads.h).
  int threads = 0;
  // The prompt a question is put in (model::ResolvePromptFormat: "auto" is the folder's chat
  // template where it has one, else llava's for LLaVA and none for the BLIP-2 family;
  // "chat", "none" or a named template), and the adapters the cloud trains
  // (LoRA on the LM's q/v, rank and alpha; MLP too with lora_mlp). They must be the cloud's:
  // the base fingerprint Register compares covers them.
  std::string student_template = "auto";
  int64_t lora_rank = settings::kLoraRank;
  double lora_alpha = settings::kLoraAlpha;
  bool lora_mlp = settings::kLoraMlp;
  bool lora_qformer = settings::kLoraQformer;  // BLIP-2 / InstructBLIP: the Q-Former's q and v
  bool lora_projector = false;               // the projector into the LM too (programs: --profile)
  bool lora_vision = settings::kLoraVision;  // the vision tower too (uplink frames with it)
};

// One input: an RGB image (any size; resized to the model's input) and a question.
struct Frame {
  datasets::Image image;
  std::string question;
};

// The frozen encoder's output for one frame: tokens x dim floats, row-major. Kept with the
// answer so UTS and the uplink reuse it instead of encoding the frame again.
struct VisualTokens {
  int tokens = 0;
  int dim = 0;
  std::vector<float> values;
  // The frame the tokens came from, which UTS stage 2 reads again (its passes run from the
  // pixels) and the jpeg uplink sends.
  std::shared_ptr<const Frame> source;
};

struct AnswerResult {
  std::string text;                  // decoded answer
  std::vector<uint32_t> prompt_ids;  // the question as the model saw it
  std::vector<uint32_t> answer_ids;  // generated tokens up to (not including) EOS
  float entropy = 0;                 // mean answer-token entropy, nats (UTS stage 1)
  double latency_ms = 0;             // wall time of the batch this frame was answered in
  VisualTokens visual;
};

class InferenceRuntime {
 public:
  // Loads the student and adds its adapters. INVALID_ARGUMENT for a folder that is no
  // LLaVA, BLIP-2 or InstructBLIP folder or a bad precision; the loader's errors (NOT_FOUND,
  // DATA_LOSS naming the file or tensor) otherwise.
  static absl::StatusOr<std::unique_ptr<InferenceRuntime>> Load(const RuntimeOptions& options);
  ~InferenceRuntime();

  // Answers every frame, in order.
  absl::StatusOr<std::vector<AnswerResult>> Answer(const std::vector<Frame>& frames);

  // UTS stage 2 for one frame: `passes` stochastic dropout passes (VIS,
  // model/arch/multimodal_model.h VisualTokenPassOptions) from the frame `visual` came from, as one
  // batched forward; returns one score per visual token, scored with EffectiveScore(score): vis,
  // attention_variance or attention_mass (FAILED_PRECONDITION for the probe's scores).
  // dropout_p must be in (0, 1). The draw depends on `seed` alone when given (several
  // devices in one process: the harness), else on the runtime's own count of draws.
  absl::StatusOr<std::vector<float>> TokenScores(const VisualTokens& visual, int passes,
                                                 float dropout_p, TokenScore score,
                                                 std::optional<uint64_t> seed = std::nullopt);

  // The score TokenScores computes for `score`: itself, except variance_probe, which falls
  // back to attention_variance (the product with the probe's entropy taken as constant: no
  // downloaded checkpoint has the project's token probe).
  TokenScore EffectiveScore(TokenScore score) const;

  // Applies a DWC update payload in place (compress::ApplyUpdate) under the writer lock.
  // The payload must apply to version(); on any error the weights are untouched.
  absl::Status ApplyUpdate(absl::string_view payload);

  // The trainable set serialized (safetensors bytes) and loaded back, for the last good
  // state on disk and for cloud snapshots.
  absl::StatusOr<std::string> SaveTrainableState() const;
  absl::Status LoadTrainableState(absl::string_view bytes, uint64_t version);

  // The jpeg uplink (compress::FeaturePrecision::kJpeg): the frame `visual` came from,
  // resized and cropped to the vision tower's input, as JPEG at `quality` (1-100).
  // FAILED_PRECONDITION where CanSendFrames() is false. Thread-safe.
  absl::StatusOr<std::string> FrameJpeg(const VisualTokens& visual, int quality = 90);
  // Whether FrameJpeg works: the folder's image processor has a fixed output size (the cloud
  // recomputes the tokens with the tower the pair shares).
  bool CanSendFrames() const;

  uint64_t version() const;
  uint64_t StateDigest() const;        // compress::StateDigest of the trainable set
  uint64_t BaseFingerprint() const;    // of the frozen base, for Register
  uint64_t VisionFingerprint() const;  // of the vision encoder, for Register
  int64_t TrainableParameters() const;
  int64_t BaseBytes() const;  // stored size of the frozen linear weights

  struct Impl;

 private:
  explicit InferenceRuntime(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// `answer`, answered by model version `version`, as SampleStep reads it. A view: `answer`
// must outlive the result.
AnsweredFrame AnsweredFrameOf(const AnswerResult& answer, uint64_t version);

// The runtime behind `answer` for SampleStep: its stage-2 scores are TokenScores and its
// frame FrameJpeg of the answer's visual tokens. `runtime` and `answer` must outlive the
// result.
FrameModel FrameModelOf(InferenceRuntime* runtime, const AnswerResult& answer);

}  // namespace cdcca::device

#endif  // CDCCA_DEVICE_INFERENCE_RUNTIME_H_
