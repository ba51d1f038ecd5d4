// Durable whole-file writes for the device's state directory (uplink queue entries, the last
// good trainable state): a crash leaves either the old file or the new one, never a torn one.
// Thread-compatible: callers serialise writers of the same path.
#ifndef CDCCA_DEVICE_INTERNAL_DURABLE_FILE_H_
#define CDCCA_DEVICE_INTERNAL_DURABLE_FILE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::device::internal {

// Writes `contents` to "<path>.tmp", fsyncs it, renames it over `path` and fsyncs the
// directory.
absl::Status WriteDurably(const std::string& path, absl::string_view contents);
// The whole file; NOT_FOUND if it does not exist.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);
// Creates `dir` and its parents if missing.
absl::Status EnsureDir(const std::string& dir);
// Regular files in `dir`, unsorted.
absl::StatusOr<std::vector<std::string>> FilesIn(const std::string& dir);
// Removes `path` and fsyncs its directory; OK if it did not exist.
absl::Status RemoveDurably(const std::string& path);

}  // namespace cdcca::device::internal

#endif  // CDCCA_DEVICE_INTERNAL_DURABLE_FILE_H_
