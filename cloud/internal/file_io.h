// Small POSIX file helpers for the cloud's stores: durable writes and whole-file reads.
// All functions are thread-compatible (callers serialise access to the same path).
#ifndef CDCCA_CLOUD_INTERNAL_FILE_IO_H_
#define CDCCA_CLOUD_INTERNAL_FILE_IO_H_

#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cdcca::cloud::internal {

// Writes `contents` to `path` so that a crash leaves either the old file or the new one:
// write to a temp file in the same directory, fsync it, rename over `path`, fsync the dir.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

// Reads the whole file. NOT_FOUND if it does not exist.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Creates `dir` and its parents if missing.
absl::Status MakeDirs(const std::string& dir);

// fsyncs a directory so that entries created or renamed in it are durable.
absl::Status SyncDir(const std::string& dir);

// Names of the regular files in `dir` (not sorted). NOT_FOUND if `dir` does not exist.
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir);

// A Status for a failed system call, naming the operation and path, with errno's text.
absl::Status ErrnoStatus(absl::string_view op, const std::string& path, int err);

}  // namespace cdcca::cloud::internal

#endif  // CDCCA_CLOUD_INTERNAL_FILE_IO_H_
