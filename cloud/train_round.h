// The round's cloud step (docs/ARCHITECTURE.md, "One round"): a device's samples, trained on
// from its mirror, become the update the device applies next and the state it then holds.
//
//   TrainRound      the learner trains the mirror on the samples; its result, checked
//                   finite, is encoded as the next version (EncodeVersion). What
//                   PerDeviceStrategy::RunJob (cloud/trainer.h) runs per job before the
//                   update guard and the commit, and what the in-process round
//                   (sim/inprocess_round.h) and `cdcca adapt` run without either.
//   EncodeVersion   DWC: the trained set against the mirror as the next version's update
//                   bytes (error feedback through the encoder's residual; a byte budget below
//                   the smallest payload raised to the smallest that fits), applied to a copy
//                   of the mirror exactly as the device applies them, digested, snapshotted.
//   RestoreVersion  the next version being an earlier state exactly (a rollback, a restore
//                   to the pretrained base): an uncapped encoding towards it, residual empty.
//
// Plain functions of their arguments: no I/O, no locks, nothing kept; thread-safe for
// distinct arguments. LibTorch errors come back as Status. Builds with LibTorch and zstd
// alone (the GPU machine's core build runs the in-process round).
#ifndef CDCCA_CLOUD_TRAIN_ROUND_H_
#define CDCCA_CLOUD_TRAIN_ROUND_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "compress/delta_encoder.h"
#include "compress/named_tensors.h"
#include "distill/job.h"

namespace cdcca::cloud {

// What a learner made of a job's samples.
struct TrainedSet {
  compress::NamedTensors trainable;  // the trained set, fp32 CPU, the mirror's order
  distill::JobStats stats;
  std::vector<std::string> notes;  // what the job log says beyond the numbers
  // Samples (indices into the job's samples) the learner could not use, and why; it trained
  // without them. When it holds every sample, nothing was trained (`trainable` is empty).
  std::vector<std::pair<size_t, absl::Status>> rejected;
};

// The next version of a device's state, ready to commit and publish.
struct NewVersion {
  uint64_t base_version = 0;
  uint64_t version = 0;          // base_version + 1
  compress::NamedTensors state;  // what a device at base_version holds after the update
  uint64_t digest = 0;           // compress::StateDigest(state)
  std::string snapshot;          // `state` as safetensors (metadata "version")
  compress::UpdatePayload update;
  std::string residual;  // the encoder's state after this update (DeltaEncoder::SerializeState)
  // Non-zero when the configured budget could not hold even the smallest payload and the
  // update used this byte budget instead.
  uint64_t budget_raised_to = 0;
  double encode_seconds = 0;  // DWC
  double apply_seconds = 0;   // the update applied to the mirror's copy, digest, snapshot
};

// Encodes `trained` against `mirror` (the device's state at `version`) with a copy of
// `encoder` (its residual is the device's); `mirror` and `encoder` are not changed. Errors:
// the encoder's and ApplyUpdate's (INVALID_ARGUMENT for sets that do not match).
absl::StatusOr<NewVersion> EncodeVersion(const compress::NamedTensors& trained,
                                         const compress::NamedTensors& mirror, uint64_t version,
                                         const compress::DeltaEncoder& encoder);

// The next version after `version` whose state is `target` exactly: the update is DWC towards
// it without a byte cap (a one-off; it cannot land exactly on the target, so a device that
// applies it finds its digest differs and loads the snapshot, which is the target), and the
// residual restarts empty (`options` are the device's encoder's).
absl::StatusOr<NewVersion> RestoreVersion(compress::NamedTensors target,
                                          const compress::NamedTensors& mirror, uint64_t version,
                                          const compress::DeltaEncoderOptions& options);

enum class RoundOutcome {
  kTrained,        // `next` is the new version
  kNothingUsable,  // the learner could use none of the samples (all in job.rejected)
  kNonFinite,      // training took a tensor to a non-finite value (`why` names it)
  kFailed,         // the learner failed (`why`); a retry may succeed
};

struct TrainedRound {
  RoundOutcome outcome = RoundOutcome::kFailed;
  absl::Status why;  // kNonFinite, kFailed
  TrainedSet job;    // the learner's result (its trainable set is the job's, before DWC)
  NewVersion next;   // kTrained only
};

// Trains the mirror with `learn` (which reads the mirror and the job's samples itself) and
// encodes the result as version `version` + 1 (EncodeVersion). The learner's failures,
// exceptions included, are outcomes, not errors; errors are EncodeVersion's.
absl::StatusOr<TrainedRound> TrainRound(absl::FunctionRef<absl::StatusOr<TrainedSet>()> learn,
                                        const compress::NamedTensors& mirror, uint64_t version,
                                        const compress::DeltaEncoder& encoder);

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_TRAIN_ROUND_H_
