// A device's quarantine file, <state_dir>/<device_id>.quarantine: the samples the trainer
// could not use (a batch that reads back damaged or does not decode, a frame that does not
// decode, the batches of a job that failed kMaxJobAttempts times or trained to a non-finite
// value), with their reasons. JSON: the totals and the newest kRecent entries. Written by
// PerDeviceStrategy (cloud/trainer.cc) before the cursor moves past the samples, so a
// restart does not retry them. Plain values; not thread-safe.
#ifndef CDCCA_CLOUD_INTERNAL_QUARANTINE_LOG_H_
#define CDCCA_CLOUD_INTERNAL_QUARANTINE_LOG_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace cdcca::cloud::internal {

// One unusable sample (or a whole batch: sample_id unknown) and why.
struct QuarantineEntry {
  uint64_t sequence = 0;
  bool whole_batch = true;
  uint64_t sample_id = 0;  // when !whole_batch
  uint64_t samples = 0;
  std::string reason;
};

struct QuarantineLog {
  static constexpr size_t kRecent = 64;
  uint64_t samples = 0;
  // The highest batch sequence an entry names: a job that meets entries at or below it again
  // is a retry after a crash between this file and the cursor's commit; they are not counted
  // twice.
  uint64_t through_sequence = 0;
  std::vector<QuarantineEntry> recent;  // oldest first

  // The file's bytes.
  std::string Encode() const;
  // The file read back; DATA_LOSS naming `path` if it is not one.
  static absl::StatusOr<QuarantineLog> Decode(const std::string& bytes, const std::string& path);
  // Adds the entries not already counted; returns whether anything changed.
  bool Add(const std::vector<QuarantineEntry>& entries);
};

}  // namespace cdcca::cloud::internal

#endif  // CDCCA_CLOUD_INTERNAL_QUARANTINE_LOG_H_
