// One whole round of the collaborative loop on a Hugging Face teacher-student pair, in one
// process: what cdcca-device and cdcca-cloud do over gRPC, step by step, with the same
// library calls and nothing in between but the bytes each side would send.
//
//   device: answers each frame from the vision tower's tokens (greedy, int4/int8 student),
//           then the device's step of a round (device::SampleStep, as the agent): UTS
//           stage 1 (mean answer-token entropy against a running quantile), stage 2 on the
//           kept frames (MC-dropout variance of the visual tokens, M passes as one batch),
//           the top token_ratio kept; encodes the uplink batch;
//   cloud:  decodes it, then the cloud's step of a round (cloud::TrainRound, as a job of
//           cdcca-cloud): the AKD job from the device's mirror (PairDistiller::RunFrom),
//           the DWC update encoded against the mirror and applied there;
//   device: applies the same bytes to its trainable state (the same ApplyUpdate), puts the
//           state into its model, and the two digests are compared; then answers the kept
//           frames again, so the round's effect shows in the device's answers.
//
// Frames are random pixels at the tower's input size (the image processor's output; seeded),
// prompts are given as the student's ids, and both sides read them through IdsAsTextSide:
// the pair must share one vocabulary (LLaVA-1.5-13B / -7B do). InstructBLIP, whose Q-Former
// reads the prompt in its own tokenizer, is refused.
//
// Three models are loaded on `device`: the teacher, the cloud's student mirror and the
// device's student (the device's state is kept in fp32 on the CPU, as the device runtime
// keeps it, and copied into its model after each apply: a CUDA student computes in bf16).
// Not thread-safe; one round per call.
#ifndef CDCCA_SIM_HUB_ROUND_H_
#define CDCCA_SIM_HUB_ROUND_H_

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "compress/delta_encoder.h"
#include "device/uts.h"
#include "distill/akd.h"
#include "model/arch/multimodal_model.h"

namespace cdcca::sim {

struct InProcessRoundOptions {
  std::string teacher_dir;
  std::string student_dir;  // the devices' base
  std::string teacher_precision = "bf16";
  std::string student_precision = "int4";  // the device's, mirrored exactly by the cloud
  torch::Device device = torch::kCPU;      // where the three models run
  int frames = 32;                         // frames the device answers
  // [S, P] int64: the student's ids of each prompt, the image placeholder unexpanded (BOS
  // included where the model wants it); frame i asks prompt i % S.
  torch::Tensor prompt_ids;
  uint64_t seed = 1;           // the frames' pixels, the MC-dropout masks and the random tokens
  int max_answer_tokens = 16;  // the device's answers (the job's bound is settings.job's)
  device::UtsOptions uts;
  distill::DistillSettings settings;
  model::AdapterOptions adapters;
  compress::DeltaEncoderOptions dwc;
  // Progress lines ("device: frame 3/32 ..."); null = silent.
  std::function<void(const std::string&)> log;
};

struct InProcessRoundReport {
  int64_t visual_tokens = 0;  // N per frame
  int64_t feature_dim = 0;    // D
  int frames = 0;
  int kept_samples = 0;       // frames stage 1 kept
  int64_t kept_tokens = 0;    // tokens stage 2 kept, over the kept frames
  double load_seconds = 0;    // the three models
  double answer_seconds = 0;  // the device's answers, all frames (tower + greedy)
  double stage2_seconds = 0;  // MC-dropout passes and selection, kept frames
  double mean_entropy = 0;    // over all frames, nats
  uint64_t uplink_bytes = 0;  // the encoded uplink batch
  double uplink_encode_seconds = 0;
  double uplink_decode_seconds = 0;
  distill::JobStats job;
  bool kl_used = false;
  std::vector<std::string> notes;
  compress::EncodeStats dwc;  // the update's size and error
  double dwc_encode_seconds = 0;
  double mirror_apply_seconds = 0;
  double device_apply_seconds = 0;  // ApplyUpdate and the copy into the device's model
  uint64_t device_digest_before = 0, mirror_digest_before = 0;
  uint64_t device_digest_after = 0, mirror_digest_after = 0;
  // Kept frames: the share of the teacher's pseudo-label tokens an answer repeats position by
  // position, averaged. The device's answer from the whole frame before and after the update
  // (and how many of those answers changed); the device's answer from the tokens it uplinked
  // (the job's input) before and after; the cloud's trained student (the job's result, before
  // DWC) on those tokens, what a lossless update would give.
  double agreement_before = 0;
  double agreement_after = 0;
  int answers_changed = 0;
  double agreement_kept_before = 0;
  double agreement_kept_after = 0;
  double agreement_kept_trained = 0;
  double reanswer_seconds = 0;  // the three answers per kept frame behind the agreements
  // Per kept frame: the device's answer (token ids up to the first EOS) from the whole frame
  // before and after the update, and the teacher's pseudo-label it is scored against.
  struct FrameAnswers {
    int frame = 0;
    std::vector<int64_t> before, after, teacher;
  };
  std::vector<FrameAnswers> answers;
  int64_t trainable_parameters = 0;
};

// Runs the round. InvalidArgument for options or folders that do not fit (no prompts, frames
// < 1, a Q-Former prompt, a pair with different towers); FailedPrecondition when stage 1
// keeps no frame; errors of the steps otherwise, naming the step. A report is returned only
// when every step ran; its digests say whether the two states agree (the device's are read
// off the live model that answers, the mirror's off the cloud's stored state).
absl::StatusOr<InProcessRoundReport> RunHubRound(const InProcessRoundOptions& options);

}  // namespace cdcca::sim

#endif  // CDCCA_SIM_HUB_ROUND_H_
