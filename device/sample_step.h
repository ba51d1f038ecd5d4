// SampleStep: the device's half of a round for one answer, from the answer to the sample it
// uplinks (docs/ARCHITECTURE.md, "One round, function by function"). Every driver that answers
// on a device, or stands in for one, calls it: the agent loop (DeviceAgent::Process, which the
// harness runs), cdcca-device offline, the in-process round (sim/inprocess_round.h), `cdcca
// adapt` and `cdcca adapt-eval`'s arms (sim/adapt_eval.h BuildArmUplink).
//
//   Run(answer)  held out for the cloud's update guard? (compress::IsHeldOutSample of the
//                sample id: the whole frame goes up, every token, stage 2 skipped)
//             -> UTS stage 1 (EntropyGate on the answer's mean token entropy)
//             -> UTS stage 2 for a chosen sample: a score per visual token from the model
//                (FrameModel::scores), the top token_ratio kept (SelectTokens), or every token
//                over variance_beta, or token_ratio of them at random (RandomTokenSelection);
//                at a token_ratio of 1 every token, unscored
//             -> the compress::UplinkSample: the kept tokens' features from the answer (or,
//                at jpeg, the frame and the kept indices), the question's and the answer's
//                ids, checked to encode (compress::CheckUplinkSample), never truncated.
//
// What the answer computed is read, not recomputed: the tokens, ids and entropy come in an
// AnsweredFrame. The model is reached only through the FrameModel callables the driver binds
// (InferenceRuntime on a device; an offline driver may bind scores it computed before), so
// this file is torch- and gRPC-free and part of the core build (target cdcca_uts). A driver
// that keeps every answer, or decides stage 1 over a finished stream (KeepTopEntropies), runs
// the step with KeepEverySample's UtsOptions.
//
// Errors are values: a sample whose scores or frame the model cannot produce, or which breaks
// the codec's limits, comes back with a non-OK SampleDecision::status; the answer stands and
// the driver counts it as not uplinked. Where samples go (batches, the queue) is the driver's.
//
// Thread-safety: thread-compatible. One SampleStep per device stream (it holds the gate's
// window, the answer count and the random-token generator); callers serialise Run.
#ifndef CDCCA_DEVICE_SAMPLE_STEP_H_
#define CDCCA_DEVICE_SAMPLE_STEP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compress/uplink_codec.h"
#include "device/uts.h"

namespace cdcca::device {

// The jpeg uplink's quality: what a user would otherwise send (the codec comparison in
// docs/BENCHMARKS.md is against the same frame at this quality).
inline constexpr int kFrameJpegQuality = 90;

// One answer, as UTS and the uplink read it. Views: the caller keeps what they point at alive
// for the call.
struct AnsweredFrame {
  float entropy = 0;  // mean answer-token entropy, nats (Eq. 2)
  // The vision tower's grid the answer read: tokens x dim floats, row-major.
  int tokens = 0;
  int dim = 0;
  absl::Span<const float> features;
  absl::Span<const uint32_t> question_ids;  // the question as the model saw it
  absl::Span<const uint32_t> answer_ids;    // generated tokens up to (not including) EOS
  uint64_t model_version = 0;               // the version that answered
};

// The model behind one answered frame, bound by the driver.
struct FrameModel {
  // UTS stage 2: one score per visual token from `passes` stochastic passes at dropout rate
  // `dropout_p`, scored as `score`. `seed` fixes the draw; nullopt = the model's own draw
  // counter. Unset = the model cannot score (a chosen sample that needs scores then fails).
  std::function<absl::StatusOr<std::vector<float>>(int passes, float dropout_p, TokenScore score,
                                                   std::optional<uint64_t> seed)>
      scores;
  // The jpeg uplink: the frame at the vision tower's input size as JPEG at `quality` (1-100).
  // Unset = this model cannot send frames.
  std::function<absl::StatusOr<std::string>(int quality)> jpeg;
};

struct SampleStepOptions {
  // UTS as used: stage 1's gate, stage 2's passes, ratio or beta, the uplink precision.
  // Taken as given (KeepEverySample's entropy_alpha below 0 keeps every sample); the model
  // refuses passes or a dropout rate it cannot compute, per sample.
  UtsOptions uts;
  // compress::IsHeldOutSample's key: the device's id. Default: "".
  std::string device_id;
  // The share of answers held out whole for the cloud's update guard (its Register reply's
  // guard_holdout_fraction), in [0, 1). Default: 0 (none).
  double holdout_fraction = 0;
  // Non-zero: stage 2's draw for the n-th answer is seeded with Hash64(score_seed, n), so a
  // sample's scores do not depend on other users of the model (the harness's devices share a
  // process). Default: 0 = the model's own draw counter.
  uint64_t score_seed = 0;
  // Seed of the one generator the random-token baseline (uts.random_tokens) draws from, in
  // the order samples are chosen. Default: 0x5eed.
  uint64_t token_seed = 0x5eed;
  // JPEG quality of the jpeg uplink (1-100). Default: kFrameJpegQuality.
  int jpeg_quality = kFrameJpegQuality;
  // Each sample is checked against these, never truncated to them. Default: the codec's.
  compress::UplinkLimits limits;
};

// What Run decided for one answer.
struct SampleDecision {
  uint64_t ordinal = 0;       // the answer's count in this stream, from 0
  bool held_out = false;      // uplinked whole for the update guard
  bool stage1_kept = false;   // passed UTS stage 1
  bool random_kept = false;   // passed over by stage 1, kept as UtsOptions::random_share's
  float threshold = 0;        // what stage 1 compared the entropy with
  double stage2_seconds = 0;  // wall time of the model's token scores (0: not run)
  // OK unless the sample was chosen (held out or kept) and cannot be uplinked: the model
  // could not score it or encode its frame, or it breaks the codec's limits.
  absl::Status status;
  // The uplink sample, when chosen() and status is OK: CheckUplinkSample-clean at
  // uts.precision unless kept_indices is empty (variance_beta mode kept no token).
  compress::UplinkSample sample;

  bool chosen() const { return held_out || stage1_kept || random_kept; }
  // Whether the driver should uplink `sample`: chosen, OK, and at least one token kept.
  bool uplinked() const { return chosen() && status.ok() && !sample.kept_indices.empty(); }
};

class SampleStep {
 public:
  explicit SampleStep(SampleStepOptions options);

  // New UTS settings or a new held-out share (a Register reply): stage 1 starts over with a
  // fresh window; the answer count and the random-token generator go on.
  void Reconfigure(const UtsOptions& uts, double holdout_fraction);

  // The ordinal the next Run gives its answer (drivers build sample ids from it).
  uint64_t next_ordinal() const { return next_ordinal_; }

  // The device half of a round for one answer, uplinked (if chosen) as `sample_id`. Every
  // answer's entropy enters stage 1's window, held-out ones too. An answer of another model
  // version than the previous one starts stage 1 over: the running quantile compares one
  // model's entropies (an improved model would otherwise pass nothing until the window
  // refilled).
  SampleDecision Run(const AnsweredFrame& frame, const FrameModel& model, uint64_t sample_id);

  const SampleStepOptions& options() const { return options_; }

 private:
  SampleStepOptions options_;  // uts and holdout_fraction change with Reconfigure
  std::unique_ptr<EntropyGate> gate_;
  uint64_t gate_version_ = 0;  // model version the gate's window holds
  uint64_t next_ordinal_ = 0;
  std::mt19937_64 token_rng_;
};

// The uplink sample of `frame` keeping `kept` (ascending token indices): their features, or
// at jpeg (`precision`) the frame `jpeg` instead; the question's and the answer's ids, the
// entropy, the grid and the version. Checked with CheckUplinkSample(precision, limits) when
// `kept` is non-empty: INVALID_ARGUMENT naming the field that breaks a bound.
absl::StatusOr<compress::UplinkSample> MakeUplinkSample(const AnsweredFrame& frame,
                                                        std::vector<uint16_t> kept,
                                                        compress::FeaturePrecision precision,
                                                        std::string jpeg, uint64_t sample_id,
                                                        const compress::UplinkLimits& limits = {});

}  // namespace cdcca::device

#endif  // CDCCA_DEVICE_SAMPLE_STEP_H_
