// The one file layer of cdcca's durable stores (the cloud's sample log, registry, update
// store and mirror files; the device's uplink queue and last good state), after LevelDB's
// Env: every open, append, sync, rename, remove, list and read of a store goes through an
// Env that the store's Options name. Programs use Env::Default() (POSIX); tests pass a
// FaultInjectionEnv (storage/fault_injection_env.h) that fails the Nth call with EIO, ENOSPC
// or a short write, or loses power there, and restarts the stores on what survived.
//
// What a store may rely on (the POSIX implementation keeps it; the fault env models it):
//   - bytes appended to a file survive a power loss only once WritableFile::Sync returned
//     OK after them (fdatasync);
//   - a created, renamed or removed directory entry survives a power loss only once
//     SyncDir of its directory returned OK after it; a rename replaces its target
//     atomically (a reader sees the old file or the new one);
//   - directories made by CreateDirs are durable when it returns;
//   - after a failed Sync the file's unsynced bytes are in an unknown state: a later Sync
//     that succeeds does not make them durable (Linux may drop dirty pages on a writeback
//     error), so a store must not count on them.
// Errors are absl::Status with the errno mapped: ENOENT NOT_FOUND, ENOSPC and EDQUOT
// RESOURCE_EXHAUSTED, EACCES and EPERM PERMISSION_DENIED, anything else INTERNAL.
//
// Thread-safety: an Env is thread-safe; a file object is thread-compatible (one user at a
// time).
#ifndef CDCCA_STORAGE_ENV_H_
#define CDCCA_STORAGE_ENV_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::storage {

// A file open for appending. Closed on destruction (a close error is not reported: only
// Sync makes bytes durable).
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Appends all of `data`, or fails; after a failure an unknown prefix of `data` may be in
  // the file (a short write).
  virtual absl::Status Append(absl::string_view data) = 0;
  // fdatasync: on OK every byte appended before it survives a power loss.
  virtual absl::Status Sync() = 0;
  // Bytes in the file, those appended through this object included.
  virtual uint64_t Size() const = 0;
};

// A file open for reading at offsets (pread).
class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  // Reads exactly `n` bytes at `offset` into `out`; DATA_LOSS if the file ends first.
  virtual absl::Status Read(uint64_t offset, size_t n, char* out) const = 0;
  virtual absl::StatusOr<uint64_t> Size() const = 0;
};

class Env {
 public:
  virtual ~Env() = default;

  // The POSIX file system. Never deleted.
  static Env* Default();

  // Opens `path` for appending, creating it if missing; `truncate` empties it first.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> OpenForAppend(const std::string& path,
                                                                      bool truncate) = 0;
  // NOT_FOUND if `path` does not exist.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(
      const std::string& path) = 0;
  // Renames `from` over `to` (atomically replacing it). Durable after SyncDir.
  virtual absl::Status Rename(const std::string& from, const std::string& to) = 0;
  // NOT_FOUND if `path` does not exist. Durable after SyncDir.
  virtual absl::Status Remove(const std::string& path) = 0;
  // Cuts `path` to `size` bytes. Durable after a Sync of the file.
  virtual absl::Status Truncate(const std::string& path, uint64_t size) = 0;
  // Makes the entries created, renamed or removed in `dir` durable (fsync of the directory).
  virtual absl::Status SyncDir(const std::string& dir) = 0;
  // Creates `dir` and its missing parents, durably. OK if it exists.
  virtual absl::Status CreateDirs(const std::string& dir) = 0;
  // Names of the regular files (ListFiles) or of the sub-directories (ListDirs) of `dir`,
  // unsorted. NOT_FOUND if `dir` does not exist.
  virtual absl::StatusOr<std::vector<std::string>> ListFiles(const std::string& dir) = 0;
  virtual absl::StatusOr<std::vector<std::string>> ListDirs(const std::string& dir) = 0;
};

// The whole file. NOT_FOUND if it does not exist; INVALID_ARGUMENT for a pipe or device.
absl::StatusOr<std::string> ReadFile(Env& env, const std::string& path);

// Writes `contents` to `path` so that a crash or power loss leaves either the old file or
// the new one, and on OK the new one durably: "<path>.tmp" is written, synced and renamed
// over `path`, then the directory is synced. On an error the temp file is removed if it
// can be. Callers serialise writers of one path.
absl::Status WriteFileAtomically(Env& env, const std::string& path, absl::string_view contents);

// Removes `path` and syncs its directory. OK if it did not exist.
absl::Status RemoveDurably(Env& env, const std::string& path);

// The directory part of `path` ("." for a bare name).
std::string DirName(const std::string& path);

// The Status of a failed call `op` on `path` with errno `err`, mapped as above.
absl::Status ErrnoStatus(absl::string_view op, const std::string& path, int err);

}  // namespace cdcca::storage

#endif  // CDCCA_STORAGE_ENV_H_
