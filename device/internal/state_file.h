// The device's last good trainable state, `<state_dir>/trainable.state` (torch-free, so its
// decoder is fuzzed: device/fuzz/), in the stores' sealed envelope (storage/sealed_file.h,
// kind "DVTS", format 1) around, little-endian:
//   u64 model version | u64 state digest | safetensors of the trainable set.
// Files written before the envelope (the same fields, then a u64 Hash64 of them) are read
// too.
// The safetensors bytes are returned as a view; InferenceRuntime::LoadTrainableState checks
// them (DecodeSafetensors) against the model.
#ifndef CDCCA_DEVICE_INTERNAL_STATE_FILE_H_
#define CDCCA_DEVICE_INTERNAL_STATE_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::device::internal {

struct TrainableStateFile {
  uint64_t version = 0;
  uint64_t digest = 0;
  absl::string_view safetensors;  // a view into the decoded bytes
};

std::string EncodeTrainableStateFile(uint64_t version, uint64_t digest,
                                     absl::string_view safetensors);

// DATA_LOSS for a file shorter than its fixed fields, with a bad checksum, or sealed as
// something else. Allocates
// nothing; the result points into `bytes`.
absl::StatusOr<TrainableStateFile> DecodeTrainableStateFile(absl::string_view bytes);

}  // namespace cdcca::device::internal

#endif  // CDCCA_DEVICE_INTERNAL_STATE_FILE_H_
