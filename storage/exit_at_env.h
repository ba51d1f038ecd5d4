// ExitAtEnv: an Env (the real file system, as a rule) with one planned crash, for the tests
// that kill the real programs at a chosen step: the process ends with _exit(86), as kill -9
// would leave it, just before the n-th call that changes a file whose path holds a pattern
// (OpenForAppend, Rename (either path), Remove, Truncate). A test picks the step by the file
// it writes: the cloud's mirror state ("<id>.mirror": after a job's training, before its
// commit), its update store ("update-0": after the commit, before the update is published),
// the device's state ("trainable.state": after an update is downloaded and applied in
// memory, before it is saved).
//
// The programs run on ProgramEnv(): Env::Default(), or, when the environment variable
// CDCCA_TEST_EXIT_AT is set ("PATTERN" or "PATTERN@N"), an ExitAtEnv over it. Nothing else
// in the programs knows about test faults.
#ifndef CDCCA_STORAGE_EXIT_AT_ENV_H_
#define CDCCA_STORAGE_EXIT_AT_ENV_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/env.h"

namespace cdcca::storage {

// The exit status of a planned crash.
inline constexpr int kPlannedCrashExitCode = 86;

class ExitAtEnv final : public Env {
 public:
  // Ends the process before the n-th (1-based) changing call on a path holding `pattern`.
  ExitAtEnv(Env* base, std::string pattern, uint64_t n);
  // "PATTERN" (n = 1) or "PATTERN@N"; INVALID_ARGUMENT for an empty pattern or a bad N.
  static absl::StatusOr<std::unique_ptr<ExitAtEnv>> Parse(Env* base, const std::string& spec);

  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForAppend(const std::string& path,
                                                              bool truncate) override;
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override;
  absl::Status Rename(const std::string& from, const std::string& to) override;
  absl::Status Remove(const std::string& path) override;
  absl::Status Truncate(const std::string& path, uint64_t size) override;
  absl::Status SyncDir(const std::string& dir) override;
  absl::Status CreateDirs(const std::string& dir) override;
  absl::StatusOr<std::vector<std::string>> ListFiles(const std::string& dir) override;
  absl::StatusOr<std::vector<std::string>> ListDirs(const std::string& dir) override;

 private:
  // Counts a changing call on `path` (and `other`, for a rename); ends the process on the
  // planned one.
  void Changing(const char* call, const std::string& path, const std::string& other = "");

  Env* const base_;
  const std::string pattern_;
  const uint64_t n_;
  std::atomic<uint64_t> seen_{0};
};

// The Env a program's stores run on (see the file comment). Never deleted. A bad
// CDCCA_TEST_EXIT_AT ends the process with a message (status 2): it is a test's mistake.
Env* ProgramEnv();

}  // namespace cdcca::storage

#endif  // CDCCA_STORAGE_EXIT_AT_ENV_H_
