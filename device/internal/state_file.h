// The device's last good trainable state, `<state_dir>/trainable.state` (torch-free, so its
// decoder is fuzzed: device/fuzz/). Layout, little-endian:
//   u64 model version | u64 state digest | safetensors of the trainable set |
//   u64 Hash64 of everything before it.
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

// DATA_LOSS for a file shorter than its fixed fields or with a bad checksum. Allocates
// nothing; the result points into `bytes`.
absl::StatusOr<TrainableStateFile> DecodeTrainableStateFile(absl::string_view bytes);

}  // namespace cdcca::device::internal

#endif  // CDCCA_DEVICE_INTERNAL_STATE_FILE_H_
