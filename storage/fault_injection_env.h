// FaultInjectionEnv: an in-memory Env for tests that fails one chosen call, as SQLite's
// test VFS does, or loses power there and lets the stores "restart" on what survived.
//
// A test walks a fault over every step of an operation:
//   for (uint64_t n = 1;; ++n) {
//     FaultInjectionEnv env;  (or one with the state before the operation)
//     env.Arm(Fault::kPowerLoss, n);
//     ... run the operation on stores opened with &env ...
//     if (!env.fault_hit()) break;  // it completed with no fault: every step was tried
//     ... destroy the stores; env.Restart(); reopen them and check what they promise ...
//   }
//
// Which calls a fault counts (the n-th of them is hit):
//   kEio         every call (opens, appends, syncs, reads, renames, removes, truncates,
//                directory syncs and creations, listings): it fails with EIO (INTERNAL)
//                and changes nothing, except that a failed Sync drops the file's unsynced
//                bytes (the page cache lost them: storage/env.h).
//   kEnospc      calls that may allocate: OpenForAppend, Append, Sync, Rename, SyncDir,
//                CreateDirs; they fail with ENOSPC (RESOURCE_EXHAUSTED), as kEio otherwise.
//   kShortWrite  Append: the first half of the bytes reach the file, then ENOSPC.
//   kPowerLoss   calls that change the file system (OpenForAppend, Append, Sync, Rename,
//   kCrash       Remove, Truncate, SyncDir, CreateDirs): the process dies just before the
//                call, so it and every later call fail (ABORTED) until Restart(). After a
//                power loss Restart() keeps only what was synced: file bytes up to their
//                last Sync, directory entries as of their directory's last SyncDir
//                (creations, renames and removals after it are undone). After a crash
//                (kill -9) everything written survives.
// The one-shot faults (kEio, kEnospc, kShortWrite) hit once; later calls succeed.
//
// Directories exist once made and survive everything (CreateDirs is durable). File objects
// opened before a Restart() fail afterwards (FAILED_PRECONDITION).
//
// Thread-safe.
#ifndef CDCCA_STORAGE_FAULT_INJECTION_ENV_H_
#define CDCCA_STORAGE_FAULT_INJECTION_ENV_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "storage/env.h"

namespace cdcca::storage {

enum class Fault { kEio, kEnospc, kShortWrite, kPowerLoss, kCrash };

// "eio", "enospc", "short_write", "power_loss", "crash" (test names).
const char* FaultName(Fault fault);

class FaultInjectionEnv final : public Env {
 public:
  FaultInjectionEnv();
  ~FaultInjectionEnv() override;

  // The n-th call from now (1-based) that `fault` counts gets it. Replaces an armed fault.
  void Arm(Fault fault, uint64_t n);
  // No fault from now on (a dead process stays dead until Restart).
  void Disarm();
  // Whether the armed fault has hit.
  bool fault_hit() const;
  // The power goes out now: every call fails until Restart(), which keeps only what was
  // synced.
  void CutPower();
  // Starts a new "process" on the files as a restarted machine finds them (see above) and
  // disarms.
  void Restart();

  // Env.
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
  friend class FaultWritableFile;
  friend class FaultRandomAccessFile;
  struct Node {
    std::string data;    // what reads see
    std::string synced;  // what survives a power loss
  };
  struct OpenFile;
  enum class Op {
    kOpenAppend,
    kOpenRead,
    kAppend,
    kSync,
    kRead,
    kRename,
    kRemove,
    kTruncate,
    kSyncDir,
    kCreateDirs,
    kList
  };

  // OK, or the error the call gets. Sets *short_write when an Append must write half.
  absl::Status Enter(Op op, const std::string& path, uint64_t generation, bool* short_write)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool DirExists(const std::string& dir) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  Fault fault_ ABSL_GUARDED_BY(mu_) = Fault::kEio;
  uint64_t countdown_ ABSL_GUARDED_BY(mu_) = 0;
  bool hit_ ABSL_GUARDED_BY(mu_) = false;
  bool dead_ ABSL_GUARDED_BY(mu_) = false;
  bool power_lost_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::string> dirs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<Node>> files_ ABSL_GUARDED_BY(mu_);    // live
  std::map<std::string, std::shared_ptr<Node>> durable_ ABSL_GUARDED_BY(mu_);  // on disk
};

}  // namespace cdcca::storage

#endif  // CDCCA_STORAGE_FAULT_INJECTION_ENV_H_
