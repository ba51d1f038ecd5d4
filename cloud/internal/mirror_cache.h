// PerDeviceStrategy's devices in memory (cloud/trainer.cc): one DeviceMirror per device ever
// seen, whose state (mirror, encoder residual, replay buffer, held-out pool, quarantine log)
// is loaded on demand and kept for at most `max_resident` idle devices; the least recently
// used leave first. What a state is and how it loads is the strategy's; this file keeps the
// devices, the order of use and the count of evictions.
//
// Thread-safety: MirrorCache's calls are thread-safe. A DeviceMirror's fields are guarded by
// its `mu` (held for a whole job: one call per device at a time), except `info`, which has
// its own lock so that State() never waits for a running job.
#ifndef CDCCA_CLOUD_INTERNAL_MIRROR_CACHE_H_
#define CDCCA_CLOUD_INTERNAL_MIRROR_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "cloud/internal/holdout_pool.h"
#include "cloud/internal/quarantine_log.h"
#include "cloud/job_report.h"
#include "compress/delta_encoder.h"
#include "compress/named_tensors.h"
#include "distill/replay_buffer.h"

namespace cdcca::cloud::internal {

struct DeviceMirror {
  absl::Mutex mu;  // held for a whole job: one job per device at a time
  uint64_t version = 0;
  uint64_t consumed = 0;
  uint64_t digest = 0;
  uint64_t jobs = 0;
  uint64_t withheld = 0;          // updates the guard withheld since the start
  uint64_t rollbacks = 0;         // since the start
  compress::NamedTensors mirror;  // fp32 CPU; equals the device's state at `version`
  compress::DeltaEncoder encoder;
  std::unique_ptr<distill::ReplayBuffer> replay;
  // The guard's held-out samples up to `consumed` (the newest pool_capacity); built from
  // the sample log at the first job after a load.
  HoldoutPool holdout;
  bool holdout_built = false;
  // The durable pool (pool_samples): the newest trained samples up to `consumed`, each with
  // its batch's sequence, oldest first; built from the sample log at the first job after a
  // load.
  std::deque<std::pair<uint64_t, compress::UplinkSample>> pool;
  bool pool_built = false;
  QuarantineLog quarantine;
  // Jobs that failed in training at cursor `failed_cursor`, in a row (not persisted).
  uint64_t failed_cursor = 0;
  int failed_attempts = 0;
  // Whether the fields above are in memory; MirrorCache::Unload drops them again.
  bool loaded = false;
  // A copy of the fields above for State(), which must not wait for a running job.
  absl::Mutex info_mu;
  DeviceTrainingState info ABSL_GUARDED_BY(info_mu);
  bool info_valid ABSL_GUARDED_BY(info_mu) = false;

  // Copies the fields into `info`. Caller holds mu.
  void PublishInfo();
  // Drops the loaded state (mirror, residual, replay buffer, held-out pool, quarantine log);
  // `info` stays. Caller holds mu.
  void Clear();
};

class MirrorCache {
 public:
  // `max_resident`: idle devices whose state stays in memory; 0 = no bound.
  explicit MirrorCache(size_t max_resident) : max_resident_(max_resident) {}

  // The device's entry (created empty on first sight; never removed, so the pointer stays
  // valid for the cache's life).
  DeviceMirror* Get(const std::string& id);
  // The device's state is in memory now / no more (it was evicted). Caller holds d.mu.
  void MarkLoaded(const std::string& id, DeviceMirror& d);
  void MarkUnloaded(const std::string& id, DeviceMirror& d);
  // After a call that loaded `id` (its mu released): marks it the most recently used and
  // calls `evict` (with the device's mu held) for the least recently used resident devices
  // beyond the bound. A device whose call is running (its mu held) is skipped: the bound may
  // be passed by the devices in use at once, never by idle ones.
  void Touch(const std::string& id,
             absl::FunctionRef<void(const std::string& id, DeviceMirror& d)> evict);
  size_t resident() const;
  uint64_t evictions() const;

 private:
  const size_t max_resident_;
  mutable absl::Mutex mu_;  // guards the map (not the devices' contents)
  std::unordered_map<std::string, std::unique_ptr<DeviceMirror>> devices_ ABSL_GUARDED_BY(mu_);
  // When each device last left a loading call (tick_'s value then).
  std::unordered_map<std::string, uint64_t> last_used_ ABSL_GUARDED_BY(mu_);
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<std::string> resident_ ABSL_GUARDED_BY(mu_);  // DeviceMirror::loaded
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace cdcca::cloud::internal

#endif  // CDCCA_CLOUD_INTERNAL_MIRROR_CACHE_H_
