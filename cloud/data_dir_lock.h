// One cdcca-cloud process per data directory.
//
// The embedded stores (sample log, registry, updates, mirrors) assume they are the only writer
// of their files: two processes appending to one segment would interleave records. A process
// takes DataDirLock before it opens any store and holds it for its lifetime; a second process
// on the same directory gets FAILED_PRECONDITION naming the holder's pid.
//
// The lock is an exclusive flock(2) on DIR/LOCK, so the kernel releases it when the holder
// exits for any reason (kill -9 included): a stale LOCK file never blocks a restart. flock
// is per open file description and advisory; it is not meant to cross network file systems.
#ifndef CDCCA_CLOUD_DATA_DIR_LOCK_H_
#define CDCCA_CLOUD_DATA_DIR_LOCK_H_

#include <string>

#include "absl/status/statusor.h"

namespace cdcca::cloud {

class DataDirLock {
 public:
  // Creates `dir` (and its parents) if missing, then locks DIR/LOCK and writes this process's
  // pid into it. FAILED_PRECONDITION when another process holds it (the message names the
  // directory and the holder's pid), INTERNAL on any other I/O error.
  static absl::StatusOr<DataDirLock> Acquire(const std::string& dir);

  DataDirLock(DataDirLock&& other) noexcept;
  DataDirLock& operator=(DataDirLock&& other) noexcept;
  DataDirLock(const DataDirLock&) = delete;
  DataDirLock& operator=(const DataDirLock&) = delete;
  // Releases the lock (closes the file; LOCK itself stays).
  ~DataDirLock();

 private:
  explicit DataDirLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_DATA_DIR_LOCK_H_
